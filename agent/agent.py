"""The node agent: joins rounds, runs this node's workers, reports what happens.

One **actor** handles, one at a time, everything that changes what the agent
does: the master's decisions (`round_completed`, `node_lost`, `node_excluded`,
`job_ended`, ...), the end of its workers, a hang, a network-check result and
signals. Only it starts and stops workers, so they never race. Around it:

* a **watcher** per round waits on the worker processes themselves (the
  runtime's `wait`, on pidfds) and hands their end to the actor;
* the **duties** tick reports and persists checkpoints (`CheckpointDuty`),
  report the workers' progress as facts (`ProgressReports`), detect hangs (no
  step progress for `--hang-timeout`), learn what warm workers import (`Learning`)
  and say a long wait for a round on the console (`RoundWait`);
* the **heartbeat** (`Heartbeat`) publishes liveness, progress and resources.

What a worker is, is the `WorkerRuntime`'s business (torch today). Facts go
through the agent's `Outbox` (`NodeFacts`), so they are kept and sent later
while the bus is unreachable; workers keep training meanwhile (persisting waits for
the bus: `rove.agent.fence`). Decisions from a master epoch older than the newest
seen are ignored. The lifecycle is `rove.agent.lifecycle.AgentPhase`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from rove.agent import checkrun, child, ports, progress, round_start, round_wait, warm
from rove.agent.ckpt_duty import CheckpointDuty, run_name
from rove.agent.config import AgentConfig
from rove.agent.endings import Endings, store_port_taken
from rove.agent.exit_watch import ExitWatch, Verdict
from rove.agent.facts import NodeFacts
from rove.agent.faults import FaultPlan
from rove.agent.heartbeat import Heartbeat
from rove.agent.inbox import Hang, History, Past, Signal
from rove.agent.leader_watch import LeaderWatch
from rove.agent.learning import Learning
from rove.agent.lifecycle import AgentPhase, advance
from rove.agent.replicas import PeerReplicas
from rove.agent.reports import ProgressReports
from rove.agent.resumption import Resumption
from rove.agent.runtime import TaskRestart, WorkerRuntime, WorkersEnded
from rove.agent.runtimes import default_runtime
from rove.agent.status import AgentStatus
from rove.agent.worker_env import member_of, rove_env, worker_envs
from rove.control.bus import records, retry
from rove.control.bus.client import Bus
from rove.control.bus.feed import Feed
from rove.control.bus.options import options_env
from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import RoveError
from rove.control.flags.options import nats_flag
from rove.control.process import aio

log = structlog.get_logger("rove.agent")

EXIT_FINISHED = 0
EXIT_FAILED = 1


class Agent:
    """Runs one node of a job until the job ends, the node is excluded, or a signal."""

    def __init__(
        self,
        bus: Bus,
        cfg: AgentConfig,
        *,
        clock: Callable[[], float] = time.time,
        runtime: Callable[[AgentConfig, str], WorkerRuntime] = default_runtime,
        signals: aio.StopSignals | None = None,
    ):
        self.bus = bus
        self.cfg = cfg
        self.clock = clock
        self.facts = NodeFacts(Outbox(bus), job=cfg.job, node=cfg.node, clock=clock)
        self.incarnation = self.facts.incarnation
        self.workers = runtime(cfg, self.incarnation)
        self.workers.listener = self._task_restarted
        self.faults = FaultPlan(cfg.faults)
        self.checkpoints = CheckpointDuty(
            self.facts,
            cfg.checkpoint_dir,
            keep=cfg.keep_checkpoints,
            persist_every=cfg.persist_every,
            save_at_breakpoint=cfg.save_at_breakpoint,
        )
        # peer replicas of flash checkpoints, sent and held (`rove.agent.replicas`)
        self.replicas = PeerReplicas(
            self.facts, cfg.addr, cfg.replicas, cfg.replica_budget, self.checkpoints.saver.raw
        )
        self.checkpoints.on_in_memory = self.replicas.sender.offer
        self.heartbeat = Heartbeat(
            bus,
            self.facts,
            self.workers,
            cfg.addr,
            self._where,
            interval_s=cfg.heartbeat_s,
            ports=cfg.ports_offered,
            on_stored=self.checkpoints.fence.heard,
        )
        self.reports = ProgressReports(self.facts, self.workers.progress)
        self.endings = Endings(self.facts)
        self.leader_watch = LeaderWatch(bus, cfg.job)
        self.exit_watch = ExitWatch(self.workers, cfg.state_dir / "stacks", cfg.exit_timeout_s)
        #: what this round's workers ended with that the job's end should say
        self._notes: list[str] = []
        self.status = AgentStatus()
        self.log = log.bind(job=cfg.job, node=cfg.node)
        self.learning = Learning(self._warm and cfg.learn_imports, self.log)
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._done: asyncio.Future[int] | None = None
        self._round_event: ev.RoundCompleted | None = None
        self.history = History()  # the decisions recorded before this node joined
        self._ended_earlier: ev.JobPhase | None = None  # how, if it had when this node came
        self._run = 1  # the newest run of the job this agent has heard of
        self.job_run = ""
        self._group_rank: int | None = None
        self._hang_round = -1
        self.resumption = Resumption(lambda text, **kw: self.log.info(text, say=True, **kw), clock)
        status = f"rove status --job {cfg.job}{nats_flag(bus)}"  # (what names its waits)
        self.waiting = round_wait.RoundWait(self.log, cfg.params, status, clock)
        self._checks_run: set[int] = set()
        #: its tasks: none dies silently (one that does ends the node with its traceback)
        self.tasks = aio.Supervisor(
            "the agent", self.log, lambda why: self._finish(EXIT_FAILED, why)
        )
        self._watcher: asyncio.Task[None] | None = None
        #: SIGINT/SIGTERM: the launcher's, for the whole process, or the agent's own
        self.signals = signals or aio.StopSignals()
        self._own_signals = signals is None
        self._interrupted = asyncio.Event()

    @property
    def _warm(self) -> bool:
        """Workers are forked from the warm server (`rove.agent.warm`)."""
        return self.cfg.entrypoint is warm.run_script and self.cfg.start_method == "forkserver"

    # ------------------------------------------------------------------ lifecycle

    def _phase(self, new: AgentPhase) -> None:
        self.status.phase = advance(self.status.phase, new)
        self.status.history.append(new)

    def _where(self) -> tuple[int, int]:
        """(round, first global rank) of this node's workers now."""
        return (self.status.round, self._first_rank())

    def _register(self) -> None:
        self.facts.emit(
            ev.NodeJoined(
                **self.facts.envelope(),
                host=socket.gethostname(),
                pid=os.getpid(),
                nproc_per_node=self.cfg.nproc,
            )
        )
        self._join_next_round()

    def _join_next_round(self) -> None:
        self._phase(AgentPhase.WAITING)
        self.facts.emit(
            ev.RdzvJoined(
                **self.facts.envelope(),
                addr=self.cfg.addr,
                nproc_per_node=self.cfg.nproc,
                ports=ports.free_ports(self.cfg.addr, self.cfg.ports_offered),
                params=self.cfg.params,
                tf_role=self.cfg.tf_role,
                replica_port=self.replicas.port,
                domain=self.cfg.failure_domain,
            )
        )
        self.log.info("waiting for a rendezvous round", nproc=self.cfg.nproc)

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self.facts.outbox.start()
        self.log.info("agent starting", incarnation=self.incarnation, addr=self.cfg.addr)
        loops: list[asyncio.Task[Any]] = []
        feed: Feed | None = None
        try:  # (a signal may cancel it while it starts: `rove run` ends the wait for the bus)
            if self._warm:
                warm.start(self.cfg.preload)  # imports torch while the rendezvous runs
            # before it joins: the round restores the step found
            await self.checkpoints.announce_found(self.bus)
            await self.checkpoints.announce_memory(self.bus)  # (an earlier agent's, killed)
            await self.replicas.start()  # before it joins: its peers send to its port
            decisions = subjects.master(self.cfg.job, ">")
            self.history.mark = await retry.wait_out(
                lambda: self.bus.last_seq(subjects.EVENTS_STREAM, decisions),
                what=f"the decisions of job {self.cfg.job}",
            )
            self._register()
            feed = await retry.wait_out(  # started while JetStream has no quorum: it waits
                lambda: self.bus.subscribe(
                    subjects.EVENTS_STREAM,
                    decisions,
                    self._on_decision,
                    self._on_rejected,
                    last_per_subject=True,
                ),
                what=f"the decisions of job {self.cfg.job}",
            )
            self.signals.ask, self.signals.insist = self.interrupt, self.kill_now
            self.signals.install()
            if self.signals.received:  # before the agent was there to hear it
                self.interrupt(self.signals.received[0])
            loops = [
                asyncio.create_task(self._actor(), name="actor"),
                asyncio.create_task(self._duties(), name="duties"),
                asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
                asyncio.create_task(self.leader_watch.run(), name="leader watch"),
                *self.replicas.tasks(),  # its sender and its server's accept loop
            ]
            for task in [*loops, self.facts.outbox.task]:
                if task is not None:
                    self.tasks.keep(task)
            code = await self._done
        finally:
            if self._own_signals:
                self.signals.remove()
            self.tasks.stop()  # the outbox goes on: it sends the node's last facts
            await aio.cancel_and_wait([*loops, *self.tasks.side])
            await self.replicas.stop()
            await self._stop_workers()
            await asyncio.to_thread(self.workers.close)
            if feed is not None:
                with contextlib.suppress(RoveError, OSError):
                    await feed.stop()
            self.facts.emit(ev.NodeLeft(**self.facts.envelope(), reason=self.status.end_reason))
            if not await self.facts.outbox.flush(10.0):
                self.log.warning(
                    "could not send every fact before exiting", unsent=self.facts.outbox.pending
                )
            await self.facts.outbox.stop()
            if self._warm:
                warm.stop()  # nothing left to fork (a server still importing would linger)
            if self.status.phase is not AgentPhase.STOPPING:
                self._phase(AgentPhase.STOPPING)  # leaving on an error, not a decision
            self._phase(AgentPhase.STOPPED)
        return code

    def interrupt(self, signum: int) -> None:
        """The first stop signal (SIGINT, SIGTERM, SIGHUP, SIGQUIT, or those
        `--signals-to-handle` names, `rove.agent.run_checks.stop_signals`): the workers get it
        too, and the agent leaves (once they ended, or after the stop timeout). Called on
        the event loop."""
        self._interrupted.set()
        self._inbox.put_nowait(Signal(signum))

    def kill_now(self, signum: int) -> None:
        """A second signal: kill the workers, their children and the warm server, and
        end this process at once."""
        name = signal.Signals(signum).name
        self.log.warning(f"received {name} again: killing the workers and leaving at once")
        child.kill_trees(list(self.workers.pids().values()))
        warm.stop()
        self.signals.exit_now(signum)

    def _failed(self, reason: str) -> None:
        self._finish(EXIT_FAILED, reason)

    def _finish(self, code: int, reason: str) -> None:
        self.status.end_reason = reason
        if self.status.phase is not AgentPhase.STOPPING:
            self._phase(AgentPhase.STOPPING)
        if self._done is not None and not self._done.done():
            self._done.set_result(code)

    def _on_decision(self, rec: records.Recorded) -> None:
        self._inbox.put_nowait(self.history.sort(rec))  # (its sequence: for the fence)

    def _on_rejected(self, rej: records.Rejection) -> None:
        self._inbox.put_nowait(rej)  # (logged by the bus; counted in order by the fence)

    # ------------------------------------------------------------------ actor

    async def _actor(self) -> None:
        while True:
            item = await self._inbox.get()
            past = isinstance(item, Past)
            item = item.rec if isinstance(item, Past) else item
            rec = item if isinstance(item, records.Recorded | records.Rejection) else None
            if self.status.phase is not AgentPhase.STOPPING:  # (on its way out: nothing is)
                await self._handle(
                    item.event if isinstance(item, records.Recorded) else item, history=past
                )
            if rec is not None:
                self.checkpoints.fence.handled(rec.seq)

    async def _handle(self, item: Any, *, history: bool = False) -> None:
        """Act on `item`; `history`: a decision recorded before this node joined."""
        match item:
            case Signal(signum=signum):
                name = signal.Signals(signum).name
                self.log.info(
                    f"received {name}; passing it to the workers and leaving the job "
                    f"(again: at once)"
                )
                await self._stop_workers(signal.Signals(signum))
                await self.checkpoints.breakpoint()
                await self.checkpoints.unmark()
                self._finish(128 + signum, f"agent received {name}")
            case WorkersEnded(round=rnd) if (
                rnd == self.status.round and self.status.phase is AgentPhase.RUNNING
            ):
                if item.failure is None and self.checkpoints.behind_fence():
                    # their last step is persisted once the node is back and caught up
                    # (unless what it then acts on moves it on: lost, a new round)
                    self.tasks.spawn(self._requeue(item, self.checkpoints.fence.opened()))
                    return
                if item.failure is not None:
                    await self.checkpoints.breakpoint()
                else:
                    await self.checkpoints.final()  # durable before the node says it is done
                self._workers_ended(item)
            case Hang(round=rnd) if rnd == self.status.round and self.workers.running:
                await self._hung(item)
            case Verdict(round=rnd) if rnd == self.status.round and self.workers.running:
                await self._stuck(item)
            case checkrun.CheckResult():
                checkrun.report(item, self.facts, self.log)
            case ev.MasterElected(epoch=epoch):
                self.status.max_epoch = max(self.status.max_epoch, epoch)
            case ev.JobConfigured(spec=spec):
                # which run of the job this is: names its shared-memory slots
                self.job_run = run_name(item)
                self.checkpoints.fence.set_node_timeout(spec.node_timeout_s)
            case ev.Decision(epoch=epoch) if epoch < self.status.max_epoch:
                self.log.info("ignoring a decision of a deposed master", epoch=epoch)
            case ev.RoundCompleted():
                await self._round(item)
            case ev.NetworkCheckAssigned():
                self._network_check(item)
            case ev.CkptCommitted(step=step, round=rnd):
                await self.checkpoints.commit(step, rnd)
            case ev.NodeLost(node=node, incarnation=inc) if self.facts.is_me(node, inc):
                self.log.warning("the master lost sight of this node; joining again")
                await self._stop_workers()
                self._register()
            case ev.NodeExcluded() | ev.NodeReplaced() if self.facts.is_me(
                item.node, item.incarnation
            ):
                await self._stop_workers()
                self._finish(EXIT_FAILED, item.ending)
            case ev.JobEnded(phase=phase) if history:
                self._ended_earlier = phase  # (said once the next run starts)
            case ev.RunStarted(run=run) if history:  # this node's join is in it, or its end
                self._run, self._ended_earlier = max(self._run, run), None
            case ev.RunStarted(run=run) if self.status.starts == 0 and run > self._run:
                self._run = run
                self.status.round = 0  # the new run's rounds count from 1 again
                ended, self._ended_earlier = self._ended_earlier, None
                self.log.info(
                    f"run {run} of job {self.cfg.job} started; joining it"
                    if ended is None
                    else f"job {self.cfg.job} ended earlier ({ended.value}); its run {run} "
                    "starts now, with this node"
                )
                self.checkpoints.found_again()  # (what it said before: the earlier run's)
                self._register()
            case ev.JobEnded(phase=phase, reason=reason):
                await self._stop_workers()
                await self.checkpoints.unmark()
                code = EXIT_FINISHED if phase is ev.JobPhase.FINISHED else EXIT_FAILED
                if phase is ev.JobPhase.FINISHED:
                    self.checkpoints.job_finished()
                self._finish(code, f"job {self.cfg.job} {phase.value}: {reason}")
            case _:
                pass

    async def _round(self, r: ev.RoundCompleted) -> None:
        if r.round <= self.status.round:
            return
        place = member_of(r, self.cfg.node, self.incarnation)
        self.status.round = r.round
        if place is None:
            if self.workers.running:
                self.log.info("not in the new round; stopping workers", round=r.round)
                await self._stop_workers()
            if self.status.phase is not AgentPhase.WAITING:
                self._join_next_round()
            return
        group_rank, member = place
        if self.workers.running:
            self.resumption.interrupted()  # another node's failure, or a new size
        await self._stop_workers()
        envs = worker_envs(
            r,
            group_rank,
            member,
            job=self.cfg.job,
            max_restarts=self.cfg.max_restarts,
            role=self.cfg.role,
            extra=rove_env(
                r,
                self.cfg,
                self.job_run,
                options_env(self.bus.options, self.bus.url, self.cfg.state_dir / "secrets"),
            ),
        )
        ranks = tuple(range(member.first_rank, member.first_rank + member.nproc))
        await self.checkpoints.new_round(
            r.round, r.restore_step, ranks, r.world_size, group_rank, self.job_run
        )
        self.replicas.new_round(r, self.checkpoints.saver.engines)
        await self.replicas.restore(r, self.checkpoints.saver.engines)
        self._group_rank = group_rank
        if self._warm and not await warm.ready(self._interrupted):
            return  # a signal came first: the actor acts on it next
        pids = self.workers.start(r.round, self.learning.prepare(envs))
        self.learning.started(getattr(self.workers, "progress_files", {}))
        self.reports.start(r.round, restoring=r.restore_step is not None)
        self.exit_watch.new_round(r.round)
        self._notes = []
        # torch's start_processes (workers not forked by rove.agent.procs) installs signal
        # handlers of its own (they raise inside the event loop); take them back.
        self.signals.install()
        self._round_event = r
        self.resumption.round_started(r)
        self._phase(AgentPhase.RUNNING)
        self.status.starts += 1
        self._watcher = asyncio.create_task(self._watch(), name=f"workers-round-{r.round}")
        round_start.announce(self.log, self.facts, r, group_rank, member, pids)

    async def _watch(self) -> None:
        """Wait for this round's workers to end; hand that to the actor."""
        try:
            ended = await self.workers.wait()
        except asyncio.CancelledError:
            raise
        except Exception:
            # The agent must never lose sight of its workers: say so loudly and stop
            # this node (its agent's exit takes the workers down with it).
            self.log.exception("lost track of the workers; leaving the job")
            self._finish(EXIT_FAILED, "the agent lost track of its workers (see the log)")
            return
        self._inbox.put_nowait(ended)

    async def _requeue(self, item: Any, after: Awaitable[None]) -> None:
        """Hand `item` to the actor again once `after` is done."""
        await after
        self._inbox.put_nowait(item)

    def _task_restarted(self, t: TaskRestart) -> None:
        """A task was started again in place (the runtime's own recovery): say so."""
        self.endings.task_restarted(self.status.round, self._first_rank() + t.local_rank, t)

    def _first_rank(self) -> int:
        r = self._round_event
        place = member_of(r, self.cfg.node, self.incarnation) if r else None
        return place[1].first_rank if place else 0

    def _workers_ended(self, ended: WorkersEnded) -> None:
        self._watcher = None
        self.reports.flush()
        root = ended.failure
        if root is None:
            self.log.info("all workers finished", round=ended.round)
            self._phase(AgentPhase.FINISHED)
            self.endings.succeeded(ended.round, self._notes)
            return
        rank = self._first_rank() + root.local_rank
        self.resumption.interrupted()
        self.log.error(
            f"worker rank {rank} failed: {root.diagnosis.said}",
            round=ended.round,
            rank=rank,
            exit_code=root.exit_code,
        )
        self.status.failure = (rank, root)
        port = store_port_taken(self._round_event, rank, root, self.cfg.addr)
        self.endings.failed(ended.round, rank, root, port)

    async def _hung(self, hang: Hang) -> None:
        rank = self._first_rank() + hang.local_rank
        reason = f"no step progress for {hang.silent_s:.0f}s (last step {hang.step})"
        said = f"worker rank {rank} is hung: {reason}"
        await self._hang(hang.round, hang.local_rank, reason, said)

    async def _stuck(self, verdict: Verdict) -> None:
        """A worker that does not end (`ExitWatch`): end it, saying where it was stuck."""
        first = self._first_rank()
        rank = first + verdict.local_rank
        line = verdict.describe(rank, first)
        if not verdict.done:
            said = f"{line} (stacks: {verdict.stacks_path})"
            await self._hang(verdict.round, verdict.local_rank, line, said)
            return
        self.log.warning(
            f"{line}; its work was done: ending it (stacks: {verdict.stacks_path})",
            round=verdict.round,
            rank=rank,
        )
        self._notes.append(f"rank {rank} was ended, stuck {verdict.where or 'on its way out'}")
        await asyncio.to_thread(self.workers.end, verdict.local_rank)

    async def _hang(self, round_: int, local_rank: int, reason: str, said: str) -> None:
        """A hung worker: the node's workers are killed and the hang is the round's failure."""
        self.resumption.interrupted()
        self.reports.flush()
        self.log.error(f"{said}; killing this node's workers", round=round_)
        await self._stop_workers(signal.SIGKILL)
        self.endings.hung(round_, self._first_rank() + local_rank, local_rank, reason)

    async def _stop_workers(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self._watcher is not None:
            await aio.cancel_and_wait([self._watcher])
            self._watcher = None
        self.reports.flush()
        if self.workers.running:
            await asyncio.to_thread(self.workers.stop, sig, self.cfg.stop_timeout_s)

    # ------------------------------------------------------------------ network check

    def _network_check(self, a: ev.NetworkCheckAssigned) -> None:
        if self.status.round > 0 or a.check_round in self._checks_run:
            return  # checks are for a job's first round only; each round runs once
        place = checkrun.my_place(a, self.cfg.node, self.incarnation)
        if place is not None:
            self._checks_run.add(a.check_round)
            self.log.info(f"network check round {a.check_round} with {', '.join(place[0].nodes)}")
            self.tasks.spawn(self._run_check(a, *place))

    async def _run_check(self, a: ev.NetworkCheckAssigned, group: ev.CheckGroup, rank: int) -> None:
        self._inbox.put_nowait(await checkrun.run_check(a, group, rank))

    async def _examine(self, suspect: Any) -> None:
        verdict = await self.exit_watch.examine(suspect)
        if verdict is not None:
            self._inbox.put_nowait(verdict)

    # ------------------------------------------------------------------ duties

    async def _duties(self) -> None:
        """Checkpoints reported and persisted, hangs detected, every `duty_s`."""
        while True:
            await asyncio.sleep(self.cfg.duty_s)
            self.waiting.tick(self.status.phase)  # a wait for a round is said now and then
            self.checkpoints.keep_mark()  # (the location is this job's)
            if self.checkpoints.fence.needs_catch_up:  # (also for workers done behind it)
                self.tasks.spawn(self.checkpoints.fence.probe(self.bus, self.cfg.job))
            if not self.workers.running or self.status.phase is not AgentPhase.RUNNING:
                continue
            self.reports.tick()  # (first: the step restored, before the new checkpoints)
            self.checkpoints.tick()
            self.learning.tick()
            if self.faults.pending:  # --inject-fault
                steps = {lr: p.step for lr, p in self.workers.progress().items()}
                self.faults.fire(self._first_rank(), self.workers.pids(), steps, self.log)
            if self.resumption.waiting:
                self.resumption.progress(self.workers.progress())
            rnd = self.status.round
            suspects, returned = self.exit_watch.tick(self.clock())
            for suspect in suspects:
                self.tasks.spawn(self._examine(suspect))
            # a rank that returned reports no more steps: that is no hang
            if self.cfg.hang_timeout_s > 0 and self._hang_round != rnd and not returned:
                found = progress.silent(
                    self.workers.progress(), self.clock(), self.cfg.hang_timeout_s
                )
                if found is not None:
                    # Once per round: the other ranks stall too, waiting on this one.
                    local_rank, p, silent_s = found
                    self._hang_round = rnd
                    self._inbox.put_nowait(Hang(rnd, local_rank, p.step, silent_s))
