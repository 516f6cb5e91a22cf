"""The torch worker runtime: a node's workers, started as torchrun starts them.

Warm workers with rove's logs (the default) are forked from the warm server by
`rove.agent.procs.Forked`, which does what torch's function-entrypoint context does
without importing torch in the agent; any other worker (`--no-warm-start`, torch's
`--redirects`, `--tee`, `--logs-specs`) goes through torch's own `start_processes`
(`rove.agent.torch_procs`). Either way the same process handling as torchrun: log
redirection and tee, the `TORCHELASTIC_ERROR_FILE` that `@record` writes, and
teardown of the other local workers when one fails. The agent waits on the
processes themselves (a pidfd per worker, readable when it exits) instead of
polling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import psutil
import structlog

from rove.agent import progress
from rove.agent.descendants import Descendants
from rove.agent.diagnosis import Diagnosis, classify, read_tail, where
from rove.agent.echo import Echo, EchoedLogs
from rove.agent.procs import NO_ERROR_FILE, Failure, Forked, Result, substitute
from rove.agent.runtime import RootFailure, WorkerRuntime, WorkersEnded
from rove.agent.sentinels import Sentinels
from rove.agent.stuck import Activity
from rove.control.catalogue.events import FailureKind

log = structlog.get_logger("rove.agent")


class Started(Protocol):
    """A round's running workers (`rove.agent.procs.Forked`, or torch's context in
    `rove.agent.torch_procs.TorchStarted`)."""

    error_files: dict[int, str]
    #: set once every function worker's return value was read (None: not a function's)
    all_read: Any

    def pids(self) -> dict[int, int]: ...
    def return_fds(self) -> list[int]: ...
    def poll(self) -> Result | None: ...
    def close(self, death_sig: signal.Signals = ..., timeout: float = ...) -> None: ...


class TorchRuntime(WorkerRuntime):
    """One round's torch worker processes on this node (see `WorkerRuntime`)."""

    def __init__(
        self,
        entrypoint: str | Callable[..., None],
        args: list[str],
        logs_specs: Any,
        progress_dir: Path,
        *,
        start_method: str = "spawn",
        name: str = "default",
        exit_grace_s: float = 10.0,
    ) -> None:
        self.name = name
        self.exit_grace_s = exit_grace_s
        self.entrypoint = entrypoint
        self.args = list(args)
        if logs_specs is None:
            from rove.agent.torch_procs import default_logs

            logs_specs = default_logs()
        self.logs_specs = logs_specs
        if isinstance(self.logs_specs, EchoedLogs):
            # a function's workers open their pipes themselves (torch would open them
            # as seekable files): rove.agent.warm.run_script
            self.logs_specs.by_worker = callable(entrypoint)
        if not self._forked:
            # torch's start_processes will start these workers: import it now, as the
            # agent is built, not at its first round, where importing torch (1.4 s here,
            # seconds on busy cores, much of it holding the GIL) would hold the agent's
            # event loop and its heartbeats
            import rove.agent.torch_procs  # noqa: F401
        self.progress_dir = progress_dir
        self.start_method = start_method
        self.pcontext: Started | None = None
        self._echoes: list[Echo] = []
        self._round = 0
        self.progress_files: dict[int, Path] = {}
        #: pids killed after their work was done (lingering, or stuck on their way out)
        self._reaped: set[int] = set()
        self._lock = threading.Lock()  # start, poll and stop run in different threads
        self._descendants = Descendants(time.monotonic)

    @property
    def running(self) -> bool:
        return self.pcontext is not None

    @property
    def round(self) -> int:
        return self._round

    def start(self, round_: int, envs: dict[int, dict[str, str]]) -> dict[int, int]:
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        files = {}
        full_envs = {}
        for local_rank, env in envs.items():
            path = self.progress_dir / f"round{round_}-local{local_rank}"
            progress.create(path)
            files[local_rank] = path
            full_envs[local_rank] = {**env, progress.ENV: str(path)}
        args = {lr: substitute(self.args, lr) for lr in envs}
        with self._lock:
            assert self.pcontext is None, "the previous round's workers still run"
            self.progress_files = files
            self._reaped = set()
            self.pcontext = self._start(args, full_envs)
            self._round = round_
            if isinstance(self.logs_specs, EchoedLogs):
                self._echoes = [Echo(self.logs_specs.take()).start()]
            return dict(self.pcontext.pids())

    @property
    def _forked(self) -> bool:
        """Whether rove forks the workers itself (`rove.agent.procs`, no torch in the
        agent): warm workers with rove's logs; any other through torch's."""
        return callable(self.entrypoint) and isinstance(self.logs_specs, EchoedLogs)

    def _start(self, args: dict[int, tuple[Any, ...]], envs: dict[int, dict[str, str]]) -> Started:
        if self._forked and callable(self.entrypoint):  # (the second for mypy)
            # warm workers with rove's logs: no torch in the agent (rove.agent.procs)
            dest = self.logs_specs.reify(envs)
            return Forked(self.entrypoint, args, envs, dest.error_files, self.start_method)
        from rove.agent.torch_procs import TorchStarted

        return TorchStarted(
            self.name, self.entrypoint, args, envs, self.logs_specs, self.start_method
        )

    def pids(self) -> dict[int, int]:
        pcontext = self.pcontext
        return dict(pcontext.pids()) if pcontext else {}

    async def wait(self) -> WorkersEnded:
        rnd = self._round
        pids = self.pids()
        watched = Sentinels(pids, self.pcontext.return_fds() if self.pcontext else [])
        reaper = asyncio.create_task(self._reap_lingering(pids, self._reaped))
        try:
            while True:
                result = await asyncio.to_thread(self._poll)
                if result is not None:
                    failed = result.is_failed() and not all(
                        self._was_done(f) for f in result.failures.values()
                    )
                    return WorkersEnded(rnd, root_failure(result, self._kept) if failed else None)
                if not await watched.next_exit():
                    # every process we watch has exited, yet torch reports the group as
                    # running: look again (torch reaps them on its own schedule)
                    await asyncio.sleep(0.05)
        finally:
            reaper.cancel()
            watched.close()

    def _kept(self, result: Result, local_rank: int, stream: str) -> str | None:
        """Where a worker's stdout or stderr is kept (torch knows at most the pipe)."""
        if isinstance(self.logs_specs, EchoedLogs):
            return self.logs_specs.kept.get((local_rank, stream))
        paths = result.stdouts if stream == "stdout" else result.stderrs
        return paths.get(local_rank) or None

    def _was_done(self, failure: Failure) -> bool:
        """A worker that ended badly after its work was done: killed by the agent once
        done (`_reaped`), or torn down by torch after its script had returned (when a
        peer that never returned was ended)."""
        path = self.progress_files.get(failure.local_rank)
        return failure.pid in self._reaped or (
            path is not None and progress.ending(path)[0] > 0 and bool(self._reaped)
        )

    async def _reap_lingering(self, pids: dict[int, int], reaped: set[int]) -> None:
        """Kill a worker that returned from its function but does not exit.

        Once every worker of a function entrypoint has returned, torch tells them to
        exit and waits for each, without a timeout, holding the agent's poll. A worker
        returns from `rove.agent.script.run` only after its ending (threads joined,
        atexit handlers run: one stuck there is the exit watch's), so little is left
        that could hold it; this is the backstop: after `exit_grace_s` such a process
        is killed (`reaped`); its work was done, so the round still counts as succeeded.
        """
        finished = self.pcontext.all_read if self.pcontext is not None else None
        if finished is None:
            return  # a subprocess context: torch waits with a timeout there
        while not finished.is_set():  # noqa: ASYNC110 - a multiprocessing Event, not asyncio's
            await asyncio.sleep(0.5)
        await asyncio.sleep(self.exit_grace_s)
        for local_rank, pid in sorted(pids.items()):
            if _alive(pid):
                log.warning(
                    f"worker {local_rank} returned but has not exited after "
                    f"{self.exit_grace_s:g}s: killing it",
                    pid=pid,
                )
                reaped.add(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def _poll(self) -> Result | None:
        """None while all run; else the result (the others are torn down first). Blocking."""
        with self._lock:
            pcontext = self.pcontext
            if pcontext is None:
                return None
            result = pcontext.poll()
            if result is not None:
                self.pcontext = None
                self._stop_echo()
            return result

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        with self._lock:
            if self.pcontext is not None:
                self.pcontext.close(sig, max(1.0, timeout_s))
                self.pcontext = None
            self._stop_echo()

    def _stop_echo(self) -> None:
        """Copy the ended workers' last output to the console, then stop copying."""
        for echo in self._echoes:
            echo.stop()
        self._echoes = []

    def progress(self) -> dict[int, progress.Progress]:
        return progress.read_all(self.progress_files)

    def activity(self) -> dict[int, Activity]:
        """What each worker has done so far: its CPU and I/O with its descendants'
        (`rove.agent.descendants`), its step, whether its script returned."""
        out = {}
        files = self.progress_files
        pids = self.pids()
        below = self._descendants.totals(pids)
        for local_rank, pid in pids.items():
            path = files.get(local_rank)
            reported = progress.read(path) if path is not None else None
            returned_at, ended_at = progress.ending(path) if path is not None else (0.0, 0.0)
            cpu_s, io, alive = 0.0, 0, True
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    alive = proc.status() != psutil.STATUS_ZOMBIE
                    cpu = proc.cpu_times()
                    counters = proc.io_counters()
                cpu_s = cpu.user + cpu.system + cpu.children_user + cpu.children_system
                io = counters.read_chars + counters.write_chars
                below_cpu_s, below_io = below.get(local_rank, (0.0, 0))
                cpu_s, io = cpu_s + below_cpu_s, io + below_io
            except psutil.NoSuchProcess:
                alive = False
            except (psutil.Error, OSError):
                continue  # its I/O cannot be read: not watched
            out[local_rank] = Activity(
                cpu_s=cpu_s,
                io=io,
                step=reported.step if reported is not None else -1,
                returned_at=returned_at,
                ended_at=ended_at,
                alive=alive,
            )
        return out

    def end(self, local_rank: int) -> None:
        pid = self.pids().get(local_rank)
        if pid is None:
            return
        self._reaped.add(pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _stamped(failure: Failure) -> bool:
    """Whether the failure's timestamp is its error file's (else: when it was seen)."""
    return failure.error_file != NO_ERROR_FILE


def _symptom_rank(failure: Failure, diagnosis: Diagnosis) -> int:
    """0 for a likely cause, 1 for a likely symptom of another worker's death."""
    if diagnosis.kind is FailureKind.COMMUNICATION:
        return 1  # a broken connection: usually a peer that died
    if failure.exitcode == -signal.SIGTERM and not _stamped(failure):
        return 2  # usually torch's own teardown of the survivors (one that raised is a cause)
    return 0


def _torchs(result: Result, local_rank: int, stream: str) -> str | None:
    paths = result.stdouts if stream == "stdout" else result.stderrs
    return paths.get(local_rank) or None


def root_failure(
    result: Result,
    kept: Callable[[Result, int, str], str | None] = _torchs,
) -> RootFailure | None:
    """The failure that started the teardown (`kept`: where a worker's "stdout" or
    "stderr" is kept: by default the file torch redirected it to).

    torch records failures with one-second timestamps, the real one before the
    SIGTERMs of its own teardown. Among the earliest, a cause wins over a
    symptom: a worker killed by a signal beats the peer whose collective then
    broke, which may have been seen first. Only an error file's timestamp says
    when a worker failed; one without (killed by a signal, or no `@record`) is
    stamped when torch noticed it, which can be the second after its peer wrote
    the error file of the broken collective: such a failure is always a
    candidate, and on a tie a stamped one wins.
    """
    failures: list[Failure] = list(result.failures.values())
    if not failures:
        return None
    earliest = min(f.timestamp for f in failures)
    candidates = []
    for f in failures:
        if f.timestamp > earliest and _stamped(f):
            continue
        tail = read_tail(kept(result, f.local_rank, "stderr")) or read_tail(
            kept(result, f.local_rank, "stdout")
        )
        data = f.error_file_data if f.error_file_data else None
        diagnosis = classify(f.exitcode, data, tail)
        order = (_symptom_rank(f, diagnosis), f.timestamp > earliest)
        candidates.append((order, f, diagnosis, tail, data))
    _, first, diagnosis, tail, data = min(candidates, key=lambda c: c[0])
    path = kept(result, first.local_rank, "stderr") or kept(result, first.local_rank, "stdout")
    return RootFailure(
        local_rank=first.local_rank,
        pid=first.pid,
        exit_code=first.exitcode,
        diagnosis=diagnosis,
        log_tail=tail,
        log_path=str(path or ""),
        where=where(data, tail) or "",
    )
