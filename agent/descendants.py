"""The processes a worker started, as signs of its life.

A worker waiting for a process of its own (rank 0 uploading the final model with `aws
s3 cp`, an evaluation run by `subprocess.run`, a long task in a `multiprocessing` pool)
uses no CPU and does no I/O itself: the exit watch (`rove.agent.exit_watch`) took it for
stuck once its peers had returned, and ended the job as a hang after the exit timeout.
So a worker's life counts its descendants' CPU and I/O too: the CPU of those it reaped
(its own `children_user` and `children_system`, read at every sample) and the CPU and I/O
of those alive (`Descendants.totals`, one scan of the process table for all workers, at
most every `EVERY_S`: the timeouts it serves are tens of seconds). A scan took 3.5 ms
on this 2-core machine with 70 processes, all of them below the worker: under 0.2 % of a
core.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable

import psutil

#: How often the live descendants are counted (a scan of every process's parent).
EVERY_S = 2.0


class Descendants:
    """The CPU seconds and I/O bytes of each worker's live descendants, kept between
    scans."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._at = float("-inf")
        self._pids: dict[int, int] = {}
        self._totals: dict[int, tuple[float, int]] = {}

    def totals(self, pids: dict[int, int]) -> dict[int, tuple[float, int]]:
        """`{local rank: (CPU seconds, I/O bytes)}` of the live descendants of each
        worker (`pids`: local rank to pid); scanned again at most every `EVERY_S`."""
        now = self.clock()
        if now - self._at >= EVERY_S or pids != self._pids:
            self._at, self._pids = now, dict(pids)
            self._totals = scan(pids)
        return self._totals


def scan(pids: dict[int, int]) -> dict[int, tuple[float, int]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for process in psutil.process_iter(["ppid"]):
        children[process.info["ppid"]].append(process.pid)
    totals = {}
    for local_rank, root in pids.items():
        cpu_s, io = 0.0, 0
        below = list(children.get(root, ()))
        while below:
            pid = below.pop()
            below.extend(children.get(pid, ()))
            with contextlib.suppress(psutil.Error, OSError):
                process = psutil.Process(pid)
                with process.oneshot():
                    times = process.cpu_times()
                    counters = process.io_counters()
                cpu_s += times.user + times.system
                io += counters.read_chars + counters.write_chars
        totals[local_rank] = (cpu_s, io)
    return totals
