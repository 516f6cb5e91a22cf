"""A live, folded copy of one job's state, rebuilt from the bus.

`Replica.start()` loads the newest snapshot, replays only the tail of the
event stream after it (callback consumer), reads the newest heartbeat of every
node, and then keeps following both. Masters (leader and standbys) and
`rove status` all use it; only the leader acts on what it sees.

A standby master does not follow heartbeats (`heartbeats=False`): at 10,000 nodes
they cost a follower 0.2-0.3 cores for nothing it uses. It reads them when it takes
over (`follow_heartbeats()`: the newest of every node, then the live ones), and
stops when it steps down.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from rove.control.bus import records, retry
from rove.control.bus.client import Bus
from rove.control.bus.feed import Feed
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import LostEventsError
from rove.control.master import continuity, snapshots
from rove.control.master.evolve import evolve
from rove.control.master.state import JobState, initial

log = structlog.get_logger("rove.replica")


class Replica:
    """Folded state of `job`, following the stream.

    `on_applied(recorded)` and `on_rejected(rejection)` are optional hooks
    called after each event is folded and for each bad stored message.
    """

    def __init__(
        self,
        bus: Bus,
        job: str,
        *,
        use_snapshot: bool = True,
        heartbeats: bool = True,
        on_applied: Callable[[records.Recorded], None] | None = None,
        on_rejected: Callable[[records.Rejection], None] | None = None,
    ) -> None:
        self.bus = bus
        self.job = subjects.check_name("job", job)
        self.use_snapshot = use_snapshot
        self.heartbeats = heartbeats
        self.state: JobState = initial(job)
        self.liveness: dict[str, ev.Heartbeat] = {}
        self.snapshot_seq = 0
        #: Newest event-stream sequence handled, folded or rejected.
        self.seen_seq = 0
        self._on_applied = on_applied
        self._on_rejected = on_rejected
        self._events: Feed | None = None
        self._heartbeats: Feed | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    async def start(self) -> None:
        """Rebuild from snapshot + tail, then follow. Returns when caught up."""
        if self.use_snapshot:
            snap = await snapshots.load(self.bus, self.job)
            if snap is not None:
                first, last = await self.bus.stream_bounds(subjects.EVENTS_STREAM)
                lost = continuity.problem(snap.applied_seq, first, last)
                if lost is not None:
                    log.error("cannot rebuild the job", job=self.job, reason=lost)
                    raise LostEventsError(f"job {self.job}: {lost}")
                self.state = snap
                self.snapshot_seq = snap.applied_seq
                self.seen_seq = snap.applied_seq
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
        """Read the newest heartbeat of every node, then follow them (returns when
        caught up; at once if already following)."""
        if self._heartbeats is None:
            # (a master taking over just after a quorum loss may hear 503 for a while)
            self._heartbeats = await retry.call(
                lambda _t: self.bus.subscribe(
                    subjects.HEARTBEAT_STREAM,
                    subjects.job_heartbeats(self.job),
                    self._heartbeat,
                    self._reject,
                    last_per_subject=True,
                ),
                what=f"the heartbeats of job {self.job}",
                deadline_s=30.0,
                attempt_s=30.0,
            )
        await self._heartbeats.caught_up.wait()

    async def unfollow_heartbeats(self) -> None:
        """Stop following heartbeats and forget them (a master stepping down)."""
        feed, self._heartbeats = self._heartbeats, None
        if feed is not None:
            await feed.stop()
        self.liveness = {}

    async def stop(self) -> None:
        """Stop following (what was folded and heard stays readable)."""
        feeds, self._heartbeats = (self._events, self._heartbeats), None
        for feed in feeds:
            if feed is not None:
                await feed.stop()

    def _apply(self, rec: records.Recorded) -> None:
        if rec.seq <= self.seen_seq:
            return  # already handled (an ordered consumer may redeliver after a reset)
        if not isinstance(rec.event, ev.Heartbeat):
            self.state = evolve(self.state, rec.event, rec.seq)
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

    def _heartbeat(self, rec: records.Recorded) -> None:
        hb = rec.event
        if not isinstance(hb, ev.Heartbeat):
            return
        known = self.liveness.get(hb.node)
        if known is None or known.incarnation != hb.incarnation or known.seq < hb.seq:
            self.liveness[hb.node] = hb

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
