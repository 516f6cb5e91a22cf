"""Persistent checkpoint storage: where the agent's saver writes complete slots.

`Storage` is the port; `FileStorage` implements it on a local or shared
filesystem path, `rove.checkpoint.object_store.ObjectStorage` in an object store
(S3, GCS, Azure). `rove.checkpoint.stores.open_storage` picks one from the location a
user gives (`--checkpoint-dir`, `ROVE_CKPT_DIR`).

Layout under the root:

    step-00000120/rank-00003.ckpt        the slot's description and tensor bytes
    step-00000120/rank-00003.json        manifest: sizes and the xxh3 checksum
    committed                            tracker: the newest committed step
    writers/JOB.json                     a running job's mark (`rove.checkpoint.writers`)

A rank's files are written under a temporary name, fsynced, then renamed, so a
reader sees either nothing or a whole file. A step is *committed* only when the
caller (the master's `ckpt_committed` decision, through an agent) says every
rank has persisted it; nothing half-written is ever marked committed.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from rove.checkpoint import durable, layout
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.memcopy import copy_into
from rove.checkpoint.shm import COMPLETE, HEADER_SIZE, Header, Segment

#: The folder (or prefix) of the marks of the jobs writing a location.
WRITERS = "writers"


def mark_name(job: str) -> str:
    """Where `job`'s mark is under a location (`rove.checkpoint.writers`)."""
    return f"{WRITERS}/{job}.json"


class StorageError(CheckpointError):
    """Persisting failed (disk full, unwritable path); the message says what to do."""


class SlotOverwritten(CheckpointError):
    """The workers saved a newer step into the slot while it was being persisted (they
    save faster than storage takes it): that step is not persisted, a newer one will be."""


def overwritten(step: int, rank: int) -> str:
    return f"step {step} of rank {rank} was overwritten while it was persisted"


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    step: int
    rank: int
    meta_len: int
    data_len: int
    checksum: int


def to_persist(engine: FlashEngine, slot: int, rank: int) -> tuple[Segment, Header, Manifest]:
    """The slot's segment, its header as it is now and the manifest of its complete
    checkpoint (sealed first if it was not): what every storage persists."""
    seg = engine.segments[slot]
    h = seg.header()
    if h is None or h.state != COMPLETE:
        raise CheckpointError(f"slot {slot} holds no complete checkpoint to persist")
    checksum = h.checksum if h.sealed else engine.seal(slot)
    manifest = Manifest(
        step=h.step, rank=rank, meta_len=h.meta_len, data_len=h.data_len, checksum=checksum
    )
    return seg, h, manifest


def copy_out(
    engine: FlashEngine, slot: int, rank: int, into: bytearray | None = None
) -> tuple[Manifest, bytearray]:
    """The slot's complete checkpoint copied out of shared memory (its metadata then its
    data, as storage holds them) with its manifest: a copy a newer save cannot tear.
    `into`: a buffer to reuse when it has the size (a fresh one of 1 GiB costs about a
    second of page faults here).

    Raises:
        SlotOverwritten: a save took the slot while it was copied.
        CheckpointError: the slot holds no complete checkpoint.
    """
    seg, h, manifest = to_persist(engine, slot, rank)
    size = h.meta_len + h.data_len
    raw = into if into is not None and len(into) == size else bytearray(size)
    out = memoryview(raw)
    copy_into(out[: h.meta_len], seg.view(HEADER_SIZE, h.meta_len))
    copy_into(out[h.meta_len :], seg.view(h.data_offset, h.data_len))
    out.release()
    after = seg.header()
    if after is None or after.generation != h.generation:
        raise SlotOverwritten(f"slot {slot} was overwritten while it was copied")
    return manifest, raw


def rebuild_verified(raw: bytearray, manifest: Manifest, step: int, rank: int, what: str) -> Any:
    """The state in `raw` (a persisted rank's bytes, writable: tensors view it), once
    its size and checksum match `manifest`; `what` names it in the error ("file")."""
    if len(raw) != manifest.meta_len + manifest.data_len:
        raise CheckpointError(f"step {step} rank {rank}: the {what} is truncated")
    if xxhash.xxh3_64_intdigest(raw) != manifest.checksum:
        raise CheckpointError(f"step {step} rank {rank}: the {what} failed its checksum")
    meta = layout.decode_meta(bytes(raw[: manifest.meta_len]))
    data = memoryview(raw)[manifest.meta_len :]
    return layout.rebuild(meta, lambda _i, e: layout.tensor_at(data, e))


class Storage(abc.ABC):
    """Where checkpoints are persisted.

    `persist` writes one rank's complete slot; `commit` marks a step whose every
    rank has been persisted; `load` reads one rank's state of a step back,
    verifying it. Implementations never expose a partially written rank file.
    """

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the checkpoints are, as the user gave it (a path or a URL)."""

    def persist(self, engine: FlashEngine, slot: int, rank: int) -> Manifest:
        """Persist a complete slot, straight from shared memory.

        Raises:
            StorageError: the write failed; nothing of it is left behind.
            SlotOverwritten: a newer save took the slot meanwhile; nothing is left.
            CheckpointError: the slot is not complete.
        """
        seg, h, manifest = to_persist(engine, slot, rank)

        def torn() -> bool:
            after = seg.header()
            return after is None or after.generation != h.generation

        parts = [seg.view(HEADER_SIZE, h.meta_len), seg.view(h.data_offset, h.data_len)]
        self.write(manifest, parts, torn)
        return manifest

    def persist_copy(self, manifest: Manifest, raw: bytearray) -> Manifest:
        """Persist a rank's bytes copied out of shared memory (`copy_out`): no save can
        tear them, however long storage takes.

        Raises:
            StorageError: the write failed; nothing of it is left behind.
        """
        self.write(manifest, [memoryview(raw)], lambda: False)
        return manifest

    @abc.abstractmethod
    def write(self, manifest: Manifest, parts: list[memoryview], torn: Callable[[], bool]) -> None:
        """Write a rank's bytes (`parts`, its metadata then data), then its manifest. If
        `torn()` says, once the bytes are written, that their source changed meanwhile,
        delete them and raise `SlotOverwritten`: no manifest ever names a torn file."""

    @abc.abstractmethod
    def persisted_ranks(self, step: int) -> set[int]: ...

    @abc.abstractmethod
    def steps(self) -> list[int]:
        """Steps with at least one rank persisted, oldest first."""

    @abc.abstractmethod
    def commit(self, step: int, keep: int, job: str | None = None) -> None:
        """Record `step` as committed (by `job`) and drop all but the `keep` newest
        committed steps."""

    @abc.abstractmethod
    def tracker(self) -> durable.Tracker | None:
        """The committed step and the job that committed it (None: nothing committed)."""

    def committed(self) -> int | None:
        found = self.tracker()
        return found.step if found else None

    @abc.abstractmethod
    def discard_newer(self, step: int) -> list[int]:
        """Remove every persisted step newer than `step` (all ranks); returns them.

        Called when a job is restored to `step`: the newer steps belong to a lineage
        that was abandoned, and the new lineage will persist steps of the same numbers.
        """

    @abc.abstractmethod
    def load(self, step: int, rank: int) -> Any:
        """Raises CheckpointError when the files are missing, torn or corrupted."""

    # -- the marks of the jobs writing here (`rove.checkpoint.writers`) -------------------

    @abc.abstractmethod
    def put_mark(self, job: str, raw: bytes) -> None:
        """Write `job`'s mark (whole or not at all). Raises StorageError."""

    @abc.abstractmethod
    def marks(self) -> list[bytes]:
        """Every job's mark as written. Raises StorageError."""

    @abc.abstractmethod
    def drop_mark(self, job: str) -> None:
        """Remove `job`'s mark (none: nothing). Raises StorageError."""


class FileStorage(Storage):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @property
    def location(self) -> str:
        return str(self.root)

    def _step_dir(self, step: int) -> Path:
        return durable.step_dir(self.root, step)

    def write(self, manifest: Manifest, parts: list[memoryview], torn: Callable[[], bool]) -> None:
        step, rank = manifest.step, manifest.rank
        directory = self._step_dir(step)
        data = self.root / directory.name / f"rank-{rank:05d}.ckpt"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            durable.write_atomic(data, parts)
            if torn():
                # the file may hold a mix of two steps: no manifest names it, and it goes
                data.unlink(missing_ok=True)
                raise SlotOverwritten(overwritten(step, rank))
            durable.write_atomic(
                directory / f"rank-{rank:05d}.json", [msgspec.json.encode(manifest)]
            )
            durable.fsync_dir(directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                data.unlink(missing_ok=True)
            reason = {
                errno.ENOSPC: "the disk is full",
                errno.EFBIG: "the file is too large",
                errno.EROFS: "the file system is read-only",
                errno.EACCES: "permission denied",
            }.get(exc.errno or 0, str(exc))
            raise StorageError(
                f"could not persist step {step} of rank {rank} to {self.root}: {reason}; "
                "training goes on with in-memory checkpoints; free space or fix the path"
            ) from exc

    def persisted_ranks(self, step: int) -> set[int]:
        directory = self._step_dir(step)
        if not directory.is_dir():
            return set()
        ranks = set()
        for manifest in directory.glob("rank-*.json"):
            ckpt = manifest.with_suffix(".ckpt")
            if ckpt.exists():
                ranks.add(int(manifest.stem.removeprefix("rank-")))
        return ranks

    def steps(self) -> list[int]:
        return durable.steps(self.root)

    def commit(self, step: int, keep: int, job: str | None = None) -> None:
        if not self._step_dir(step).is_dir():
            raise CheckpointError(f"step {step} was never persisted; it cannot be committed")
        try:
            durable.mark_committed(self.root, step, job)
        except OSError as exc:
            raise StorageError(
                f"could not mark step {step} committed in {self.root}: {exc}"
            ) from exc
        committed_or_older = [s for s in self.steps() if s <= step]
        for old in committed_or_older[: max(0, len(committed_or_older) - keep)]:
            shutil.rmtree(self._step_dir(old), ignore_errors=True)

    def discard_newer(self, step: int) -> list[int]:
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            shutil.rmtree(self._step_dir(s), ignore_errors=True)
        return newer

    def tracker(self) -> durable.Tracker | None:
        return durable.tracker(self.root)

    def load(self, step: int, rank: int) -> Any:
        directory = self._step_dir(step)
        try:
            manifest = msgspec.json.decode(
                (directory / f"rank-{rank:05d}.json").read_bytes(), type=Manifest
            )
            path = directory / f"rank-{rank:05d}.ckpt"
            raw = bytearray(path.stat().st_size)  # writable: tensors can view it
            with open(path, "rb") as f:
                f.readinto(raw)
        except FileNotFoundError as exc:
            raise CheckpointError(f"step {step} of rank {rank} is not in {self.root}") from exc
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"the manifest of step {step} rank {rank} is unreadable") from exc
        return rebuild_verified(raw, manifest, step, rank, "file")

    def put_mark(self, job: str, raw: bytes) -> None:
        try:
            (self.root / WRITERS).mkdir(parents=True, exist_ok=True)
            durable.write_atomic(self.root / mark_name(job), [raw])
        except OSError as exc:
            raise StorageError(f"could not mark {self.root} as job {job}'s: {exc}") from exc

    def marks(self) -> list[bytes]:
        found = []
        try:
            for path in sorted((self.root / WRITERS).glob("*.json")):
                with contextlib.suppress(FileNotFoundError):  # (removed as it was listed)
                    found.append(path.read_bytes())
        except OSError as exc:
            raise StorageError(f"could not read the jobs' marks in {self.root}: {exc}") from exc
        return found

    def drop_mark(self, job: str) -> None:
        try:
            (self.root / mark_name(job)).unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"could not remove job {job}'s mark in {self.root}: {exc}") from exc
