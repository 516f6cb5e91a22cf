"""Step progress from training processes to their agent, through a tiny shared file.

In the training script (a no-op when not run under `rove run`):

    from rove.agent.progress import report
    report(step, samples=batch_size)      # once per step
    report(step, samples=batch_size, busy_s=compute_seconds)   # also straggler detection

The agent gives each worker a file (`ROVE_PROGRESS_FILE`) holding four
numbers: the last step, the samples seen so far, when the step ended, and the
seconds of the worker's own work so far (`busy_s`: the step's time outside
collectives and data waits, as the script measures it). It reads them for
heartbeats (step, throughput, busy time per step) and for hang detection: a
worker alive but without progress for `--hang-timeout` seconds is hung. The
optimiser replaces a node whose busy time per step is far above the others'
(`docs/scaling.md`): in synchronous training every rank steps at the
slowest one's pace, so throughput alone cannot name the straggler.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from pathlib import Path
from typing import NamedTuple

_LAYOUT = struct.Struct("<qddd")  # step, samples, unix time of the report, busy seconds
ENV = "ROVE_PROGRESS_FILE"


class Progress(NamedTuple):
    step: int
    samples: float
    at: float
    busy_s: float = 0.0


class _Writer:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, _LAYOUT.size)
        finally:
            os.close(fd)
        self.samples = 0.0
        self.busy_s = 0.0


_writer: _Writer | None = None
_checked = False


def report(step: int, samples: float = 0.0, busy_s: float = 0.0) -> None:
    """Record that `step` finished after `samples` more samples and `busy_s` seconds of
    this worker's own work (cheap: one memory write)."""
    global _writer, _checked
    if not _checked:
        _checked = True
        path = os.environ.get(ENV)
        if path and Path(path).exists():
            _writer = _Writer(path)
    if _writer is None:
        return
    _writer.samples += samples
    _writer.busy_s += busy_s
    _LAYOUT.pack_into(_writer.map, 0, int(step), _writer.samples, time.time(), _writer.busy_s)


def create(path: Path) -> None:
    """Agent side: a zeroed progress file for one worker."""
    path.write_bytes(b"\0" * _LAYOUT.size)


def read(path: Path) -> Progress | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _LAYOUT.size:
        return None
    step, samples, at, busy = _LAYOUT.unpack_from(data)
    return Progress(step, samples, at, busy) if at > 0 else None


def read_all(files: dict[int, Path]) -> dict[int, Progress]:
    """Each local rank's last report, of those that have reported."""
    out = {}
    for local_rank, path in dict(files).items():
        p = read(path)
        if p is not None:
            out[local_rank] = p
    return out


def silent(
    progress: dict[int, Progress], now: float, timeout_s: float
) -> tuple[int, Progress, float] | None:
    """(local rank, its last progress, seconds silent) of a rank with no step for longer
    than `timeout_s`, or None (pure: the caller gives `now`)."""
    for local_rank, p in sorted(progress.items()):
        if now - p.at > timeout_s:
            return local_rank, p, now - p.at
    return None
