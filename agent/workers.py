"""The torch worker runtime: a node's workers started with torch's own machinery.

`torch.distributed.elastic.multiprocessing.start_processes` gives rove the
same process handling as torchrun: log redirection and tee (`--redirects`,
`--tee`, `--log-dir`), the `TORCHELASTIC_ERROR_FILE` that `@record` writes,
and teardown of the other local workers when one fails. The agent waits on
the processes themselves (a pidfd per worker, readable when it exits) instead
of polling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import psutil
import structlog
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    LogsSpecs,
    PContext,
    RunProcsResult,
    start_processes,
)
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.utils.api import macros

from rove.agent import progress
from rove.agent.diagnosis import Diagnosis, classify, read_tail, where
from rove.agent.echo import Echo, EchoedLogs
from rove.agent.runtime import RootFailure, WorkerRuntime, WorkersEnded
from rove.agent.sentinels import Sentinels
from rove.agent.stuck import Activity
from rove.control.catalogue.events import FailureKind

log = structlog.get_logger("rove.agent")


class TorchRuntime(WorkerRuntime):
    """One round's torch worker processes on this node (see `WorkerRuntime`)."""

    def __init__(
        self,
        entrypoint: str | Callable[..., None],
        args: list[str],
        logs_specs: LogsSpecs | None,
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
        self.logs_specs = logs_specs or DefaultLogsSpecs()
        if isinstance(self.logs_specs, EchoedLogs):
            # a function's workers open their pipes themselves (torch would open them
            # as seekable files): rove.agent.warm.run_script
            self.logs_specs.by_worker = callable(entrypoint)
        self.progress_dir = progress_dir
        self.start_method = start_method
        self.pcontext: PContext | None = None
        self._echoes: list[Echo] = []
        self._round = 0
        self.progress_files: dict[int, Path] = {}
        #: pids killed after their work was done (lingering, or stuck on their way out)
        self._reaped: set[int] = set()
        self._lock = threading.Lock()  # start, poll and stop run in different threads
        quiet_torch_tracebacks()

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
        args = {lr: tuple(macros.substitute(self.args, str(lr))) for lr in envs}
        with self._lock:
            assert self.pcontext is None, "the previous round's workers still run"
            self.progress_files = files
            self._reaped = set()
            self.pcontext = start_processes(
                name=self.name,
                entrypoint=self.entrypoint,
                args=args,
                envs=full_envs,
                logs_specs=self.logs_specs,
                start_method=self.start_method,
            )
            self._round = round_
            if isinstance(self.logs_specs, EchoedLogs):
                self._echoes = [Echo(self.logs_specs.take()).start()]
            return dict(self.pcontext.pids())

    def pids(self) -> dict[int, int]:
        pcontext = self.pcontext
        return dict(pcontext.pids()) if pcontext else {}

    async def wait(self) -> WorkersEnded:
        rnd = self._round
        pids = self.pids()
        watched = Sentinels(pids, _return_fds(self.pcontext))
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

    def _kept(self, result: RunProcsResult, local_rank: int, stream: str) -> str | None:
        """Where a worker's stdout or stderr is kept (torch knows at most the pipe)."""
        if isinstance(self.logs_specs, EchoedLogs):
            return self.logs_specs.kept.get((local_rank, stream))
        paths = result.stdouts if stream == "stdout" else result.stderrs
        return paths.get(local_rank) or None

    def _was_done(self, failure: ProcessFailure) -> bool:
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
        finished = getattr(self.pcontext, "_worker_finished_event", None)
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

    def _poll(self) -> RunProcsResult | None:
        """None while all run; else the result (the others are torn down first). Blocking."""
        with self._lock:
            pcontext = self.pcontext
            if pcontext is None:
                return None
            result = pcontext.wait(timeout=0)
            if result is not None and result.failures:
                _add_other_failures(pcontext, result)
            if result is not None:
                self.pcontext = None
                self._stop_echo()
            return result

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        with self._lock:
            if self.pcontext is not None:
                self.pcontext.close(death_sig=sig, timeout=int(max(1, timeout_s)))
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
        out = {}
        files = self.progress_files
        for local_rank, pid in self.pids().items():
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
                cpu_s, io = cpu.user + cpu.system, counters.read_chars + counters.write_chars
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


def _return_fds(pcontext: PContext | None) -> list[int]:
    """The read ends of the queues that a function-entrypoint context's workers return
    through. Such a worker returns its value, then waits (alive) until the agent has
    read every worker's: so a return, not only an exit, must wake the agent. Empty for
    a subprocess context, or where torch's internals differ (exits still wake it)."""
    queues = getattr(pcontext, "_ret_vals", None) or {}
    fds = []
    for queue in queues.values():
        reader = getattr(queue, "_reader", None)
        if reader is None:
            return []
        fds.append(reader.fileno())
    return fds


def _add_other_failures(pcontext: PContext, result: RunProcsResult) -> None:
    """Add the failures a function-entrypoint context leaves out of its result.

    torch's multiprocessing context reports only the first failed process it
    sees, often the survivor whose collective broke rather than the worker that
    was killed. Every process that ended badly is added (they all ended before
    the teardown was detected; one-second timestamps cannot order them), so
    `root_failure` can pick the cause.
    """
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if not processes:
        return  # a subprocess context: it reports every failure itself
    earliest = min(f.timestamp for f in result.failures.values())
    for local_rank, proc in enumerate(processes):
        code = proc.exitcode
        if local_rank in result.failures or code in (None, 0):
            continue
        failure = _failure(local_rank, proc.pid, code, pcontext.error_files.get(local_rank, ""))
        if not _stamped(failure):
            failure.timestamp = earliest
        result.failures[local_rank] = failure


def _stamped(failure: ProcessFailure) -> bool:
    """Whether the failure's timestamp is its error file's (else: when torch noticed it)."""
    return failure.error_file_data != {"message": "<NONE>"}


def _failure(local_rank: int, pid: int, code: int, error_file: str) -> ProcessFailure:
    """A `ProcessFailure`, without its error file when that cannot be read: a worker
    torch terminated while `@record` was writing it leaves a cut file behind, and
    torch's reader would raise (the agent once lost track of its workers that way)."""
    try:
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code, error_file=error_file)
    except ValueError:  # json.JSONDecodeError: a file cut short
        return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code, error_file="")


class PreformattedTraceback(logging.Filter):
    """Formats a record's traceback before torch's log formatter sees it, and leaves out
    torch's report of a failed worker function (a second copy of its traceback).

    torch's formatter imports `torch._dynamo` (about 1.4 s) the first time it
    formats an exception, which it does when a worker fails: in the agent that
    import would delay every first restart.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and record.msg.startswith("failed (exitcode"):
            return False  # the agent says it, diagnosed; the worker printed its traceback
        if record.exc_info:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip()
            record.exc_info = None
        return True


class TeardownSaid(logging.Filter):
    """Drops torch's "Terminating process N via signal SIGTERM" (one line per survivor,
    in torch's logging format on rove's console): the agent says the round's end."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith("Terminating process"))


def quiet_torch_tracebacks() -> None:
    """Install `PreformattedTraceback` on torch's process-context logger, and
    `TeardownSaid` on its spawn logger (idempotent)."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, PreformattedTraceback) for f in logger.filters):
        logger.addFilter(PreformattedTraceback())
    spawn = logging.getLogger("torch.multiprocessing.spawn")
    if not any(isinstance(f, TeardownSaid) for f in spawn.filters):
        spawn.addFilter(TeardownSaid())


def _symptom_rank(failure: ProcessFailure, diagnosis: Diagnosis) -> int:
    """0 for a likely cause, 1 for a likely symptom of another worker's death."""
    if diagnosis.kind is FailureKind.COMMUNICATION:
        return 1  # a broken connection: usually a peer that died
    if failure.exitcode == -signal.SIGTERM and not failure.error_file_data:
        return 2  # usually torch's own teardown of the survivors (one that raised is a cause)
    return 0


def _torchs(result: RunProcsResult, local_rank: int, stream: str) -> str | None:
    paths = result.stdouts if stream == "stdout" else result.stderrs
    return paths.get(local_rank) or None


def root_failure(
    result: RunProcsResult,
    kept: Callable[[RunProcsResult, int, str], str | None] = _torchs,
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
    failures: list[ProcessFailure] = list(result.failures.values())
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
