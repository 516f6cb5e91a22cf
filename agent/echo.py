"""Workers' stderr on the console, byte for byte, and in a file for diagnosis.

torchrun leaves a worker's stderr on the launcher's terminal unless asked to
redirect it. rove also needs the last lines in a file (to tell an out-of-memory
from a NCCL error from a Python exception), so by default each worker's stderr
goes to a file and `Echo` copies what is written there to the launcher's own
stderr unchanged: no `[default0]:` prefix, carriage returns kept (a progress bar
redraws its line), and nothing split or re-encoded. torch's own tee (`--tee`)
is for users who ask for prefixed lines.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

#: how long the copying thread sleeps when no worker wrote anything
POLL_S = 0.05
#: the most it reads from one file at a time
CHUNK = 1 << 16


class EchoedLogs(DefaultLogsSpecs):
    """rove's default logs: each worker's stderr to a file under `log_dir`, echoed
    raw (`Echo`) to the console for the ranks in `local_ranks_filter` (all if None);
    stdout left on the console, as under torchrun."""

    def __init__(self, log_dir: str | None, local_ranks_filter: set[int] | None) -> None:
        super().__init__(log_dir=log_dir, redirects=Std.ERR, tee=Std.NONE)
        self.echo_ranks = local_ranks_filter

    def echoed(self, stderrs: Mapping[int, str]) -> dict[int, str]:
        """The stderr files to copy to the console."""
        return {
            rank: path
            for rank, path in stderrs.items()
            if path and (self.echo_ranks is None or rank in self.echo_ranks)
        }


class Echo:
    """Copy the files in `paths` (local rank -> path) to file descriptor `fd` as they
    grow, until `stop()`; one thread for every file of a round."""

    def __init__(self, paths: Mapping[int, str], fd: int = 2) -> None:
        self.paths = dict(paths)
        self.fd = fd
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
        opened: dict[int, int] = {}
        try:
            while True:
                last_pass = self._done.is_set()  # drained after the workers ended
                wrote = False
                for rank, path in self.paths.items():
                    if rank not in opened:
                        try:
                            opened[rank] = os.open(path, os.O_RDONLY)
                        except OSError:
                            continue  # not created yet
                    while chunk := os.read(opened[rank], CHUNK):
                        wrote = True
                        _write_all(self.fd, chunk)
                if last_pass:
                    return
                if not wrote:
                    self._done.wait(POLL_S)
        except OSError:
            return  # the console is gone (a closed pipe): nothing to copy to
        finally:
            for descriptor in opened.values():
                os.close(descriptor)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
