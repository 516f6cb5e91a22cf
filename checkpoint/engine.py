"""The flash-checkpoint engine of one rank: save to shared memory, load it back.

    engine = FlashEngine(job="j1", rank=0)
    engine.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    step, state = engine.load()          # the newest complete, valid step

Two slots per rank: a save writes the slot that does not hold the newest
complete step, then marks it complete, so a crash in the middle of a save
always leaves the previous step intact. Saving blocks only for the copy into
memory (device-to-host for GPU tensors). `seal()` computes an xxh3 checksum of
a complete slot (the agent's saver does this off the training path, before it
persists); `load()` verifies it when present and refuses torn or corrupted
slots, falling back to the other one.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from rove.checkpoint import layout
from rove.checkpoint.durable import CheckpointError as CheckpointError
from rove.checkpoint.memcopy import copy_into
from rove.checkpoint.shm import (
    COMPLETE,
    EMPTY,
    HEADER_SIZE,
    WRITING,
    Header,
    Segment,
    ShmFullError,
    mib,
)
from rove.checkpoint.shm_owner import slot_path
from rove.control.process import logs
from rove.control.process.folders import rove_home

log = logs.get("rove.checkpoint")


@dataclass(frozen=True)
class SaveStats:
    step: int
    slot: int
    bytes: int
    blocking_s: float


@dataclass(frozen=True)
class SlotInfo:
    slot: int
    step: int
    sealed: bool


def default_dir() -> Path:
    return Path(os.environ.get("ROVE_SHM_DIR", "/dev/shm"))


#: what a spill costs, and what to do about it
SPILL_HINT = (
    "saves and restores go at the page cache's pace. To keep them in memory, enlarge it "
    "(docker --shm-size, a Kubernetes emptyDir with medium Memory and a sizeLimit) or "
    "point ROVE_SHM_DIR at a larger tmpfs"
)


def spill_dir() -> Path | None:
    """Where a slot goes when shared memory cannot hold it (`rove.checkpoint.shm`):
    `ROVE_SHM_SPILL_DIR`, else `spill/<host>` in rove's folder (`$ROVE_HOME`, else
    ~/.rove; the host's name, as a home folder may be shared by a cluster's machines,
    each reclaiming only its own); None (set empty): nowhere, a save that does not fit
    fails."""
    raw = os.environ.get("ROVE_SHM_SPILL_DIR")
    if raw is None:
        try:
            return rove_home() / "spill" / socket.gethostname()
        except RuntimeError:
            return None  # no ROVE_HOME and no home (a container's user without one)
    return Path(raw).expanduser().absolute() if raw else None


def namespace(job: str, run: str | None = None) -> str:
    """The name a job's slots go by: the job, and the run of it when known.

    `rove run` tells workers which run of the job this is (`ROVE_JOB_RUN`, from
    the job's `job_configured` event), so a new job that reuses a name never
    loads the memory a killed earlier run left behind.
    """
    run = os.environ.get("ROVE_JOB_RUN", "") if run is None else run
    return f"{job}.{run}" if run else job


class FlashEngine:
    def __init__(
        self,
        job: str,
        rank: int,
        *,
        directory: Path | None = None,
        slots: int = 2,
        spill: Path | bool | None = True,
    ) -> None:
        """`spill`: where a slot goes when shared memory cannot hold it (True:
        `spill_dir()`; None or False: nowhere)."""
        self.directory = directory or default_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        where = spill_dir() if spill is True else spill or None
        self.segments = [
            Segment(slot_path(self.directory, job, rank, i), where) for i in range(slots)
        ]
        self._said_spill = False

    # ------------------------------------------------------------------ save

    def _target(self) -> int:
        """The slot to write: never the one holding the newest complete step."""
        newest = self.newest()
        if newest is None:
            return 0
        return (newest.slot + 1) % len(self.segments)

    def _open_slot(self, step: int, meta_len: int, data_len: int) -> tuple[int, Segment, int, int]:
        """The slot to write `step` into, sized and marked WRITING: (its index, its
        segment, the generation written, where its data starts)."""
        data_offset = layout.aligned(HEADER_SIZE + meta_len + 4096)
        index = self._target()
        seg = self.segments[index]
        try:
            seg.ensure(data_offset + data_len)
        except ShmFullError as exc:
            raise CheckpointError(exc.strerror) from exc
        if seg.spilled and not self._said_spill:
            self._said_spill = True
            # (under rove run its agent says it, once for the node's ranks: `rove.agent.saver`)
            say = log.info if os.environ.get("ROVE_NODE") else log.warning
            say(
                f"the checkpoint ({mib(data_offset + data_len)} a slot) does not fit in the "
                f"shared memory of {self.directory}; its slots spill to {seg.spill} on disk: "
                f"{SPILL_HINT}"
            )
        old = seg.header()
        generation = (old.generation if old else 0) + 1
        seg.write_header(Header(WRITING, generation, step, 0, 0, 0, 0, False))
        return index, seg, generation, data_offset

    def save(self, step: int, state: Any) -> SaveStats:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"a checkpoint step is a non-negative int, not {step!r}")
        import torch  # (here: the agent reads and persists slots without torch)

        started = time.perf_counter()
        p = layout.plan(step, state)
        meta = layout.encode_meta(p.meta)
        index, seg, generation, data_offset = self._open_slot(step, len(meta), p.meta.data_len)
        seg.view(HEADER_SIZE, len(meta))[:] = meta
        data = seg.view(data_offset, p.meta.data_len)
        for entry, src in zip(p.meta.tensors, p.sources, strict=True):
            if entry.nbytes == 0:
                continue
            dst = torch.frombuffer(data, dtype=src.dtype, count=src.numel(), offset=entry.offset)
            dst.view(src.shape).copy_(src)
        del data
        seg.write_header(
            Header(
                COMPLETE, generation + 1, step, len(meta), data_offset, p.meta.data_len, 0, False
            )
        )
        return SaveStats(step, index, p.meta.data_len, time.perf_counter() - started)

    def receive(
        self, step: int, meta_len: int, data_len: int
    ) -> tuple[memoryview, memoryview, Callable[[int], None]]:
        """A slot opened for `step` arriving from elsewhere (a peer's replica of this
        rank, its metadata then its data as storage holds them): the memory of its
        metadata and of its data to fill, and `seal(checksum)` to call once they are
        verified. Until sealed the slot holds no checkpoint: a restore never sees it."""
        _, seg, generation, data_offset = self._open_slot(step, meta_len, data_len)

        def seal(checksum: int) -> None:
            seg.write_header(
                Header(
                    COMPLETE, generation + 1, step, meta_len, data_offset, data_len, checksum, True
                )
            )

        return seg.view(HEADER_SIZE, meta_len), seg.view(data_offset, data_len), seal

    def install(
        self, step: int, raw: bytes | bytearray | memoryview, meta_len: int, checksum: int
    ) -> None:
        """Put a step another node held (verified by the caller) in a slot, as a save
        would have, sealed with its checksum: a restore from memory loads it, and checks
        it again."""
        if len(raw) < meta_len:
            raise CheckpointError(f"a replica of step {step} is shorter than its metadata")
        view = memoryview(raw)
        meta, data, seal = self.receive(step, meta_len, len(raw) - meta_len)
        copy_into(meta, view[:meta_len])
        copy_into(data, view[meta_len:])
        meta.release()
        data.release()
        seal(checksum)

    # ------------------------------------------------------------------ inspect

    def slots(self) -> list[SlotInfo]:
        """Complete slots, newest step first."""
        out = []
        for i, seg in enumerate(self.segments):
            seg.refresh()
            h = seg.header()
            if h is not None and h.state == COMPLETE:
                out.append(SlotInfo(i, h.step, h.sealed))
        return sorted(out, key=lambda s: -s.step)

    def slot_of(self, step: int) -> int | None:
        """The slot holding `step` complete (None: no slot does)."""
        return next((s.slot for s in self.slots() if s.step == step), None)

    def newest(self) -> SlotInfo | None:
        slots = self.slots()
        return slots[0] if slots else None

    def seal(self, slot: int) -> int:
        """Checksum a complete slot (off the training path) and record it in its header."""
        seg = self.segments[slot]
        h = seg.header()
        if h is None or h.state != COMPLETE:
            raise CheckpointError(f"slot {slot} holds no complete checkpoint to seal")
        digest = _digest(seg, h)
        after = seg.header()
        if after is None or after.generation != h.generation:
            raise CheckpointError(f"slot {slot} was overwritten while it was being sealed")
        # A save may begin right here, in the worker: the seal names its generation, so
        # it never applies to that save's bytes (rove.checkpoint.shm).
        seg.write_seal(h.generation, digest)
        return digest

    def discard_newer(self, step: int) -> list[int]:
        """Drop every complete slot of a step newer than `step`; returns the steps dropped.

        A job restored to `step` goes on on a new lineage: the newer steps of the old
        one must never be loaded (the new lineage will save steps of the same numbers).
        A slot is dropped by marking it EMPTY with a new generation, so a reader or a
        persist that was reading it sees it changed and refuses it.
        """
        dropped = []
        for seg in self.segments:
            seg.refresh()
            h = seg.header()
            if h is not None and h.state == COMPLETE and h.step > step:
                seg.write_header(Header(EMPTY, h.generation + 1, h.step, 0, 0, 0, 0, False))
                dropped.append(h.step)
        return dropped

    # ------------------------------------------------------------------ load

    def load(self, step: int | None = None, *, copy: bool = True) -> tuple[int, Any]:
        """The newest valid step (or exactly `step`): (step, state).

        With `copy=False` the tensors are views into shared memory, valid until
        this rank saves again: the fast path when they are copied right away
        into existing tensors (`model.load_state_dict(state)`).

        Raises:
            CheckpointError: no complete slot, or every candidate is torn or corrupted.
        """
        problems = []
        for info in self.slots():
            if step is not None and info.step != step:
                continue
            try:
                return info.step, self._read(info.slot, copy)
            except CheckpointError as exc:
                problems.append(str(exc))
        wanted = f"step {step}" if step is not None else "any step"
        detail = "; ".join(problems) or "no complete checkpoint in shared memory"
        raise CheckpointError(f"cannot load {wanted} from memory: {detail}")

    def _read(self, slot: int, copy: bool = True) -> Any:
        seg = self.segments[slot]
        h = seg.header()
        if h is None or h.state != COMPLETE:
            raise CheckpointError(f"slot {slot} is not complete")
        if h.sealed and _digest(seg, h) != h.checksum:
            raise CheckpointError(f"slot {slot} (step {h.step}) failed its checksum")
        meta = layout.decode_meta(bytes(seg.view(HEADER_SIZE, h.meta_len)))
        data = seg.view(h.data_offset, h.data_len)

        state = layout.rebuild(meta, lambda _i, e: layout.tensor_at(data, e, copy=copy))
        after = seg.header()
        if after is None or after.generation != h.generation or after.state != COMPLETE:
            raise CheckpointError(f"slot {slot} was overwritten while it was read")
        return state

    def close(self) -> None:
        for seg in self.segments:
            seg.close()

    def unlink(self) -> None:
        for seg in self.segments:
            seg.unlink()


def _digest(seg: Segment, h: Header) -> int:
    hasher = xxhash.xxh3_64()
    hasher.update(seg.view(HEADER_SIZE, h.meta_len))
    hasher.update(seg.view(h.data_offset, h.data_len))
    return int(hasher.intdigest())
