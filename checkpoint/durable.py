"""Writing checkpoint files so that a crash leaves either nothing or a whole file (no torch).

Every checkpoint rove persists follows one layout under its root:

    step-00000120/...      one directory per step
    committed              tracker: {"step": N, "job": J}, the newest committed step and
                           the job that committed it (no "job": written by a TensorFlow
                           job, or by rove before 2026-12-07)

A file is written under a temporary name, fsynced, then renamed over its final
name, and its directory is fsynced; the tracker is written the same way once a
step is complete. Torch flash checkpoints (`rove.checkpoint.storage`) and
TensorFlow checkpoints (`rove.checkpoint.tf`) share these pieces.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

#: A location with a scheme (`s3://`, `gs://`, `az://`, ...) names an object store; a
#: plain path (or `file://`) a directory.
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str) -> bool:
    """Whether `location` names an object store rather than a directory."""
    return bool(_URL.match(location)) and not location.startswith("file://")


class CheckpointError(RuntimeError):
    """Nothing valid to load, or a slot failed its checks (the message says which)."""


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_atomic(path: Path, chunks: Sequence[memoryview | bytes]) -> None:
    """Write `path` whole or not at all: a temporary file beside it, fsynced, renamed
    over it. The temporary name is this writer's own (a process id alone is not, on a
    file system several machines share: containers' processes have the same small ids,
    and the nodes of a job refresh one mark, `rove.checkpoint.writers`)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def steps(root: Path) -> list[int]:
    """The steps with a directory under `root`, oldest first."""
    found = []
    for path in root.glob("step-*"):
        with contextlib.suppress(ValueError):
            found.append(int(path.name.removeprefix("step-")))
    return sorted(found)


@dataclass(frozen=True)
class Tracker:
    """What the tracker says: the committed step, and the job that committed it."""

    step: int
    job: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"step": self.step, **({"job": self.job} if self.job else {})}).encode()

    @staticmethod
    def decode(raw: str | bytes | bytearray) -> Tracker | None:
        """None for a tracker no rove wrote (unreadable: as none)."""
        try:
            data = json.loads(raw)
            job = data.get("job")
            return Tracker(int(data["step"]), job if isinstance(job, str) else None)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def mark_committed(root: Path, step: int, job: str | None = None) -> None:
    """Make `step` the committed one (durably), committed by `job`."""
    write_atomic(root / "committed", [Tracker(step, job).encode()])
    fsync_dir(root)


def tracker(root: Path) -> Tracker | None:
    try:
        return Tracker.decode((root / "committed").read_bytes())
    except OSError:
        return None  # nothing committed yet


def committed(root: Path) -> int | None:
    found = tracker(root)
    return found.step if found else None
