"""The master process: follow the job, win the lease, decide, publish, snapshot.

Every master (any number per job) keeps a `Replica` of the job's state. One
of them holds the leader lease: it catches up with the stream, publishes its
`master_elected` event fenced on the previous election (so two leaders can
never both be elected), waits to see it folded, and then on every tick runs
the pure `decide` and publishes what it returns, fenced on its own election.
The server rejects the writes of a deposed leader; the leader then steps down
to standby, its folded state still valid. Standbys keep following, ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence

import nats.js.errors
import stamina
import structlog
from msgspec.structs import replace

from rove.control.bus import live, records, retry
from rove.control.bus.client import Bus, Fence
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain import goodput as gp
from rove.control.errors import FencedError, RoveError
from rove.control.master import snapshots
from rove.control.master.decide import decide
from rove.control.master.election import Lease
from rove.control.master.metrics import JobMetrics
from rove.control.master.netcheck import Wait
from rove.control.master.service import JobService
from rove.control.master.silence import Silence
from rove.control.process import aio, logs

log = structlog.get_logger("rove.master")

#: How long a published decision is not re-published while we wait to see it folded.
INFLIGHT_S = 5.0
#: A lease its client has not confirmed (`ShardRequested.answered`) is announced again
#: after this: the answers stream is memory, and its message may be gone.
REANNOUNCE_S = 10.0
#: Facts someone waits on: the leader decides as soon as it folds one, not at the next
#: tick. Data clients wait for their leases (a stream's parked requests for the shards a
#: bridge cuts); a failed or finished round, a node that joins or leaves, a
#: network-check report or a stop wait for the next round or the end.
#: (An acknowledgement is answered only when refused; that waits for the next tick.)
_WAKE_ON = (
    ev.RunStarted,
    ev.ShardRequested,
    ev.StreamShardsAdded,
    ev.DatasetRegistered,
    ev.WorkerExited,
    ev.WorkersSucceeded,
    ev.RdzvJoined,
    ev.NodeLeft,
    ev.NetworkCheckReported,
    ev.StopRequested,
    ev.JobSubmitted,
    ev.ScaleRequested,
    ev.PlanApplied,
    ev.PlanFailed,
    ev.NodeJoined,
)
#: How long a leader that stops waits to fold what is stored before its last snapshot.
STOP_CATCH_UP_S = 5.0
#: Decisions published together that are logged one line each at most (more: one line)
QUIET_OVER = 20
#: Dead letters a leader writes per tick at most (each covers a burst from one sender).
DEAD_LETTERS_PER_TICK = 8
#: Answers to data clients (thousands a second: logged at debug level).
_ANSWERS = (ev.ShardLeased, ev.DataRejected)


class MasterRunner(JobService):
    """Runs one master candidate for `job` until `stop()` (a `JobService` that leads)."""

    follows_heartbeats = False  # read on taking over, not while standing by

    def __init__(
        self,
        bus: Bus,
        job: str,
        master_id: str,
        spec: ev.JobSpec,
        *,
        clock: Callable[[], float] = time.time,
        tick_s: float = 0.25,
        snapshot_every_events: int = 1000,
        snapshot_every_s: float = 30.0,
        until_ended: bool = False,
    ) -> None:
        """`until_ended`: stop once the job ends (a job that had ended before this master
        started is followed until its next run ends)."""
        super().__init__(bus, job, name=f"master {master_id}", clock=clock, tick_s=tick_s)
        self.master_id = master_id
        self.spec = spec
        self.snapshot_every_events = snapshot_every_events
        self.snapshot_every_s = snapshot_every_s
        self.metrics = JobMetrics(job)
        self._role = "starting"
        self.fence: Fence | None = None
        self.lease: Lease | None = None
        self._inflight: dict[str, float] = {}
        #: leases announced by this leader, and when (monotonic)
        self._announced: dict[str, float] = {}
        #: the active nodes by when they were last heard from (while leading)
        self.silence = Silence()
        #: (stream, subject: who sent them) -> rejections no dead letter covers yet
        self._unrecorded: dict[tuple[str, str], list[records.Rejection]] = {}
        #: (stream, subject) -> the newest sequence a dead letter covers
        self._recorded: dict[tuple[str, str], int] = {}
        self._last_snapshot_seq = 0
        self._last_snapshot_at = 0.0
        self._waiting = ""
        self._scale_waiting = ""
        self.until_ended = until_ended
        #: the sequence this master had caught up to when it began serving
        self._served_from: int | None = None
        self.log = log.bind(job=job, master=master_id)

    @property
    def role(self) -> str:
        """starting, standby, electing or leader."""
        return self._role

    @role.setter
    def role(self, role: str) -> None:
        self._role = role
        self.metrics.leader(role == "leader")

    # ------------------------------------------------------------------ hooks from the replica

    def on_event(self, rec: records.Recorded) -> None:
        if (
            self.until_ended
            and isinstance(rec.event, ev.JobEnded)
            and self._served_from is not None
            and rec.seq > self._served_from
        ):
            self.log.info(
                f"job {self.job} {rec.event.phase.value}; this master stops "
                "(rove master --keep-serving stays for the job's next run)"
            )
            self.stop()
        self._inflight.pop(rec.event.id, None)
        if isinstance(rec.event, ev.NodeJoined) and self.role == "leader":
            at = self.clock()  # heard now, whatever the node's clock stamped
            self.replica.heard_from(rec.event.node, rec.event.incarnation, at)
            self.silence.joined(rec.event, at)
        self.metrics.observe(rec.event, self.state)
        if type(rec.event) in _WAKE_ON:
            self.wake()  # a data client waits for its answer: decide now
        if isinstance(rec.event, ev.EventRejected):
            e = rec.event
            key = (e.stream, e.subject)
            self._recorded[key] = max(self._recorded.get(key, 0), e.upto)
            left = [r for r in self._unrecorded.get(key, ()) if r.seq > e.upto]
            if left:
                self._unrecorded[key] = left
            else:
                self._unrecorded.pop(key, None)

    def on_snapshot(self, loaded: snapshots.Loaded) -> None:
        # the job's goodput so far, not since the snapshot; and never the events before
        # it twice (a catch-up that failed and starts again from a snapshot): a snapshot
        # without a ledger (older rove) starts one afresh, from its prefix on
        self.metrics.ledger = loaded.goodput if loaded.goodput is not None else gp.Ledger()

    def on_rejected(self, rej: records.Rejection) -> None:
        key = (rej.stream, rej.subject)
        if rej.seq > self._recorded.get(key, 0):
            self._unrecorded.setdefault(key, []).append(rej)  # in stream order

    # ------------------------------------------------------------------ main loop

    async def serve(self) -> None:
        self._served_from = self.state.applied_seq
        self._last_snapshot_seq = self.replica.snapshot_seq
        kv, ttl = await self.bus.lease_bucket()
        self.lease = Lease(kv, self.job, self.master_id, ttl)
        self.role = "standby"
        self.log.info(
            "master is following the job",
            applied_seq=self.state.applied_seq,
            leader=self.state.leader or None,
            epoch=self.state.epoch,
        )
        self._hearing = live.Hearing(self.bus, self.clock)
        try:
            while not self.stopping:
                epoch = await self.lease.try_acquire()
                if epoch is None:
                    await self.sleep(min(self.lease.renew_every_s, 1.0) / 2)
                    continue
                await self._hold(epoch)
                if self.stopping:
                    break  # still the leader: the last snapshot below is written
                self.fence = None
                self.role = "standby"
                self.silence.stop()
                await self.replica.unfollow_heartbeats()
        finally:
            self._hearing.close()
            if self.role == "leader":
                # the last snapshot covers everything stored now: the next master to
                # start replays nothing this one had not folded yet
                with contextlib.suppress(TimeoutError, RoveError):
                    await self.replica.catch_up(timeout_s=STOP_CATCH_UP_S)
                await self._write_snapshot()
            if self.lease is not None:
                await self.lease.release()

    async def _hold(self, epoch: int) -> None:
        """Lead while the lease is ours; return when it is lost or we stop."""
        assert self.lease is not None
        while not self.stopping:
            try:
                await self._lead(epoch)
                return
            except FencedError as exc:
                # The fence broke. If our lease CAS still succeeds nobody else
                # can have been elected: a stray message landed on the election
                # subject, so elect ourselves again. Otherwise we were deposed.
                if self.lease.revision is not None and await self.lease.renew():
                    self.log.warning(
                        "fence broken by a non-election message; re-electing", error=str(exc)
                    )
                    await self.sleep(0.05)
                    continue
                self.log.warning("deposed: stepping down to standby", epoch=epoch, reason=str(exc))
                return
            except Exception as exc:
                # the bus away, or JetStream not answering yet (every server of a
                # cluster restarted: no stream has a leader): lead again once it answers.
                # (`retry.backoff` counts rove's BusUnavailableError as "not now" too.)
                if not retry.backoff(exc):
                    raise
                self.log.warning(
                    "lost the bus while leading; stepping down",
                    error=str(exc) or type(exc).__name__,
                )
                await self.lease.release()
                return

    async def _lead(self, epoch: int) -> None:
        # The lease is renewed by a task of its own from the moment it is won: catching
        # up, the first snapshot of a large job, a long tick (a round of 25,000 members,
        # a wave of lost nodes) must not let it lapse. A leader paused past its lease
        # still tries its writes and the server refuses them (the fence), which is the
        # guarantee; the renewal is only the fast path.
        renewer = asyncio.create_task(self._keep_lease(), name="lease renewal")
        try:
            await self._elected_then_lead(epoch, renewer)
        finally:
            await aio.cancel_and_wait([renewer])

    async def _elected_then_lead(self, epoch: int, renewer: asyncio.Task[None]) -> None:
        assert self.lease is not None
        self.role = "electing"
        self.log.info("won the leader lease; catching up", epoch=epoch)
        if self.bus.options.create_streams:
            # a server restarted loses its memory streams (the heartbeats): the new
            # leader puts them back before it reads them
            await self.bus.ensure_streams()
        await self.replica.catch_up(timeout_s=self.lease.ttl_s)
        previous = await self._election_fence(epoch)
        await self.replica.wait_applied(previous.seq, timeout_s=self.lease.ttl_s)
        elected = ev.MasterElected(
            # the same id for every attempt of this election: a retry is stored once
            **ev.envelope(
                self.job,
                f"master:{self.master_id}",
                self.clock(),
                "elected",
                epoch,
                previous.seq,
            ),
            epoch=epoch,
            master=self.master_id,
        )
        seq = await self.bus.publish(elected, fence=previous)
        self.fence = Fence(subjects.master_elected(self.job), seq)
        self._announced = {}  # a new leader announces every pending lease again
        await self.replica.wait_applied(seq, timeout_s=self.lease.ttl_s)
        await self.replica.follow_heartbeats()  # the newest of every node, then live
        self.silence.start(self.state, self.clock())
        self.role = "leader"
        self.log.info(
            "elected leader",
            epoch=epoch,
            applied_seq=self.state.applied_seq,
            nodes=len(self.state.nodes),
        )
        await self._configure(epoch)
        await self._write_snapshot()
        while not self.stopping:
            if renewer.done():
                renewer.result()  # raises why the lease was lost (or how renewal failed)
            await self._tick(epoch)
            await self.doze()

    async def _keep_lease(self) -> None:
        """Renew the lease every `renew_every_s`; raise once it is lost."""
        assert self.lease is not None
        while True:
            await asyncio.sleep(self.lease.renew_every_s)
            if not await self.lease.renew():
                self.wake()  # the loop raises it at once, not after its doze
                raise FencedError("the leader lease expired or was taken")

    async def _configure(self, epoch: int) -> None:
        """Configure the job's run (its settings, and a name for its shared memory),
        unless a leader did already."""
        if self.state.spec is not None:
            return
        run = self.state.run
        await self._publish(
            ev.JobConfigured(
                # one id whatever the epoch: only the first leader configures the run
                **ev.envelope(
                    self.job,
                    f"master:{self.master_id}",
                    self.clock(),
                    "job_configured",
                    *(() if run == 1 else (run,)),
                ),
                epoch=epoch,
                spec=self.spec,
            )
        )

    async def _election_fence(self, epoch: int) -> Fence:
        """Fence for our `master_elected`: the last message now on the election subject.

        Raises:
            FencedError: that message is a newer master's election.
        """
        subject = subjects.master_elected(self.job)
        # from the stream's leader, sequence and body in one answer (two direct gets, seen
        # on a 3-node cluster that lost its quorum, were answered by replicas that did
        # not agree, and the master died of that "not found")
        seq, data = await self.bus.last_message(subjects.EVENTS_STREAM, subject)
        if seq:
            item = records.read(subjects.EVENTS_STREAM, seq, subject, data)
            newer = (
                isinstance(item, records.Recorded)
                and isinstance(item.event, ev.MasterElected)
                and item.event.epoch > epoch
            )
            if newer:
                raise FencedError(f"a newer master was elected (stream seq {seq})")
        return Fence(subject, seq)

    async def _tick(self, epoch: int) -> None:
        if self.state.epoch != epoch:
            raise FencedError(
                f"master {self.state.leader} was elected with epoch {self.state.epoch}"
            )
        await self._configure(epoch)  # a new run of the job, since the election
        now = self.clock()
        # lost nodes: only those silent for the node timeout are looked at (a scan of
        # every node cost 0.1 s a tick at 25,000 nodes)
        liveness, heard, spec = self.replica.liveness, self.replica.heard, self.state.spec
        suspects = (
            self.silence.suspects(self.state, liveness, now, spec.node_timeout_s, heard)
            if spec
            else []
        )
        hearing = self._hearing.since()
        decisions, waiting, scale_waiting = decide(
            self.state,
            liveness,
            now,
            suspects=suspects,
            hearing_since=hearing,
            heard=heard,
            clock_off=self.replica.clock_off,
        )
        self._say_why_not(waiting, scale_waiting)
        # Decisions one at a time, in order, except a run of lost nodes: independent of
        # each other (10% of 25,000 nodes lost at once is 2,500 of them), they go
        # together, as do the answers to data clients after the decisions. Those a
        # clustered stream refuses as busy (a fenced write checked while another is
        # being proposed) go one at a time after them: one server takes them all at
        # once, a cluster in turn (benchmarks/fenced.py).
        answers = [d for d in decisions if isinstance(d, ev.DataRejected)]
        leases = [d for d in decisions if isinstance(d, ev.ShardLeased)]
        lost: list[ev.Decision] = []
        for decision in decisions:
            if isinstance(decision, ev.NodeLost):
                lost.append(decision)
            elif not isinstance(decision, _ANSWERS):
                await self._publish_together(lost)
                lost = []
                await self._publish(decision)
        await self._publish_together(lost)
        await self._publish_together(answers)
        await self._announce(leases)
        # Dead letters after the decisions, a burst per sender in one, a few per tick: a
        # flood of garbage never delays a decision (each was once a fenced write of its
        # own, ahead of them). A rejection is forgotten when its dead letter is folded.
        bursts = sorted(self._unrecorded.values(), key=lambda burst: burst[0].seq)
        for burst in bursts[:DEAD_LETTERS_PER_TICK]:
            await self._publish(
                records.dead_letter(
                    self.job, burst, master=self.master_id, epoch=self.state.epoch, now=now
                )
            )
        if self._snapshot_due(now):
            await self._write_snapshot()

    def _say_why_not(self, waiting: Wait | None, scale_waiting: Wait | None) -> None:
        """Log why the rendezvous waits, and why the optimiser plans nothing yet, once
        each time a reason changes."""
        reason = waiting.reason if waiting is not None else ""
        if reason != self._waiting:
            self._waiting = reason
            if reason:
                self.log.info(f"not yet: {reason}", round=self.state.rdzv.round)
        reason = scale_waiting.reason if scale_waiting is not None else ""
        if reason != self._scale_waiting:
            self._scale_waiting = reason
            if reason:
                self.log.info(f"no plan yet: {reason}", plans=self.state.scale.plans)

    async def _publish_together(self, decisions: Sequence[ev.Decision]) -> None:
        """Publish independent decisions at once; those refused as busy, in turn. More
        than a few are logged in one line (2,500 lost nodes are not 2,500 lines)."""
        if len(decisions) == 1:
            await self._publish(decisions[0])
        elif decisions:
            quiet = len(decisions) > QUIET_OVER
            sent = await asyncio.gather(
                *(self._publish(d, busy_retried=False, quiet=quiet) for d in decisions),
                return_exceptions=True,
            )
            for decision, outcome in zip(decisions, sent, strict=True):
                if isinstance(outcome, nats.js.errors.APIError):
                    await self._publish(decision, quiet=quiet)
                elif isinstance(outcome, BaseException):
                    raise outcome
            if quiet and not isinstance(decisions[0], _ANSWERS):
                kinds = sorted({ev.kind(d) for d in decisions})
                nodes = [n for d in decisions if isinstance(n := getattr(d, "node", None), str)]
                self.log.info(
                    f"decided {len(decisions)} {' and '.join(kinds)}",
                    nodes=logs.some(nodes, 10) or None,
                )

    async def _announce(self, leases: Sequence[ev.ShardLeased]) -> None:
        """Announce the grants of the fold not yet announced (or not for `REANNOUNCE_S`),
        all at once, to the answers stream. Not fenced: any master that folded a request
        announces the very same grant (same id, deduplicated), so a deposed one's
        announcement is no different from the leader's. Announced again, a grant has an
        id of its own, so that the stream stores it even if it still remembers the
        first one's id (its client keeps one of the two)."""
        mono = time.monotonic()
        due = [e for e in leases if self._announced.get(e.id, -REANNOUNCE_S) + REANNOUNCE_S <= mono]
        again = [
            e if e.id not in self._announced else replace(e, id=f"{e.id}:again:{mono:.0f}")
            for e in due
        ]
        await asyncio.gather(*(self.bus.publish(e) for e in again))
        sent = {e.id for e in due}
        # what the fold no longer holds is forgotten: its client confirmed it
        self._announced = {e.id: mono if e.id in sent else self._announced[e.id] for e in leases}

    async def _publish(
        self, decision: ev.Decision, *, busy_retried: bool = True, quiet: bool = False
    ) -> None:
        assert self.fence is not None
        mono = time.monotonic()
        if self._inflight.get(decision.id, 0.0) > mono:
            return
        self._inflight[decision.id] = mono + INFLIGHT_S
        try:
            seq = await self.bus.publish(decision, fence=self.fence, busy_retried=busy_retried)
        except BaseException:
            self._inflight.pop(decision.id, None)
            raise
        if isinstance(decision, ev.DataRejected):
            say = self.log.warning  # bad input from a trainer: visible, with its reason
        elif isinstance(decision, _ANSWERS) or quiet:
            say = self.log.debug  # one per lease: thousands a second; or one of a batch
        else:
            say = self.log.info
        say(
            f"decided {ev.kind(decision)}",
            seq=seq,
            **{k: v for k, v in _key_fields(decision).items()},
        )

    def _snapshot_due(self, now: float) -> bool:
        return snapshots.due(
            self.state.applied_seq - self._last_snapshot_seq,
            len(self.state.nodes),
            now - self._last_snapshot_at,
            every_events=self.snapshot_every_events,
            every_s=self.snapshot_every_s,
        )

    async def _write_snapshot(self) -> None:
        state = self.state
        if state.applied_seq <= self._last_snapshot_seq:
            return
        try:
            await snapshots.save(
                self.bus,
                state,
                master=self.master_id,
                now=self.clock(),
                goodput=self.metrics.ledger,
            )
        except Exception as exc:  # (a snapshot only shortens a replay: never worth leading)
            if not retry.backoff(exc):  # "not now" (PublishDeadlineError is one): next tick
                raise
            self.log.warning(
                "could not write a snapshot; will retry", error=str(exc) or type(exc).__name__
            )
            return
        self._last_snapshot_seq = state.applied_seq
        self._last_snapshot_at = self.clock()


def _key_fields(decision: ev.Decision) -> dict[str, object]:
    match decision:
        case ev.NodeLost():
            return {"node": decision.node, "last_seen": round(decision.last_seen, 3)}
        case ev.JobEnded():
            return {"phase": decision.phase.value, "reason": decision.reason}
        case ev.EventRejected():
            return {
                "stream": decision.stream,
                "stream_seq": decision.stream_seq,
                "count": decision.count,
                "subject": decision.subject,
            }
        case ev.DataRejected():
            return {
                "dataset": decision.dataset,
                "client": decision.client,
                "reason": decision.reason,
            }
        case ev.ShardRequeued():
            return {
                "dataset": decision.dataset,
                "shards": len(decision.shards),
                "why": decision.reason,
            }
        case ev.DataRestored():
            return {"dataset": decision.dataset, "round": decision.round, "step": decision.step}
    return {}


class SupervisedMaster:
    """Runs a master candidate in this process and restarts it if it crashes.

    `rove run --standalone` runs its job's master this way. The master is a
    fold of the stream, so a fresh one picks up exactly where the crashed one
    was (from its snapshot and the tail). Restarts back off with rove's retry
    policy (stamina), from 0.5 s up to 10 s between them.
    """

    def __init__(self, bus: Bus, job: str, master_id: str, spec: ev.JobSpec) -> None:
        self.bus, self.job, self.master_id, self.spec = bus, job, master_id, spec
        self.runner: MasterRunner | None = None
        self._stopping = False

    async def run(self) -> None:
        async for attempt in stamina.retry_context(
            on=self._crashed, attempts=None, timeout=None, wait_initial=0.5, wait_max=10.0
        ):
            with attempt:
                if self._stopping:
                    return
                self.runner = MasterRunner(self.bus, self.job, self.master_id, self.spec)
                await self.runner.run()
                return

    def _crashed(self, exc: BaseException) -> bool:
        """The supervisor's job: log the crash with its traceback, restart the master."""
        if self._stopping:
            return False
        log.error(
            "the in-process master crashed; restarting it",
            job=self.job,
            master=self.master_id,
            exc_info=exc,
        )
        return True

    def stop(self) -> None:
        self._stopping = True
        if self.runner is not None:
            self.runner.stop()
