"""The node agent: joins rounds, runs this node's workers, reports what happens.

Three loops share one bus connection:

* the **actor** handles, one at a time, the master's decisions (`round_completed`,
  `node_lost`, `node_excluded`, `job_ended`), finished or failed workers, hangs and
  signals; only it starts and stops workers, so they never race;
* the **monitor** polls the worker processes (off the event loop: torch's teardown
  can block) and reads their step progress for hang detection;
* the **heartbeat** publishes the node's and its ranks' step, throughput and
  resource use every interval, with fresh free ports for the next round's store.

Facts go through an `Outbox`, so they are kept and sent later while the bus is
unreachable; workers keep training meanwhile. Decisions from a master epoch
older than the newest seen are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from torch.distributed.elastic.multiprocessing import LogsSpecs, RunProcsResult

from rove.agent import warm
from rove.agent.diagnosis import signal_name
from rove.agent.metrics import Sampler
from rove.agent.saver import Saver
from rove.agent.worker_env import member_of, worker_envs
from rove.agent.workers import WorkerGroup, root_failure
from rove.checkpoint.engine import CheckpointError
from rove.control import aio, records, subjects
from rove.control import events as ev
from rove.control.bus import Bus, Feed, options_env
from rove.control.errors import PublishDeadlineError, RoveError
from rove.control.master import netcheck as netcheck_policy
from rove.control.outbox import Outbox

log = structlog.get_logger("rove.agent")

EXIT_FINISHED = 0
EXIT_FAILED = 1


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    job: str
    node: str
    addr: str
    nproc: int
    params: ev.RdzvParams
    #: A command, or a function (warm start: forked from the warm server).
    entrypoint: str | Callable[..., None]
    args: list[str]
    logs_specs: LogsSpecs | None
    state_dir: Path
    max_restarts: int
    role: str = "default"
    heartbeat_s: float = 1.0
    monitor_s: float = 0.1
    hang_timeout_s: float = 0.0
    stop_timeout_s: float = 10.0
    start_method: str = "spawn"
    #: Extra modules the warm server imports (warm start only).
    preload: tuple[str, ...] = ()
    checkpoint_dir: Path | None = None
    save_at_breakpoint: bool = False
    keep_checkpoints: int = 3
    persist_every: int = 1


@dataclass(frozen=True)
class _WorkersDone:
    round: int
    result: RunProcsResult


@dataclass(frozen=True)
class _Hang:
    round: int
    local_rank: int
    step: int
    silent_s: float


@dataclass(frozen=True)
class _CheckDone:
    check_round: int
    ok: bool
    elapsed_s: float
    matmul_s: float
    allreduce_s: float
    error: str


@dataclass(frozen=True)
class _Signal:
    signum: int


@dataclass
class _RankRate:
    samples: float = 0.0
    at: float = 0.0
    rate: float = 0.0


@dataclass
class AgentStatus:
    """What the agent knows, for logs and tests."""

    round: int = 0
    waiting: bool = True
    max_epoch: int = 0
    starts: int = 0
    end_reason: str = ""
    rates: dict[int, _RankRate] = field(default_factory=dict)


def free_ports(addr: str, n: int = 2) -> tuple[int, ...]:
    """`n` ports free on `addr` right now (for the next round's rendezvous store)."""
    ports = []
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((addr if addr not in ("localhost",) else "127.0.0.1", 0))
            socks.append(s)
            ports.append(int(s.getsockname()[1]))
    except OSError:
        pass
    finally:
        for s in socks:
            s.close()
    return tuple(ports)


class Agent:
    """Runs one node of a job until the job ends, the node is excluded, or a signal."""

    def __init__(self, bus: Bus, cfg: AgentConfig, *, clock: Callable[[], float] = time.time):
        self.bus = bus
        self.cfg = cfg
        self.clock = clock
        self.incarnation = uuid.uuid4().hex[:10]
        self.outbox = Outbox(bus)
        self.workers = WorkerGroup(
            cfg.entrypoint,
            cfg.args,
            cfg.logs_specs,
            cfg.state_dir / "progress" / self.incarnation,
            start_method=cfg.start_method,
            name=cfg.role,
        )
        self.status = AgentStatus()
        self.sampler = Sampler()
        self.log = log.bind(job=cfg.job, node=cfg.node)
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()
        self._done: asyncio.Future[int] | None = None
        self._counter = 0
        self._hb_seq = 0
        self._workers_lock = asyncio.Lock()
        self._round_event: ev.RoundCompleted | None = None
        self._started_at = clock()
        self.saver = Saver(cfg.job, cfg.checkpoint_dir, keep=cfg.keep_checkpoints)
        self.job_run = ""
        self._persisting: asyncio.Task[None] | None = None
        self._group_rank: int | None = None
        self._hang_round = -1
        self._checks_run: set[int] = set()
        self._check_tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ facts

    def _envelope(self) -> dict[str, Any]:
        self._counter += 1
        return {
            "job": self.cfg.job,
            "id": ev.make_id(self.cfg.node, self.incarnation, self._counter),
            "producer": f"agent:{self.cfg.node}",
            "ts": self.clock(),
        }

    def _emit(self, event: ev.Event) -> None:
        self.outbox.put(event)

    def _register(self) -> None:
        self._emit(
            ev.NodeJoined(
                **self._envelope(),
                node=self.cfg.node,
                host=socket.gethostname(),
                pid=os.getpid(),
                incarnation=self.incarnation,
                nproc_per_node=self.cfg.nproc,
            )
        )
        self._join_next_round()

    def _join_next_round(self) -> None:
        self.status.waiting = True
        self._emit(
            ev.RdzvJoined(
                **self._envelope(),
                node=self.cfg.node,
                incarnation=self.incarnation,
                addr=self.cfg.addr,
                nproc_per_node=self.cfg.nproc,
                ports=free_ports(self.cfg.addr),
                params=self.cfg.params,
            )
        )
        self.log.info("waiting for a rendezvous round", nproc=self.cfg.nproc)

    # ------------------------------------------------------------------ main

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        self.outbox.start()
        self.log.info("agent starting", incarnation=self.incarnation, addr=self.cfg.addr)
        if self.cfg.entrypoint is warm.run_script:
            warm.start(self.cfg.preload)  # imports torch while the rendezvous runs
        self._register()
        feed = await self.bus.subscribe(
            subjects.EVENTS_STREAM,
            subjects.master(self.cfg.job, ">"),
            self._on_decision,
            self._on_rejected,
            last_per_subject=True,
        )
        self._install_signal_handlers()
        tasks = [
            asyncio.create_task(self._actor(), name="actor"),
            asyncio.create_task(self._monitor(), name="monitor"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        try:
            code = await self._done
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await aio.cancel_and_wait([*tasks, *self._check_tasks])
            await self._stop_workers()
            await _stop_feed(feed)
            self._emit(
                ev.NodeLeft(
                    **self._envelope(),
                    node=self.cfg.node,
                    incarnation=self.incarnation,
                    reason=self.status.end_reason,
                )
            )
            if not await self.outbox.flush(10.0):
                self.log.warning(
                    "could not send every fact before exiting", unsent=self.outbox.pending
                )
            await self.outbox.stop()
        return code

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._inbox.put_nowait, _Signal(sig))

    def _finish(self, code: int, reason: str) -> None:
        self.status.end_reason = reason
        if self._done is not None and not self._done.done():
            self._done.set_result(code)

    def _on_decision(self, rec: records.Recorded) -> None:
        self._inbox.put_nowait(rec.event)

    def _on_rejected(self, rej: records.Rejection) -> None:
        pass  # logged by the bus; the leading master records it

    # ------------------------------------------------------------------ actor

    async def _actor(self) -> None:
        while True:
            item = await self._inbox.get()
            await self._handle(item)

    async def _handle(self, item: Any) -> None:
        me = (self.cfg.node, self.incarnation)
        match item:
            case _Signal(signum=signum):
                name = signal.Signals(signum).name
                self.log.info(f"received {name}; stopping workers and leaving the job")
                await self._stop_workers()
                await self._breakpoint()
                self._finish(128 + signum, f"agent received {name}")
            case _WorkersDone(round=rnd, result=result) if rnd == self.status.round:
                if result.is_failed():
                    await self._breakpoint()
                self._workers_done(rnd, result)
            case _Hang(round=rnd) if rnd == self.status.round and self.workers.running:
                await self._hung(item)
            case ev.MasterElected(epoch=epoch):
                self.status.max_epoch = max(self.status.max_epoch, epoch)
            case ev.JobConfigured(ts=ts):
                # which run of the job this is: names its shared-memory slots
                self.job_run = hashlib.blake2b(
                    f"{item.id}:{ts}".encode(), digest_size=4
                ).hexdigest()
            case ev.Decision(epoch=epoch) if epoch < self.status.max_epoch:
                self.log.info("ignoring a decision of a deposed master", epoch=epoch)
            case ev.RoundCompleted():
                await self._round(item)
            case ev.NetworkCheckAssigned():
                self._network_check(item)
            case ev.CkptCommitted(step=step):
                await self._commit(step)
            case _CheckDone():
                self._emit(
                    ev.NetworkCheckReported(
                        **self._envelope(),
                        node=self.cfg.node,
                        incarnation=self.incarnation,
                        check_round=item.check_round,
                        ok=item.ok,
                        elapsed_s=item.elapsed_s,
                        matmul_s=item.matmul_s,
                        allreduce_s=item.allreduce_s,
                        error=item.error,
                    )
                )
            case ev.NodeLost(node=node, incarnation=inc) if (node, inc) == me:
                self.log.warning("the master lost sight of this node; joining again")
                await self._stop_workers()
                self._register()
            case ev.NodeExcluded(node=node, incarnation=inc) if (node, inc) == me:
                await self._stop_workers()
                self._finish(EXIT_FAILED, f"node {node} was excluded: {item.reason}")
            case ev.JobEnded(phase=phase, reason=reason):
                await self._stop_workers()
                if self.status.starts == 0 and item.ts < self._started_at:
                    self._finish(
                        EXIT_FAILED,
                        f"job {self.cfg.job} already ended earlier "
                        f"({phase.value}: {reason}); start a new job with another --job",
                    )
                    return
                code = EXIT_FINISHED if phase is ev.JobPhase.FINISHED else EXIT_FAILED
                if phase is ev.JobPhase.FINISHED:
                    self.saver.unlink()  # the job is done: free its shared memory
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
            if not self.status.waiting:
                self._join_next_round()
            return
        group_rank, member = place
        await self._stop_workers()
        envs = worker_envs(
            r,
            group_rank,
            member,
            job=self.cfg.job,
            max_restarts=self.cfg.max_restarts,
            role=self.cfg.role,
            extra=self._restore_env(r),
        )
        ranks = tuple(range(member.first_rank, member.first_rank + member.nproc))
        self.saver.ranks(ranks, self.job_run)
        self._group_rank = group_rank
        async with self._workers_lock:
            pids = self.workers.start(r.round, envs)
        # torch's start_processes installs signal handlers of its own (they raise
        # inside the event loop); the agent stops workers itself, so take them back.
        self._install_signal_handlers()
        self.status.waiting = False
        self.status.starts += 1
        self.status.rates = {}
        self._round_event = r
        ranks = tuple(member.first_rank + lr for lr in sorted(pids))
        self.log.info(
            f"round {r.round}: started {len(pids)} workers as ranks "
            f"{ranks[0]}-{ranks[-1]} of {r.world_size}",
            round=r.round,
            group_rank=group_rank,
            restart_count=r.restart_count,
            master=f"{r.master_addr}:{r.master_port}",
            reason=r.reason,
        )
        self._emit(
            ev.WorkersStarted(
                **self._envelope(),
                node=self.cfg.node,
                incarnation=self.incarnation,
                round=r.round,
                ranks=ranks,
                pids=tuple(pids[lr] for lr in sorted(pids)),
            )
        )

    def _network_check(self, a: ev.NetworkCheckAssigned) -> None:
        if self.status.round > 0 or a.check_round in self._checks_run:
            return  # checks are for a job's first round only; each round runs once
        for group in a.groups:
            pairs = list(zip(group.nodes, group.incarnations, strict=True))
            if (self.cfg.node, self.incarnation) in pairs:
                self._checks_run.add(a.check_round)
                rank = pairs.index((self.cfg.node, self.incarnation))
                task = asyncio.create_task(self._run_check(a, group, rank))
                self._check_tasks.add(task)
                task.add_done_callback(self._check_tasks.discard)
                return

    async def _run_check(self, a: ev.NetworkCheckAssigned, group: ev.CheckGroup, rank: int) -> None:
        startup = netcheck_policy.startup_s(a.timeout_s)
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(len(group.nodes)),
            "MASTER_ADDR": group.master_addr,
            "MASTER_PORT": str(group.master_port),
            "ROVE_NETCHECK_TIMEOUT": str(a.timeout_s),
            "ROVE_NETCHECK_STARTUP_TIMEOUT": str(startup),
        }
        self.log.info(f"network check round {a.check_round} with {', '.join(group.nodes)}")
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "rove.agent.child",
            sys.executable,
            "-m",
            "rove.agent.netcheck",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        limit = startup + a.timeout_s + 10.0  # the process bounds itself; this is a backstop
        try:
            out, err = await asyncio.wait_for(proc.communicate(), limit)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            out, err = b"", f"timed out after {limit:g}s".encode()
        result: dict[str, Any] = {}
        with contextlib.suppress(ValueError):
            result = json.loads(out.decode().strip().splitlines()[-1]) if out.strip() else {}
        ok = proc.returncode == 0 and bool(result.get("ok"))
        error = ""
        if not ok:
            stderr = err.decode(errors="replace").strip().splitlines()
            error = str(result.get("error") or (stderr[-1] if stderr else "failed"))
        # the check's own time (start-up excluded), or the wall time of a failed one
        elapsed = float(result["elapsed_s"]) if ok else time.monotonic() - started
        self.log.info(
            f"network check round {a.check_round}: " + ("ok" if ok else f"failed: {error}"),
            elapsed_s=round(elapsed, 3),
        )
        self._inbox.put_nowait(
            _CheckDone(
                a.check_round,
                ok,
                round(elapsed, 4),
                float(result.get("matmul_s", 0.0)),
                float(result.get("allreduce_s", 0.0)),
                error[: ev.REASON_CHARS],
            )
        )

    def _restore_env(self, r: ev.RoundCompleted) -> dict[str, str]:
        env = {
            "ROVE_RESTORE_STEP": "" if r.restore_step is None else str(r.restore_step),
            "ROVE_RESTORE_SOURCE": r.restore_source,
            # for the data clients in the workers (rove.shard_service): URL and credentials
            **options_env(self.bus.options, self.bus.url),
            "ROVE_NODE": self.cfg.node,
            "ROVE_JOB_RUN": self.job_run,
        }
        if self.cfg.checkpoint_dir is not None:
            env["ROVE_CKPT_DIR"] = str(self.cfg.checkpoint_dir)
        return env

    # ------------------------------------------------------------------ checkpoints

    def _report_in_memory(self) -> int | None:
        step = self.saver.new_in_memory()
        if step is not None:
            self._emit(
                ev.CkptInMemory(
                    **self._envelope(),
                    node=self.cfg.node,
                    incarnation=self.incarnation,
                    step=step,
                    ranks=tuple(sorted(self.saver.engines)),
                )
            )
        return step

    async def _persist(self, step: int) -> None:
        try:
            done = await asyncio.to_thread(self.saver.persist, step)
        except CheckpointError as exc:
            self.log.warning(f"could not persist checkpoint step {step}: {exc}")
            self._emit(
                ev.CkptFailed(
                    **self._envelope(),
                    node=self.cfg.node,
                    incarnation=self.incarnation,
                    step=step,
                    error=str(exc)[: ev.REASON_CHARS],
                )
            )
            return
        world = self._round_event.world_size if self._round_event else len(done.ranks)
        self._emit(
            ev.CkptPersisted(
                **self._envelope(),
                node=self.cfg.node,
                incarnation=self.incarnation,
                step=step,
                ranks=done.ranks,
                world_size=world,
                location=done.location,
            )
        )

    def _saver_tick(self) -> None:
        step = self._report_in_memory()
        busy = self._persisting is not None and not self._persisting.done()
        due = (
            step is not None and step - max(0, self.saver.persisted_step) >= self.cfg.persist_every
        )
        if due and step is not None and self.saver.storage is not None and not busy:
            self._persisting = asyncio.create_task(self._persist(step))

    async def _breakpoint(self) -> None:
        """Before a failure or a signal is acted on: report, and persist if asked."""
        self._report_in_memory()
        if self._persisting is not None:
            await asyncio.gather(self._persisting, return_exceptions=True)
        step = self.saver.common_step()
        if (
            self.cfg.save_at_breakpoint
            and self.saver.storage is not None
            and step is not None
            and step > self.saver.persisted_step
        ):
            self.log.info(f"saving at breakpoint: persisting step {step} from memory")
            await self._persist(step)

    async def _commit(self, step: int) -> None:
        if self._group_rank != 0 or self.saver.storage is None:
            return
        try:
            await asyncio.to_thread(self.saver.commit, step)
            self.log.debug(f"checkpoint step {step} committed")
        except CheckpointError as exc:
            self.log.warning(f"could not record the commit of step {step}: {exc}")

    def _first_rank(self) -> int:
        r = self._round_event
        place = member_of(r, self.cfg.node, self.incarnation) if r else None
        return place[1].first_rank if place else 0

    def _workers_done(self, rnd: int, result: RunProcsResult) -> None:
        if not result.is_failed():
            self.log.info("all workers finished", round=rnd)
            self._emit(
                ev.WorkersSucceeded(
                    **self._envelope(), node=self.cfg.node, incarnation=self.incarnation, round=rnd
                )
            )
            return
        root = root_failure(result)
        assert root is not None
        rank = self._first_rank() + root.local_rank
        self.log.error(
            f"worker rank {rank} failed: {root.diagnosis.kind.value}: {root.diagnosis.reason}",
            round=rnd,
            rank=rank,
            exit_code=root.exit_code,
        )
        self._emit(
            ev.WorkerExited(
                **self._envelope(),
                node=self.cfg.node,
                incarnation=self.incarnation,
                round=rnd,
                rank=rank,
                local_rank=root.local_rank,
                kind=root.diagnosis.kind,
                reason=root.diagnosis.reason,
                exit_code=root.exit_code,
                signal=signal_name(root.exit_code),
                log_tail=root.log_tail[-ev.LOG_TAIL_BYTES :],
            )
        )

    async def _hung(self, hang: _Hang) -> None:
        rank = self._first_rank() + hang.local_rank
        reason = f"no step progress for {hang.silent_s:.0f}s (last step {hang.step})"
        self.log.error(f"worker rank {rank} is hung: {reason}; killing this node's workers")
        await self._stop_workers(signal.SIGKILL)
        self._emit(
            ev.WorkerExited(
                **self._envelope(),
                node=self.cfg.node,
                incarnation=self.incarnation,
                round=hang.round,
                rank=rank,
                local_rank=hang.local_rank,
                kind=ev.FailureKind.HANG,
                reason=reason,
            )
        )

    async def _stop_workers(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if not self.workers.running:
            return
        async with self._workers_lock:
            await asyncio.to_thread(self.workers.stop, sig, self.cfg.stop_timeout_s)

    # ------------------------------------------------------------------ monitor

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.monitor_s)
            if not self.workers.running:
                continue
            async with self._workers_lock:
                rnd = self.workers.round
                result = await asyncio.to_thread(self.workers.poll)
            if result is not None:
                self._inbox.put_nowait(_WorkersDone(rnd, result))
                continue
            self._saver_tick()
            if self.cfg.hang_timeout_s > 0 and self._hang_round != rnd:
                now = self.clock()
                for local_rank, p in self.workers.progress().items():
                    silent = now - p.at
                    if silent > self.cfg.hang_timeout_s:
                        # Once per round: the other ranks stall too, waiting on this one.
                        self._hang_round = rnd
                        self._inbox.put_nowait(_Hang(rnd, local_rank, p.step, silent))
                        break

    # ------------------------------------------------------------------ heartbeat

    async def _heartbeat(self) -> None:
        while True:
            try:
                await self.bus.publish(self._heartbeat_event(), deadline_s=2.0)
            except PublishDeadlineError:
                self.log.debug("heartbeat not sent: bus unavailable")
            await asyncio.sleep(self.cfg.heartbeat_s)

    def _heartbeat_event(self) -> ev.Heartbeat:
        self._hb_seq += 1
        cpu, used, total = self.sampler.node()
        pids = self.workers.pids() if self.workers.running else {}
        progress = self.workers.progress() if pids else {}
        first = self._first_rank()
        ranks = []
        for local_rank, pid in sorted(pids.items()):
            pcpu, rss = self.sampler.process(pid)
            p = progress.get(local_rank)
            rate = self.status.rates.setdefault(local_rank, _RankRate())
            if p is not None and rate.at and p.at > rate.at:
                rate.rate = (p.samples - rate.samples) / (p.at - rate.at)
            if p is not None:
                rate.samples, rate.at = p.samples, p.at
            gpu_mem, gpu_util = self.sampler.gpu(local_rank)
            ranks.append(
                ev.RankStat(
                    rank=first + local_rank,
                    local_rank=local_rank,
                    pid=pid,
                    step=p.step if p else 0,
                    samples_per_s=round(rate.rate, 2),
                    cpu_percent=pcpu,
                    rss_bytes=rss,
                    gpu_mem_bytes=gpu_mem,
                    gpu_util_percent=gpu_util,
                )
            )
        self.sampler.forget(set(pids.values()))
        return ev.Heartbeat(
            job=self.cfg.job,
            id=ev.make_id(self.cfg.node, self.incarnation, "hb", self._hb_seq),
            producer=f"agent:{self.cfg.node}",
            ts=self.clock(),
            node=self.cfg.node,
            incarnation=self.incarnation,
            seq=self._hb_seq,
            cpu_percent=cpu,
            mem_used_bytes=used,
            mem_total_bytes=total,
            ranks=tuple(ranks),
            round=self.status.round,
            ports=free_ports(self.cfg.addr),
        )


async def _stop_feed(feed: Feed) -> None:
    with contextlib.suppress(RoveError, OSError):
        await feed.stop()
