"""Workers' output on the console, byte for byte, and kept in the job's folder.

torchrun leaves a worker's stdout and stderr on the launcher's terminal unless asked
to redirect them. rove also keeps them (to tell an out-of-memory from a NCCL error
from a Python exception, and to read them after the job: `rove logs`). By default each
worker writes its stdout and stderr into a pipe (a FIFO torch opens as if it were the
log file), and the agent's `Echo` thread copies what comes out of each pipe, unchanged,

* to the launcher's own stdout or stderr: no `[default0]:` prefix, carriage returns
  kept (a progress bar redraws its line), nothing split or re-encoded; and
* to the kept file, rotated once it passes `max_bytes` (the one before it kept as
  `.1`), so a round's output is bounded and nothing of it is lost to the rotation:

    ROVE_HOME/jobs/<job>/logs/<node>/round<R>/rank<RANK>.stdout   (and .stderr,
                                                                    .error.json)

torch's own tee (`--tee`) is for users who ask for prefixed lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import structlog

from rove.control.history import joblogs

log = structlog.get_logger("rove.agent")

#: how long the copying thread sleeps when no worker wrote anything
POLL_S = 0.05
#: the most it reads from one pipe at a time
CHUNK = 1 << 16
#: a kept file is rotated past this size (env ROVE_LOG_MAX_BYTES): each stream of each
#: rank of a round keeps at most twice this
MAX_BYTES_DEFAULT = 64 << 20
#: what a pipe holds before a writing worker waits for the agent (the kernel's default
#: is 64 KiB; a larger one rides out a busy moment of the agent)
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
PIPES = ".pipes"
#: how long, at most, the copy goes on after the workers ended (a process they left
#: behind may still write)
DRAIN_S = 2.0


class Kept:
    """A kept output file, appended to and rotated past `max_bytes`."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._file = path.open("ab", buffering=0)
        self._size = self._file.tell()
        self.failed = False

    def write(self, data: bytes) -> None:
        """Append `data`; a disk that refuses it (full, gone) is said once, and the
        output still reaches the console (a worker never waits on its log)."""
        if self.failed:
            return
        try:
            if self._size and self._size + len(data) > self.max_bytes:
                self._file.close()
                self.path.replace(self.path.with_name(self.path.name + ".1"))
                self._file = self.path.open("ab", buffering=0)
                self._size = 0
            self._file.write(data)
            self._size += len(data)
        except OSError as exc:
            self.failed = True
            log.warning(
                f"cannot keep a worker's output in {self.path}: {exc}; it still goes to "
                "the console, and is no longer kept",
            )

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


class Stream:
    """One worker's stdout or stderr: the pipe it writes, where it is kept, and the
    console's descriptor if it is echoed there."""

    def __init__(self, pipe: Path, kept: Kept, console_fd: int | None) -> None:
        os.mkfifo(pipe, 0o600)
        # open before the worker: its open for writing then never waits for a reader
        self.fd = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self.fd, _F_SETPIPE_SZ, PIPE_BYTES)
        self.pipe = pipe
        self.kept = kept
        self.console_fd = console_fd

    def pump(self) -> bool:
        """Copy what the pipe holds now; whether there was anything."""
        moved = False
        while True:
            try:
                chunk = os.read(self.fd, CHUNK)
            except BlockingIOError:
                return moved
            if not chunk:
                return moved  # no writer holds the pipe now
            moved = True
            self.kept.write(chunk)
            if self.console_fd is not None:
                try:
                    _write_all(self.console_fd, chunk)
                except OSError:
                    self.console_fd = None  # the console is gone: keep the file going

    def close(self) -> None:
        os.close(self.fd)
        self.kept.close()
        self.pipe.unlink(missing_ok=True)


#: where a worker that opens its own pipes (`by_worker`) finds them
PIPE_ENV = {"stdout": "ROVE_STDOUT_PIPE", "stderr": "ROVE_STDERR_PIPE"}


def redirect_to_pipes() -> None:
    """In a worker: point stdout and stderr at the pipes its agent reads (named in its
    environment, then removed from it, as torchrun's workers have no such variables).
    A pipe no agent reads any more (the round is over) is left alone."""
    for stream, fd in (("stdout", 1), ("stderr", 2)):
        path = os.environ.pop(PIPE_ENV[stream], None)
        if not path:
            continue
        try:
            pipe = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader
        except OSError:
            continue
        os.set_blocking(pipe, True)  # a full pipe makes a print wait, not fail
        getattr(sys, stream).flush()
        os.dup2(pipe, fd)
        os.close(pipe)


@dataclasses.dataclass
class Dest:
    """Where a round's workers write: each local rank's stdout and stderr pipe (empty
    where the worker opens its own, `by_worker`) and its error file (torch's
    `LogsDest`, without torch)."""

    stdouts: dict[int, str] = dataclasses.field(default_factory=dict)
    stderrs: dict[int, str] = dataclasses.field(default_factory=dict)
    error_files: dict[int, str] = dataclasses.field(default_factory=dict)


class EchoedLogs:
    """rove's default logs: each worker's stdout and stderr through a pipe into files
    under `folder` (one folder per round, files named by global rank), copied raw to
    the console for the local ranks in `local_ranks_filter` (all if None)."""

    def __init__(
        self,
        folder: Path,
        local_ranks_filter: set[int] | None = None,
        max_bytes: int = MAX_BYTES_DEFAULT,
    ) -> None:
        self.folder = folder
        self.echo_ranks = local_ranks_filter
        self.max_bytes = max_bytes
        #: the workers open their pipes themselves (`redirect_to_pipes`): a function
        #: entrypoint's, which torch would open as seekable files
        self.by_worker = False
        self._streams: list[Stream] = []
        #: (local rank, stream) -> the kept file, for the round just reified
        self.kept: dict[tuple[int, str], str] = {}

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def reify(self, envs: dict[int, dict[str, str]]) -> Dest:
        first = envs[min(envs)] if envs else {}
        round_dir = joblogs.round_folder(self.folder, first.get("ROVE_ROUND", "0"))
        shutil.rmtree(round_dir, ignore_errors=True)  # a rerun of the job name
        (round_dir / PIPES).mkdir(parents=True)
        dest = Dest()
        self.kept = {}
        for local_rank, env in envs.items():
            rank = env.get("RANK", local_rank)
            shown = self.echo_ranks is None or local_rank in self.echo_ranks
            dest.stdouts[local_rank] = dest.stderrs[local_rank] = ""  # (the console)
            for stream, paths, console in (
                ("stdout", dest.stdouts, 1),
                ("stderr", dest.stderrs, 2),
            ):
                name = joblogs.file_name(rank, stream)
                pipe = round_dir / PIPES / name
                kept = Kept(round_dir / name, self.max_bytes)
                self._streams.append(Stream(pipe, kept, console if shown else None))
                self.kept[(local_rank, stream)] = str(kept.path)
                if self.by_worker:
                    env[PIPE_ENV[stream]] = str(pipe)
                else:
                    paths[local_rank] = str(pipe)
            dest.error_files[local_rank] = str(round_dir / joblogs.file_name(rank, "error.json"))
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
        return dest

    def take(self) -> list[Stream]:
        """The streams of the round just reified (for its `Echo`)."""
        streams, self._streams = self._streams, []
        return streams


class Echo:
    """Copy `streams` to their kept files and the console as workers write them, until
    `stop()`: one thread for a round."""

    def __init__(self, streams: Iterable[Stream]) -> None:
        self.streams = list(streams)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._copy, name="rove-echo", daemon=True)

    def start(self) -> Echo:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Copy what is left, then stop (the workers have ended)."""
        self._done.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _copy(self) -> None:
        drain_until = None
        try:
            while True:
                if drain_until is None and self._done.is_set():
                    drain_until = time.monotonic() + DRAIN_S  # what the ended workers left
                moved = False
                for stream in self.streams:
                    try:
                        moved |= stream.pump()
                    except Exception:  # a copier that died would leave workers blocked
                        log.exception("copying a worker's output failed", pipe=str(stream.pipe))
                if drain_until is not None and (not moved or time.monotonic() > drain_until):
                    return
                if not moved and drain_until is None:
                    self._done.wait(POLL_S)
        finally:
            for stream in self.streams:
                stream.close()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
