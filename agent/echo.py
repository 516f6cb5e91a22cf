"""Workers' output on the console, byte for byte, and kept in the job's folder.

torchrun leaves a worker's stdout and stderr on the launcher's terminal unless asked
to redirect them. rove also keeps them (to tell an out-of-memory from a NCCL error
from a Python exception, and to read them after the job: `rove logs`), so by default
each worker writes to files in the job's folder,

    ROVE_HOME/jobs/<job>/logs/<node>/round<R>/rank<RANK>.stdout   (and .stderr,
                                                                    .error.json)

and `Echo` copies what is written there to the launcher's own stdout and stderr
unchanged: no `[default0]:` prefix, carriage returns kept (a progress bar redraws its
line), nothing split or re-encoded. torch's own tee (`--tee`) is for users who ask for
prefixed lines.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Mapping
from pathlib import Path

from torch.distributed.elastic.multiprocessing import LogsSpecs
from torch.distributed.elastic.multiprocessing.api import LogsDest

from rove.control import joblogs

#: how long the copying thread sleeps when no worker wrote anything
POLL_S = 0.05
#: the most it reads from one file at a time
CHUNK = 1 << 16


class EchoedLogs(LogsSpecs):
    """rove's default logs: each worker's stdout and stderr to files under `folder`
    (one folder per round, files named by global rank), copied raw (`Echo`) to the
    console for the local ranks in `local_ranks_filter` (all if None)."""

    def __init__(self, folder: Path, local_ranks_filter: set[int] | None = None) -> None:
        super().__init__(log_dir=str(folder), local_ranks_filter=local_ranks_filter)
        self.folder = folder
        self.echo_ranks = local_ranks_filter

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        first = envs[min(envs)] if envs else {}
        round_dir = joblogs.round_folder(self.folder, first.get("ROVE_ROUND", "0"))
        shutil.rmtree(round_dir, ignore_errors=True)  # a rerun of the job name
        round_dir.mkdir(parents=True)
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank = env.get("RANK", local_rank)
            dest.stdouts[local_rank] = str(round_dir / joblogs.file_name(rank, "stdout"))
            dest.stderrs[local_rank] = str(round_dir / joblogs.file_name(rank, "stderr"))
            dest.error_files[local_rank] = str(round_dir / joblogs.file_name(rank, "error.json"))
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
        return dest

    def echoed(self, paths: Mapping[int, str]) -> dict[int, str]:
        """The files among `paths` (local rank -> path) to copy to the console."""
        return {
            rank: path
            for rank, path in paths.items()
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
