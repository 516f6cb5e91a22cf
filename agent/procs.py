"""A round's worker processes forked from the warm server, without torch in the agent.

torch's `start_processes` with a function entrypoint (its `MultiprocessContext`) is
how torchrun runs a function in each worker; rove's warm workers are such functions
(`rove.agent.warm.run_script`, forked from the warm server). torch's machinery lives
in modules that import torch, 2.1 CPU-seconds for the launcher, which needs nothing of
torch but this: so `Forked` does what that context does, for rove's own logs (each
worker opens its pipes itself: `rove.agent.echo`), and workers started any other way
(`--no-warm-start`, torch's `--redirects`/`--tee`) still go through torch's
(`rove.agent.torch_procs`).

What it keeps of torch's context, so a worker cannot tell the difference:

* each worker: its environment set, then the function run (the error file that
  `@record` writes, `TORCHELASTIC_ERROR_FILE`, is written for an exception), its
  return value put on a queue of its own, and the worker waits until the agent read
  every worker's value before it exits (a worker's exit never outruns its return);
* the first worker to end badly ends the round: the others get SIGTERM, and SIGKILL
  if they have not exited 30 s later (torch's grace); every worker that ended badly
  is reported (`Failure`, its error file read as torch reads it), not only the first;
* `close(sig, timeout)`: the signal to every live worker, SIGKILL after `timeout`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import multiprocessing
import os
import signal
import string
import sys
import time
from collections.abc import Callable, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import structlog

#: how long workers get to exit after the first one ended badly (torch's 30 s)
TEARDOWN_GRACE_S = 30.0
#: an error file that says nothing (torch's `_EMPTY_ERROR_DATA`)
NO_ERROR_FILE = "<N/A>"

log = structlog.get_logger("rove.agent")


@dataclasses.dataclass
class Failure:
    """A worker that ended badly, with what its error file says (as torch's
    `ProcessFailure` reads it): `error_file_data` is the file's JSON ({"message":
    "<NONE>"} without one, and `error_file` then "<N/A>"), `timestamp` the file's time,
    else when the failure was seen."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str = ""
    error_file_data: dict[str, Any] = dataclasses.field(init=False)
    timestamp: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        data = _read_error_file(self.error_file)
        if data is None:
            self.error_file, self.error_file_data = NO_ERROR_FILE, {"message": "<NONE>"}
            self.timestamp = int(time.time())
            return
        self.error_file_data = data
        message = data.get("message")
        try:
            if isinstance(message, dict):
                self.timestamp = int(message["extraInfo"]["timestamp"])
            else:
                self.timestamp = int(data.get("timestamp", 0))
        except (KeyError, TypeError, ValueError):  # a file not of `@record`'s shape
            self.timestamp = int(time.time())


def _read_error_file(path: str) -> dict[str, Any] | None:
    """An error file's JSON; None where there is none, or it cannot be read whole (a
    worker torn down while `@record` wrote it leaves a cut file behind)."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):  # none, or cut short
        return None
    return data if isinstance(data, dict) else None


@dataclasses.dataclass
class Result:
    """How a round's workers ended: every failure, else every worker's return value;
    where each one's stdout and stderr went (empty: the console, or a pipe the worker
    opened)."""

    failures: dict[int, Failure] = dataclasses.field(default_factory=dict)
    return_values: dict[int, Any] = dataclasses.field(default_factory=dict)
    stdouts: dict[int, str] = dataclasses.field(default_factory=dict)
    stderrs: dict[int, str] = dataclasses.field(default_factory=dict)

    def is_failed(self) -> bool:
        return bool(self.failures)


def substitute(args: Sequence[Any], local_rank: int) -> tuple[Any, ...]:
    """torchrun's `${local_rank}` in a worker's arguments, replaced by its local rank."""
    return tuple(
        string.Template(a).safe_substitute(local_rank=str(local_rank)) if isinstance(a, str) else a
        for a in args
    )


def _worker(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    returned: Any,
    read: Any,
) -> None:
    """A worker's body (in the forked process): what torch's context and its `@record`
    run there. A fatal signal's Python traceback is printed (faulthandler, all
    threads); `sys.exit(0)` (or `sys.exit()`) is a return; an exception writes the
    error file and exits 1; a KeyboardInterrupt ends the process by SIGINT, as an
    interpreter's main module does."""
    os.environ.update(env)
    with contextlib.suppress(Exception):
        faulthandler.enable(all_threads=True)
    try:
        value = fn(*args)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        value = None
    except KeyboardInterrupt:
        _flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except Exception as exc:  # noqa: BLE001 - any exception of the function ends the worker
        _record(exc)
        sys.exit(1)
    returned.send(value)
    with contextlib.suppress(OSError):
        os.read(read.fileno(), 1)  # (or EOF: the agent read every value, or is gone)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _record(exc: Exception) -> None:
    """The error file of `exc`, as torch's `@record` writes it (where torch is imported:
    the warm server's workers have it)."""
    if "torch" not in sys.modules or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


class _AllRead:
    """Set once every worker's value was read: the agent closes its end of a pipe whose
    other end each worker waits on. (A pipe, not a multiprocessing Event: under the
    forkserver an Event is named semaphores in /dev/shm, which a node killed with its
    resource tracker, SIGKILL to its process group, left there for good.)"""

    def __init__(self, ctx: Any, workers: int) -> None:
        self.reader, self._writer = ctx.Pipe(duplex=False)
        self._workers = workers

    def set(self) -> None:
        if self._writer.closed:
            return
        # a byte for each (a worker started by fork holds a copy of this end: no EOF),
        # read one by one (raw: a message's frame read by two workers at once would tear)
        with contextlib.suppress(OSError):
            os.write(self._writer.fileno(), b"\0" * self._workers)
        self._writer.close()

    def is_set(self) -> bool:
        return bool(self._writer.closed)


class Forked:
    """One round's workers: `fn(*args[local_rank])` in a process each, started by the
    multiprocessing context `start_method` (the warm server's "forkserver"). A worker
    returns its value through a pipe of its own; nothing here is a named semaphore."""

    def __init__(
        self,
        fn: Callable[..., Any],
        args: dict[int, tuple[Any, ...]],
        envs: dict[int, dict[str, str]],
        error_files: dict[int, str],
        start_method: str = "forkserver",
    ) -> None:
        ranks = sorted(envs)
        if ranks != list(range(len(ranks))) or sorted(args) != ranks:
            raise ValueError(f"local ranks must be 0..N-1 in both args and envs, got {ranks}")
        ctx: Any = multiprocessing.get_context(start_method)
        self.error_files = dict(error_files)
        #: (read end, write end) of the pipe each worker returns its value through
        self.returned = {lr: ctx.Pipe(duplex=False) for lr in ranks}
        #: set once every worker's return value was read: then they exit
        self.all_read = _AllRead(ctx, len(ranks))
        self._values: dict[int, Any] = {}
        self.processes: list[BaseProcess] = []
        try:
            for lr in ranks:
                process = ctx.Process(
                    target=_worker,
                    args=(fn, args[lr], envs[lr], self.returned[lr][1], self.all_read.reader),
                    daemon=False,  # (and multiprocessing's own name, as under torch's)
                )
                process.start()
                self.processes.append(process)
        except BaseException:
            self.close(signal.SIGKILL, 1)
            raise

    def pids(self) -> dict[int, int]:
        return {lr: int(p.pid) for lr, p in enumerate(self.processes) if p.pid is not None}

    def return_fds(self) -> list[int]:
        """The read ends of the return queues: a worker's return wakes whoever waits."""
        return [reader.fileno() for reader, _ in self.returned.values()]

    def poll(self) -> Result | None:
        """None while the workers run; else how they ended (blocking only to tear the
        others down once one ended badly)."""
        for lr, (reader, _) in self.returned.items():
            if lr not in self._values and reader.poll():
                self._values[lr] = reader.recv()
        if any(p.exitcode not in (None, 0) for p in self.processes):
            return self._failed()
        if len(self._values) == len(self.processes):
            self.all_read.set()
            if all(p.exitcode is not None for p in self.processes):
                return Result(return_values=dict(self._values))
            return None
        if all(p.exitcode == 0 for p in self.processes):
            # every one exited, and not all returned (a KeyboardInterrupt ends the
            # function without a value): those that did not, failed
            return Result(
                failures={
                    lr: self._failure(lr)
                    for lr in range(len(self.processes))
                    if lr not in self._values
                }
            )
        return None

    def _failed(self) -> Result:
        """One ended badly: end the others (SIGTERM, SIGKILL after the grace), then
        report every worker that ended badly, each without an error file stamped when
        it was seen (only an error file says when a worker failed): those that ended
        before the teardown first, as torch's `SubprocessContext` does, so a worker
        killed at the grace's end is never taken for the cause."""
        failures = self._failures()
        self.close(signal.SIGTERM, TEARDOWN_GRACE_S)
        return Result(
            failures=failures | {lr: f for lr, f in self._failures().items() if lr not in failures}
        )

    def _failures(self) -> dict[int, Failure]:
        return {
            lr: self._failure(lr)
            for lr, p in enumerate(self.processes)
            if p.exitcode not in (None, 0)
        }

    def _failure(self, local_rank: int) -> Failure:
        process = self.processes[local_rank]
        return Failure(
            local_rank=local_rank,
            pid=int(process.pid or 0),
            exitcode=int(process.exitcode or 0),
            error_file=self.error_files.get(local_rank, ""),
        )

    def close(self, death_sig: signal.Signals = signal.SIGTERM, timeout: float = 30) -> None:
        """`death_sig` to every live worker, SIGKILL to those still alive `timeout`
        seconds later; then their exits are collected."""
        # the round is over: a worker that returned, or returns on this signal (a
        # handler's `sys.exit(0)`, a SLURM job saving on SIGUSR1), exits at once rather
        # than wait for its value to be read (killed at the timeout's end, it was)
        self.all_read.set()
        live = [p for p in self.processes if p.exitcode is None]
        for process in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(process.pid or 0), death_sig)
        end = time.monotonic() + timeout
        for process in live:
            process.join(max(0.0, end - time.monotonic()))
        for local_rank, process in enumerate(self.processes):
            if process in live and process.exitcode is None:
                log.warning(
                    f"worker {local_rank} has not exited {timeout:g}s after {death_sig.name}: "
                    "killing it (SIGKILL)",
                    pid=process.pid,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(process.pid or 0), signal.SIGKILL)
                process.join(5.0)  # (a process stuck in the kernel may take longer)
