"""A live, folded copy of one job's state, rebuilt from the bus.

`Replica.start()` loads the newest snapshot, replays only the tail of the
event stream after it (callback consumer), reads the newest heartbeat of every
node, and then keeps following both. Masters (leader and standbys) and
`rove status` all use it; only the leader acts on what it sees.

A standby master does not follow heartbeats (`heartbeats=False`): at 10,000 nodes
they cost a follower 0.2-0.3 cores for nothing it uses. It reads them when it takes
over (`follow_heartbeats()`: the live ones, and the newest stored of every node), and
stops when it steps down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import nats.errors
import structlog

from rove.control.bus import live, records, retry
from rove.control.bus.client import Bus
from rove.control.bus.feed import Feed
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import LostEventsError, RoveError
from rove.control.master import continuity, snapshots
from rove.control.master.evolve import evolve
from rove.control.master.silence import Heard, replaces
from rove.control.master.skew import SKEW_SAID_S
from rove.control.master.state import JobState, initial
from rove.control.process import aio

log = structlog.get_logger("rove.replica")

#: At most one line every this many seconds says so.
SKEW_SAY_EVERY_S = 60.0


class Replica:
    """Folded state of `job`, following the stream.

    `on_applied(recorded)` and `on_rejected(rejection)` are optional hooks
    called after each event is folded and for each bad stored message;
    `on_snapshot(loaded)` once the snapshot it starts from is read, before the
    events after it. `use_snapshot` may be a test of the newest snapshot: one it
    refuses is not used, and the whole stream is replayed.
    """

    def __init__(
        self,
        bus: Bus,
        job: str,
        *,
        use_snapshot: bool | Callable[[snapshots.Loaded], bool] = True,
        heartbeats: bool = True,
        live_heartbeats: bool = True,
        clock: Callable[[], float] = time.time,
        on_applied: Callable[[records.Recorded], None] | None = None,
        on_rejected: Callable[[records.Rejection], None] | None = None,
        on_snapshot: Callable[[snapshots.Loaded], None] | None = None,
    ) -> None:
        self.bus = bus
        self.job = subjects.check_name("job", job)
        self.use_snapshot = use_snapshot
        self.heartbeats = heartbeats
        #: False: the newest stored heartbeat of each node only (`rove status`, which
        #: reads the job once), no live subscription
        self.live_heartbeats = live_heartbeats
        self.clock = clock
        self.state: JobState = initial(job)
        self.liveness: dict[str, ev.Heartbeat] = {}
        #: when each node was last heard live, by this process's clock: its newest live
        #: heartbeat's arrival (and a leader's `heard_from` at a join); what a leader
        #: judges silence by (`silence.last_heard`), whatever the node's clock says.
        #: Without live heartbeats: when the server stored its newest, by the server's
        #: clock (`_heartbeat`)
        self.heard: dict[str, Heard] = {}
        #: the nodes whose clocks are off this process's by `SKEW_SAID_S` or more: by
        #: how much, from their newest live heartbeats (`skew`; said by `_skewed`);
        #: without live heartbeats, off the server's, from their newest stored ones
        self.clock_off: dict[str, float] = {}
        self._skew_said_at = -SKEW_SAY_EVERY_S
        self.snapshot_seq = 0
        #: Newest event-stream sequence handled, folded or rejected.
        self.seen_seq = 0
        self._on_applied = on_applied
        self._on_rejected = on_rejected
        self._on_snapshot = on_snapshot
        self._events: Feed | None = None
        #: stops the live heartbeats, and the re-reading of them on each reconnection
        self._live: Callable[[], Awaitable[None]] | None = None
        self._unhook: Callable[[], None] = lambda: None
        #: heartbeat subjects whose stored message is being read again (a bad live one)
        self._looking: set[str] = set()
        self._tasks = aio.Supervisor(f"the replica of job {job}", log, lambda _why: None)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    async def start(self) -> None:
        """Rebuild from snapshot + tail, then follow. Returns when caught up."""
        if self.use_snapshot:
            loaded = await snapshots.load(self.bus, self.job)
            wanted = self.use_snapshot is True or (
                loaded is not None and callable(self.use_snapshot) and self.use_snapshot(loaded)
            )
            if loaded is not None and wanted:
                snap = loaded.state
                first, last = await self.bus.stream_bounds(subjects.EVENTS_STREAM)
                lost = continuity.problem(snap.applied_seq, first, last)
                if lost is not None:
                    log.error("cannot rebuild the job", job=self.job, reason=lost)
                    raise LostEventsError(f"job {self.job}: {lost}")
                self.state = snap
                self.snapshot_seq = snap.applied_seq
                self.seen_seq = snap.applied_seq
                if self._on_snapshot is not None:
                    self._on_snapshot(loaded)  # before the tail's events are handed on
                log.info(
                    "loaded snapshot", job=self.job, applied_seq=snap.applied_seq, epoch=snap.epoch
                )
        self._events = await self.bus.subscribe(
            subjects.EVENTS_STREAM,
            subjects.job_events(self.job),
            self._apply,
            self._reject,
            start_seq=self.state.applied_seq + 1,
        )
        if self.heartbeats:
            await self.follow_heartbeats()
        await self._events.caught_up.wait()

    async def follow_heartbeats(self) -> None:
        """Follow the live heartbeats, then read the newest stored one of every node
        (returns once read; at once if already following).

        Live ones come through a core NATS subscription (`rove.control.bus.live`): at
        25,000 nodes a leader reads 25,000 a second, 9 µs each that way against 19 µs
        through a JetStream consumer (`benchmarks/heartbeat_path.py`). The stream still
        stores the newest of every node: that is what is read here, by a master taking
        over, and again after each reconnection (what was sent while away)."""
        if self._live is not None:
            return
        if self.live_heartbeats:
            self._live = await live.listen(
                self.bus, subjects.job_heartbeats(self.job), self._live_heartbeat
            )
            self._unhook = live.on_reconnected(self.bus, self._reread_heartbeats)
        await self._read_stored_heartbeats()

    async def _read_stored_heartbeats(self) -> None:
        # (a master taking over just after a quorum loss may hear 503 for a while)
        feed = await retry.call(
            lambda _t: self.bus.subscribe(
                subjects.HEARTBEAT_STREAM,
                subjects.job_heartbeats(self.job),
                self._heartbeat,
                self._reject,
                last_per_subject=True,
                stored_times=not self.live_heartbeats,  # (`_heartbeat`)
            ),
            what=f"the heartbeats of job {self.job}",
            deadline_s=30.0,
            attempt_s=30.0,
        )
        try:
            await feed.caught_up.wait()
        finally:
            await feed.stop()

    def _reread_heartbeats(self) -> None:
        if self._live is not None:
            self._tasks.spawn(self._read_again())

    async def _read_again(self) -> None:
        """After a reconnection of the leader: the memory streams put back (a server
        restarted, or every server of a cluster, lost them: the leases' answers would
        fail to publish until the leader stepped down and led again), then the stored
        heartbeats (the live ones go on meanwhile)."""
        try:
            if self.bus.options.create_streams:
                await self.bus.ensure_streams()
            await self._read_stored_heartbeats()
        except (nats.errors.Error, RoveError) as exc:
            log.warning(
                "could not put the memory streams back or read the stored heartbeats "
                "after reconnecting; "
                "the live ones go on",
                job=self.job,
                error=str(exc) or type(exc).__name__,
            )

    async def unfollow_heartbeats(self) -> None:
        """Stop following heartbeats and forget them (a master stepping down)."""
        await self._stop_heartbeats()
        self.liveness, self.heard = {}, {}

    async def stop(self) -> None:
        """Stop following (what was folded and heard stays readable)."""
        await self._stop_heartbeats()
        if self._events is not None:
            await self._events.stop()

    async def _stop_heartbeats(self) -> None:
        live, self._live = self._live, None
        self._unhook()
        self._unhook = lambda: None
        if live is not None:
            await live()
        await aio.cancel_and_wait(self._tasks.side)

    def _apply(self, rec: records.Recorded) -> None:
        if rec.seq <= self.seen_seq:
            return  # already handled (an ordered consumer may redeliver after a reset)
        if not isinstance(rec.event, ev.Heartbeat):
            try:
                self.state = evolve(self.state, rec.event, rec.seq)
            except Exception:
                # a bug of the fold, not bad input (that is refused inside it): said
                # loudly, and the event skipped by every replica alike, so the job goes on
                log.exception(
                    "the fold failed on an event (a bug in rove; please report it): "
                    "the event is skipped",
                    job=self.job,
                    seq=rec.seq,
                    kind=ev.kind(rec.event),
                    event_id=rec.event.id,
                )
            else:
                if self._on_applied is not None:
                    self._on_applied(rec)
        self.seen_seq = rec.seq
        if self._waiters:
            self._seen(rec.seq)

    def _seen(self, seq: int) -> None:
        self.seen_seq = seq
        if self._waiters:
            waiting = []
            for target, fut in self._waiters:
                if seq >= target:
                    if not fut.done():
                        fut.set_result(None)
                else:
                    waiting.append((target, fut))
            self._waiters = waiting

    def _live_heartbeat(self, subject: str, payload: bytes) -> None:
        hb = records.read_heartbeat(self.job, subject, payload)
        if type(hb) is ev.Heartbeat:
            if self._heard(hb):
                at = self.clock()
                self.heard[hb.node] = Heard(hb.incarnation, at)
                if self.clock_off or not -SKEW_SAID_S < at - hb.ts < SKEW_SAID_S:
                    self._skewed(hb, at)
        elif subject not in self._looking:
            # a live message has no stream sequence: the stored one is read again, and
            # what is wrong with it recorded as any stored message is (one look at a
            # time per subject, however many arrive)
            self._looking.add(subject)
            self._tasks.spawn(self._look_again(subject))

    async def _look_again(self, subject: str) -> None:
        try:
            msg = await self.bus.js.get_last_msg(subjects.HEARTBEAT_STREAM, subject, direct=True)
        except nats.errors.Error as exc:
            log.debug("could not read a heartbeat again", subject=subject, error=str(exc))
            return
        finally:
            self._looking.discard(subject)
        item = records.read(subjects.HEARTBEAT_STREAM, msg.seq or 0, subject, msg.data or b"")
        if type(item) is records.Recorded:
            self._heartbeat(item)
        else:
            assert isinstance(item, records.Rejection)
            self._reject(item)

    def _heartbeat(self, rec: records.Recorded) -> None:
        hb = rec.event
        if not isinstance(hb, ev.Heartbeat) or not self._heard(hb):
            return
        if not self.live_heartbeats and rec.stored:
            # a reader of the stored heartbeats only (`rove status`) hears a node when the
            # server stored its newest, by the server's clock, and measures the node's
            # clock against it as a leader does against a live heartbeat's arrival
            self.heard[hb.node] = Heard(hb.incarnation, rec.stored)
            self._clock_measured(hb, rec.stored)

    def _heard(self, hb: ev.Heartbeat) -> bool:
        # the newest: by its sequence within an incarnation, else by its time (the
        # stored ones read after the live ones began may be older than those), never
        # an old incarnation's over the node's current one's (`silence.replaces`)
        record = self.state.nodes.get(hb.node)
        current = record.incarnation if record is not None else None
        if replaces(self.liveness.get(hb.node), hb, current):
            self.liveness[hb.node] = hb
            return True
        return False

    def heard_from(self, node: str, incarnation: str, at: float) -> None:
        """`node`'s `incarnation` was heard live `at` (this process's clock)."""
        self.heard[node] = Heard(incarnation, at)

    def _clock_measured(self, hb: ev.Heartbeat, at: float) -> bool:
        """Keep by how much `hb`'s node's clock is off, from its stamp and when it was
        heard (`at`), when by `SKEW_SAID_S` or more, else forget it; whether it is newly
        off."""
        skew = at - hb.ts
        if abs(skew) < SKEW_SAID_S:
            if self.clock_off:
                self.clock_off.pop(hb.node, None)
            return False
        known = hb.node in self.clock_off
        self.clock_off[hb.node] = skew
        return not known

    def _skewed(self, hb: ev.Heartbeat, at: float) -> None:
        """Record by how much a node's clock is off this process's, when by `SKEW_SAID_S`
        or more, as its live heartbeat's stamp and arrival tell (the arrival's delay
        included: milliseconds), for the leader's decisions (`skew`). Say so once per
        node while it stays off, and at most one line every
        `SKEW_SAY_EVERY_S` (with how many others are off: a thousand skewed nodes are
        one line, not a thousand)."""
        if not self._clock_measured(hb, at):
            return
        skew = self.clock_off[hb.node]
        now = time.monotonic()
        if now < self._skew_said_at + SKEW_SAY_EVERY_S:
            return
        self._skew_said_at = now
        way = "behind" if skew > 0 else "ahead of"
        others = len(self.clock_off) - 1
        also = f" (and {others} other nodes' by {SKEW_SAID_S:.0f}s or more)" if others else ""
        log.warning(
            f"node {hb.node}'s clock is {abs(skew):.1f}s {way} this master's{also}, by their "
            "heartbeats' stamps against their arrival: rove reads its silence, rendezvous "
            "and data leases on this master's clock, but the times of its steps and "
            "failures (rove goodput, rove events) are off by as much; set the machines' "
            "clocks right (NTP: chrony, timedatectl)",
            job=self.job,
            node=hb.node,
            skew_s=round(skew, 3),
            nodes_off=others + 1,
        )

    def _reject(self, rej: records.Rejection) -> None:
        if rej.stream == subjects.EVENTS_STREAM and rej.seq <= self.seen_seq:
            return
        if self._on_rejected is not None:
            self._on_rejected(rej)
        if rej.stream == subjects.EVENTS_STREAM:
            self._seen(rej.seq)

    async def wait_applied(self, seq: int, timeout_s: float | None = None) -> None:
        """Wait until the message at stream sequence `seq` (or a later one) is handled."""
        if self.seen_seq >= seq:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        try:
            await asyncio.wait_for(fut, timeout_s)
        finally:
            self._waiters = [(t, f) for t, f in self._waiters if f is not fut]

    async def catch_up(self, timeout_s: float | None = None) -> int:
        """Fold everything stored right now; returns the sequence reached."""
        target = await self.bus.last_seq(subjects.EVENTS_STREAM, subjects.job_events(self.job))
        await self.wait_applied(target, timeout_s)
        return target
