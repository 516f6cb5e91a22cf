"""Workers started through torch's own `start_processes`, as torchrun starts them.

A worker started as a fresh interpreter (`--no-warm-start`, a binary entrypoint), or
with torch's own logs (`--redirects`, `--tee`, `--logs-specs`), goes through torch's
process contexts; this module, imported only then, adapts them to what the agent
reads of rove's (`rove.agent.procs.Forked`): the pids, a poll that says every failure
(`rove.agent.procs.Result`), and the close.
"""

from __future__ import annotations

import logging
import signal
import traceback
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    LogsSpecs,
    PContext,
    start_processes,
)
from torch.distributed.elastic.multiprocessing.api import LogsDest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from rove.agent.echo import EchoedLogs
from rove.agent.procs import Failure, Result


class _Echoed(LogsSpecs):
    """rove's `EchoedLogs` as torch's `LogsSpecs`."""

    def __init__(self, logs: EchoedLogs) -> None:
        super().__init__(log_dir=str(logs.folder), local_ranks_filter=logs.echo_ranks)
        self.logs = logs

    @property
    def root_log_dir(self) -> str:
        return self.logs.root_log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = self.logs.reify(envs)
        out = LogsDest()
        out.stdouts, out.stderrs, out.error_files = dest.stdouts, dest.stderrs, dest.error_files
        return out


def default_logs() -> LogsSpecs:
    return DefaultLogsSpecs()


class TorchStarted:
    """One round's workers in a torch process context."""

    def __init__(
        self,
        name: str,
        entrypoint: str | Callable[..., Any],
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        logs: Any,
        start_method: str,
    ) -> None:
        quiet_torch_tracebacks()
        specs = _Echoed(logs) if isinstance(logs, EchoedLogs) else logs
        self.pcontext: PContext = start_processes(
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            logs_specs=specs,
            start_method=start_method,
        )
        self.error_files = dict(self.pcontext.error_files)
        #: set by torch once every function worker's value was read (None: binaries)
        self.all_read = getattr(self.pcontext, "_worker_finished_event", None)

    def pids(self) -> dict[int, int]:
        return dict(self.pcontext.pids())

    def return_fds(self) -> list[int]:
        """The read ends of the queues a function worker returns through. Empty for a
        subprocess context, or where torch's internals differ (exits still wake it)."""
        queues = getattr(self.pcontext, "_ret_vals", None) or {}
        fds = []
        for queue in queues.values():
            reader = getattr(queue, "_reader", None)
            if reader is None:
                return []
            fds.append(reader.fileno())
        return fds

    def poll(self) -> Result | None:
        result = self.pcontext.wait(timeout=0)
        if result is None:
            return None
        failures = {lr: _failure(f) for lr, f in result.failures.items()}
        if failures:
            _add_other_failures(self.pcontext, failures)
        return Result(
            failures=failures,
            return_values=dict(result.return_values),
            stdouts=dict(result.stdouts),
            stderrs=dict(result.stderrs),
        )

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        self.pcontext.close(death_sig=death_sig, timeout=int(max(1, timeout)))


def _failure(f: ProcessFailure) -> Failure:
    return Failure(local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode, error_file=f.error_file)


def _add_other_failures(pcontext: PContext, failures: dict[int, Failure]) -> None:
    """Add the failures a function-entrypoint context leaves out of its result: torch's
    multiprocessing context reports only the first failed process it sees, often the
    survivor whose collective broke rather than the worker that was killed."""
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if not processes:
        return  # a subprocess context: it reports every failure itself
    for local_rank, proc in enumerate(processes):
        code = proc.exitcode
        if local_rank in failures or code in (None, 0):
            continue
        failures[local_rank] = Failure(
            local_rank=local_rank,
            pid=proc.pid,
            exitcode=code,
            error_file=pcontext.error_files.get(local_rank, ""),
        )


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
    """Drops torch's "Terminating process N via signal SIGTERM" (warm workers) and
    "Sending process N closing signal SIGTERM" (fresh ones): one line per survivor, in
    torch's logging format on rove's console; the agent says the round's end."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            isinstance(record.msg, str)
            and record.msg.startswith(("Terminating process", "Sending process"))
        )


def quiet_torch_tracebacks() -> None:
    """Install `PreformattedTraceback` on torch's process-context logger, and
    `TeardownSaid` on it and its spawn logger (idempotent)."""
    logger = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, PreformattedTraceback) for f in logger.filters):
        logger.addFilter(PreformattedTraceback())
    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn"):
        teardown = logging.getLogger(name)
        if not any(isinstance(f, TeardownSaid) for f in teardown.filters):
            teardown.addFilter(TeardownSaid())
