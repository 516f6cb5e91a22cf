"""Step progress from training processes to their agent, through a tiny shared file.

In the training script (a no-op when not run under `rove run`):

    from rove.agent.progress import report
    report(step, samples=batch_size)      # once per step
    report(step, samples=batch_size, busy_s=compute_seconds)   # also straggler detection

The agent gives each worker a file (`ROVE_PROGRESS_FILE`) holding the last
step, the samples seen so far, when the step ended, and the seconds of the
worker's own work so far (`busy_s`: the step's time outside collectives and
data waits, as the script measures it). It reads them for heartbeats (step,
throughput, busy time per step) and for hang detection: a worker alive but
without progress for `--hang-timeout` seconds is hung. The optimiser replaces
a node whose busy time per step is far above the others' (`docs/scaling.md`):
in synchronous training every rank steps at the slowest one's pace, so
throughput alone cannot name the straggler.

The same file keeps what `rove goodput` needs from inside the worker: the
first step of this process and when it ended, and the seconds it spent
blocked in checkpoint saves (`FlashCheckpointer.save` adds them), restoring
(`FlashCheckpointer.load`) and waiting for data (`report(..., data_s=)`, as
the script measures its wait for the next batch). One process writes each
file: the worker's main process (DataLoader workers never call these).
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

#: step, samples, unix time of the report, busy seconds (written with every report)
_STEP = struct.Struct("<qddd")
#: first step, when it ended, seconds blocked in checkpoint saves, waiting for data, restoring;
#: the step restored plus one (0: none, so that a zeroed file says none)
_EXTRA = struct.Struct("<qddddq")
#: when the worker's script returned successfully, and when the ending that follows
#: (threads joined, atexit handlers run) was over (0 until then): rove's script runner
_END = struct.Struct("<dd")
_END_AT = _STEP.size + _EXTRA.size
_LAYOUT_SIZE = _END_AT + _END.size
ENV = "ROVE_PROGRESS_FILE"
#: Called after each step reported (`rove.agent.imports`: a warm worker's imports settle)
on_step: Callable[[], None] | None = None


class Progress(NamedTuple):
    step: int
    samples: float
    at: float
    busy_s: float = 0.0
    first_step: int = 0
    first_at: float = 0.0
    ckpt_block_s: float = 0.0
    data_wait_s: float = 0.0
    restore_s: float = 0.0
    #: the step the worker restored (None: none, or its checkpointer does not say)
    restored_step: int | None = None


class _Writer:
    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, _LAYOUT_SIZE)
        finally:
            os.close(fd)
        self.samples = 0.0
        self.busy_s = 0.0
        self.first: tuple[int, float] = (0, 0.0)
        self.ckpt_block_s = 0.0
        self.data_wait_s = 0.0
        self.restore_s = 0.0
        self.restored_step: int | None = None

    def write_extra(self) -> None:
        _EXTRA.pack_into(
            self.map,
            _STEP.size,
            *self.first,
            self.ckpt_block_s,
            self.data_wait_s,
            self.restore_s,
            0 if self.restored_step is None else self.restored_step + 1,
        )


_writer: _Writer | None = None
_checked = False


def _get_writer() -> _Writer | None:
    global _writer, _checked
    if not _checked:
        _checked = True
        path = os.environ.get(ENV)
        if path and Path(path).exists():
            _writer = _Writer(path)
    return _writer


def report(step: int, samples: float = 0.0, busy_s: float = 0.0, data_s: float = 0.0) -> None:
    """Record that `step` finished after `samples` more samples, `busy_s` seconds of
    this worker's own work and `data_s` seconds waiting for its batch (cheap: one
    memory write)."""
    w = _get_writer()
    if w is None:
        return
    now = time.time()
    w.samples += samples
    w.busy_s += busy_s
    if not w.first[1] or data_s:
        if not w.first[1]:
            w.first = (int(step), now)
        w.data_wait_s += data_s
        w.write_extra()
    _STEP.pack_into(w.map, 0, int(step), w.samples, now, w.busy_s)
    if on_step is not None:
        on_step()


def checkpoint_blocked(seconds: float) -> None:
    """A checkpoint save held training for `seconds` (called by the checkpointers)."""
    w = _get_writer()
    if w is not None:
        w.ckpt_block_s += seconds
        w.write_extra()


def restored(seconds: float, step: int | None = None) -> None:
    """Restoring the training state (of `step`, when the checkpointer says it) took
    `seconds` (called by the checkpointers). The agent reports the step to the master,
    which learns so that the ranks fell back to an older step than the round named."""
    w = _get_writer()
    if w is not None:
        w.restore_s += seconds
        if step is not None:
            w.restored_step = int(step)
        w.write_extra()


def restored_step() -> int | None:
    """The step this worker's checkpointer said it restored (None: none said, or not
    under `rove run`): the data clients name it in their first request."""
    w = _get_writer()
    return w.restored_step if w is not None else None


def script_returned() -> None:
    """The worker's script returned (or exited with status 0): its work is done, what
    is left is the process's own ending (threads, atexit handlers). Written by rove's
    script runner, so the agent can tell a rank stuck on its way out from one at work."""
    w = _get_writer()
    if w is not None:
        _END.pack_into(w.map, _END_AT, time.time(), 0.0)


def script_ended() -> None:
    """After `script_returned`: the process's own ending is over too; what is left is
    waiting for the other local ranks (a warm worker) and exiting."""
    w = _get_writer()
    if w is not None:
        returned, _ = _END.unpack_from(w.map, _END_AT)
        _END.pack_into(w.map, _END_AT, returned, time.time())


def create(path: Path) -> None:
    """Agent side: a zeroed progress file for one worker."""
    path.write_bytes(b"\0" * _LAYOUT_SIZE)


def read(path: Path) -> Progress | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _LAYOUT_SIZE:
        return None
    step, samples, at, busy = _STEP.unpack_from(data)
    if at <= 0:
        return None
    first, first_at, ckpt_block_s, data_wait_s, restore_s, restored_plus_one = _EXTRA.unpack_from(
        data, _STEP.size
    )
    return Progress(
        step,
        samples,
        at,
        busy,
        first,
        first_at,
        ckpt_block_s,
        data_wait_s,
        restore_s,
        restored_plus_one - 1 if restored_plus_one > 0 else None,
    )


def ending(path: Path) -> tuple[float, float]:
    """(when the worker's script returned successfully, when its ending was over);
    0.0 for what has not happened (or without a file)."""
    try:
        data = path.read_bytes()
    except OSError:
        return 0.0, 0.0
    if len(data) < _LAYOUT_SIZE:
        return 0.0, 0.0
    returned, ended = _END.unpack_from(data, _END_AT)
    return float(returned), float(ended)


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
