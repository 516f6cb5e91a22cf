"""The worker processes of one node, started with torch's own machinery.

`torch.distributed.elastic.multiprocessing.start_processes` gives rove the
same process handling as torchrun: log redirection and tee (`--redirects`,
`--tee`, `--log-dir`), the `TORCHELASTIC_ERROR_FILE` that `@record` writes,
and teardown of the other local workers when one fails.
"""

from __future__ import annotations

import logging
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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
from rove.agent.diagnosis import Diagnosis, classify, read_tail
from rove.control.events import FailureKind


@dataclass(frozen=True)
class RootFailure:
    """The failure that started a teardown (not the SIGTERMs the teardown sent)."""

    local_rank: int
    pid: int
    exit_code: int
    diagnosis: Diagnosis
    log_tail: str


class WorkerGroup:
    """Start, poll and stop one round's worker processes on this node."""

    def __init__(
        self,
        entrypoint: str | Callable[..., None],
        args: list[str],
        logs_specs: LogsSpecs | None,
        progress_dir: Path,
        *,
        start_method: str = "spawn",
        name: str = "default",
    ) -> None:
        self.name = name
        self.entrypoint = entrypoint
        self.args = list(args)
        self.logs_specs = logs_specs or DefaultLogsSpecs()
        self.progress_dir = progress_dir
        self.start_method = start_method
        self.pcontext: PContext | None = None
        self.round = 0
        self.progress_files: dict[int, Path] = {}
        quiet_torch_tracebacks()

    @property
    def running(self) -> bool:
        return self.pcontext is not None

    def start(self, round_: int, envs: dict[int, dict[str, str]]) -> dict[int, int]:
        """Start one process per local rank; returns local_rank -> pid."""
        self.progress_dir.mkdir(parents=True, exist_ok=True)
        self.progress_files = {}
        full_envs = {}
        for local_rank, env in envs.items():
            path = self.progress_dir / f"round{round_}-local{local_rank}"
            progress.create(path)
            self.progress_files[local_rank] = path
            full_envs[local_rank] = {**env, progress.ENV: str(path)}
        args = {lr: tuple(macros.substitute(self.args, str(lr))) for lr in envs}
        self.pcontext = start_processes(
            name=self.name,
            entrypoint=self.entrypoint,
            args=args,
            envs=full_envs,
            logs_specs=self.logs_specs,
            start_method=self.start_method,
        )
        self.round = round_
        return dict(self.pcontext.pids())

    def pids(self) -> dict[int, int]:
        return dict(self.pcontext.pids()) if self.pcontext else {}

    def poll(self) -> RunProcsResult | None:
        """None while all run; else the result (the others are torn down first). Blocking."""
        if self.pcontext is None:
            return None
        pcontext = self.pcontext
        result = pcontext.wait(timeout=0)
        if result is not None and result.failures:
            _add_other_failures(pcontext, result)
        if result is not None:
            self.pcontext = None
        return result

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL after `timeout`). Blocking."""
        if self.pcontext is not None:
            self.pcontext.close(death_sig=sig, timeout=int(max(1, timeout)))
            self.pcontext = None

    def progress(self) -> dict[int, progress.Progress]:
        out = {}
        for local_rank, path in self.progress_files.items():
            p = progress.read(path)
            if p is not None:
                out[local_rank] = p
        return out


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
        failure = ProcessFailure(
            local_rank=local_rank,
            pid=proc.pid,
            exitcode=code,
            error_file=pcontext.error_files.get(local_rank, ""),
        )
        if not failure.error_file_data:
            failure.timestamp = earliest
        result.failures[local_rank] = failure


class PreformattedTraceback(logging.Filter):
    """Formats a record's traceback before torch's log formatter sees it.

    torch's formatter imports `torch._dynamo` (about 1.4 s) the first time it
    formats an exception, which it does when a worker fails: in the agent that
    import would delay every first restart.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip()
            record.exc_info = None
        return True


def quiet_torch_tracebacks() -> None:
    """Install `PreformattedTraceback` on torch's process-context logger (idempotent)."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, PreformattedTraceback) for f in logger.filters):
        logger.addFilter(PreformattedTraceback())


def _symptom_rank(failure: ProcessFailure, diagnosis: Diagnosis) -> int:
    """0 for a likely cause, 1 for a likely symptom of another worker's death."""
    if diagnosis.kind is FailureKind.COMMUNICATION:
        return 1  # a broken connection: usually a peer that died
    if failure.exitcode == -signal.SIGTERM:
        return 2  # usually torch's own teardown of the survivors
    return 0


def root_failure(result: RunProcsResult) -> RootFailure | None:
    """The failure that started the teardown.

    torch records failures with one-second timestamps, the real one before the
    SIGTERMs of its own teardown. Among the earliest, a cause wins over a
    symptom: a worker killed by a signal beats the peer whose collective then
    broke, which may have been seen first.
    """
    failures: list[ProcessFailure] = list(result.failures.values())
    if not failures:
        return None
    earliest = min(f.timestamp for f in failures)
    candidates = []
    for f in failures:
        if f.timestamp > earliest:
            continue
        tail = read_tail(result.stderrs.get(f.local_rank)) or read_tail(
            result.stdouts.get(f.local_rank)
        )
        data = f.error_file_data if f.error_file_data else None
        diagnosis = classify(f.exitcode, data, tail)
        candidates.append((_symptom_rank(f, diagnosis), f, diagnosis, tail))
    _, first, diagnosis, tail = min(candidates, key=lambda c: c[0])
    return RootFailure(
        local_rank=first.local_rank,
        pid=first.pid,
        exit_code=first.exitcode,
        diagnosis=diagnosis,
        log_tail=tail,
    )
