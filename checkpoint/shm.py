"""Checkpoint slots in shared memory (files in /dev/shm, mapped into memory).

A slot is one file: a 4 KiB header, the msgpack `Meta`, then the tensor bytes
at an aligned offset. Files outlive the process that wrote them (until the
agent removes them), which is what lets a restarted worker load its state
from memory. A segment is allocated once, pre-touched (the first write to a
fresh page costs a page fault, ~6x a plain copy), and reused by every later
save; it is only re-allocated when the state grows.

Header (little endian): magic, version, state, generation, step, meta_len,
data_offset, data_len, checksum, sealed, and the generation the seal is for. A
writer sets `state=WRITING` and bumps `generation` before it copies, and
`state=COMPLETE` after; a reader accepts a slot only if it is COMPLETE with the
same generation before and after it reads, so a save that died half-way (kill -9)
is never loaded.

The checksum is written by another process than the slot's writer (the agent
seals what the worker saved), while the worker may start its next save into the
same slot at any moment. Sealing therefore writes only the checksum fields, never
the whole header, and names the generation it checked: a seal is in force only
while the slot's generation is that one. A seal that lands after a newer save
began (or ended) names an older generation and is ignored, so it can never mark
a newer step's bytes with an older step's checksum.

A slot that does not fit in shared memory (a container's /dev/shm is 64 MiB unless
told otherwise) spills to disk when the engine names a spill folder: its file is made
there, under the slot's name, and the slot's name in shared memory becomes a symbolic
link to it. Every reader opens the slot by its name, so the agent's persist, a restore
and a peer's copy read a spilled slot as any other; saves go through the page cache,
and the kernel writes the pages to disk behind them. `remove` takes a link and its
file together.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from rove.checkpoint.durable import CheckpointError
from rove.checkpoint.memcopy import zero
from rove.control.process import logs

MAGIC = b"ROVECKPT"
VERSION = 1
HEADER_SIZE = 4096
_HEADER = struct.Struct("<8sIIQqQQQQIQ")
#: the checksum, sealed, and the generation sealed: the tail of the header a seal writes
_SEAL = struct.Struct("<QIQ")
_SEAL_AT = _HEADER.size - _SEAL.size

EMPTY, WRITING, COMPLETE = 0, 1, 2


#: what a full tmpfs (or a quota on it) answers a reservation: a slot may spill to disk
_NO_ROOM = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT})


class ShmFullError(OSError):
    """A checkpoint slot does not fit in shared memory (nor on the disk it may spill
    to); the message says what to do."""

    def __init__(
        self, directory: Path, size: int, cause: OSError, spill: tuple[Path, OSError] | None = None
    ) -> None:
        room = ""
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(directory)
            room = f"; {mib(usage.free)} free of {mib(usage.total)}"
        spilled = ""
        if spill is not None:
            spilled = f", nor spill it to {spill[0]} on disk ({spill[1].strerror or spill[1]})"
        super().__init__(
            cause.errno,
            f"cannot reserve {mib(size)} of shared memory in {directory} for a checkpoint "
            f"slot ({cause.strerror}{room}; each rank keeps two slots of its state){spilled}: "
            "enlarge it (docker --shm-size, a Kubernetes emptyDir with medium Memory and a "
            "sizeLimit) or point ROVE_SHM_DIR at a larger tmpfs; the previous checkpoint is "
            "intact",
        )


def mib(n: int) -> str:
    """A size as the checkpoint's lines say it: MiB, or KiB under one MiB."""
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def remove(path: Path) -> int:
    """Remove the slot file `path`, and the file on disk it links to when it spilled;
    the bytes they held. A link to anything but a slot's spilled file (its name is the
    slot's) is removed alone."""
    size = 0
    with contextlib.suppress(OSError):
        size = path.stat().st_size
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.name == path.name:
            target.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return size


@dataclass(frozen=True)
class Header:
    state: int
    generation: int
    step: int
    meta_len: int
    data_offset: int
    data_len: int
    checksum: int
    sealed: bool


class Segment:
    """One slot's file in shared memory, mapped read-write."""

    def __init__(self, path: Path, spill: Path | None = None) -> None:
        self.path = path
        #: where the slot's file goes when shared memory cannot hold it (None: nowhere)
        self.spill = spill
        #: whether the file mapped now is on disk (`spill`), not in shared memory
        self.spilled = False
        self.map: mmap.mmap | None = None
        self.size = 0
        #: (device, inode) of the file mapped now: a writer that outgrows a slot replaces
        #: its file, and every other process's mapping must follow (`refresh`)
        self.identity: tuple[int, int] | None = None
        if path.exists():
            self._open()

    def _open(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            if self.path.is_symlink():
                _unseen(self.path)
            return  # removed meanwhile (the job's memory freed): nothing to map
        try:
            st = os.fstat(fd)
            self.size = st.st_size
            self.identity = (st.st_dev, st.st_ino)
            self.spilled = self.path.is_symlink()
            self.map = mmap.mmap(fd, self.size) if self.size else None
        finally:
            os.close(fd)

    def refresh(self) -> None:
        """Map the slot's file as it is now. A writer whose state outgrew the slot
        replaced the file (`ensure`); a reader that kept its old mapping would see the old
        steps only, forever. One `stat` when nothing changed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            if self.map is not None:
                self.close()
            return
        if self.map is None or (st.st_dev, st.st_ino) != self.identity or st.st_size != self.size:
            self.close()
            self._open()

    def ensure(self, size: int) -> None:
        """At least `size` bytes, pre-touched; an old, smaller segment is replaced. In
        shared memory, else (no room there) spilled to disk when the segment has a
        `spill` folder.

        Raises:
            ShmFullError: neither has room; the slot's file is as it was.
        """
        if self.map is not None and self.size >= size:
            return
        self.close()
        size = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
        before = Path(os.path.realpath(self.path)) if self.path.is_symlink() else None
        try:
            tmp, new = _reserve(self.path.parent, self.path.name, size)
            spilled = False
        except OSError as exc:
            if self.spill is None or exc.errno not in _NO_ROOM:
                raise ShmFullError(self.path.parent, size, exc) from exc
            try:
                self.spill.mkdir(parents=True, exist_ok=True)
                tmp, new = _reserve(self.spill, self.path.name, size)
            except OSError as spill_exc:
                raise ShmFullError(
                    self.path.parent, size, exc, (self.spill, spill_exc)
                ) from spill_exc
            spilled = True
        zero(new)  # touch every page now, not in a save
        if spilled:
            # the file under the slot's name on disk, then the slot's name a link to it
            # (each a rename: a reader finds the old slot or the new, never neither)
            target = tmp.with_name(self.path.name)
            tmp.replace(target)
            link = self.path.with_name(self.path.name + ".link")
            link.unlink(missing_ok=True)
            link.symlink_to(target)
            link.replace(self.path)
        else:
            tmp.replace(self.path)
            target = self.path
        if before is not None and before != target and before.name == self.path.name:
            before.unlink(missing_ok=True)  # it spilled before; now elsewhere
        st = self.path.stat()
        self.map, self.size, self.identity = new, size, (st.st_dev, st.st_ino)
        self.spilled = spilled

    def header(self) -> Header | None:
        if self.map is None or self.size < HEADER_SIZE:
            return None
        (
            magic,
            version,
            state,
            gen,
            step,
            meta_len,
            data_off,
            data_len,
            checksum,
            sealed,
            sealed_gen,
        ) = _HEADER.unpack_from(self.map, 0)
        if magic != MAGIC or version != VERSION:
            return None
        in_force = bool(sealed) and sealed_gen == gen
        return Header(state, gen, step, meta_len, data_off, data_len, checksum, in_force)

    def write_header(self, h: Header) -> None:
        assert self.map is not None
        _HEADER.pack_into(
            self.map,
            0,
            MAGIC,
            VERSION,
            h.state,
            h.generation,
            h.step,
            h.meta_len,
            h.data_offset,
            h.data_len,
            h.checksum,
            int(h.sealed),
            h.generation if h.sealed else 0,
        )

    def write_seal(self, generation: int, checksum: int) -> None:
        """Record `checksum` as the slot's for `generation` only: the rest of the header
        (a save's) is left as it is, and the seal counts only while the slot's generation
        is still `generation` (see the module's docstring)."""
        assert self.map is not None
        _SEAL.pack_into(self.map, _SEAL_AT, checksum, 1, generation)

    def view(self, offset: int, length: int) -> memoryview:
        """`length` bytes at `offset`. A header that points past the mapping comes from a
        newer, larger file than the one mapped (`refresh` was not called): refused, never
        a short view that would persist or load a cut state."""
        assert self.map is not None
        if offset + length > self.size:
            raise CheckpointError(
                f"{self.path.name}: bytes {offset}-{offset + length} lie past the "
                f"{self.size} bytes mapped (the slot was replaced)"
            )
        return memoryview(self.map)[offset : offset + length]

    def close(self) -> None:
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:
                pass  # a tensor still views it; the mapping goes with that tensor
            self.map = None
            self.size = 0
            self.identity = None

    def unlink(self) -> None:
        self.close()
        remove(self.path)


def _reserve(folder: Path, name: str, size: int) -> tuple[Path, mmap.mmap]:
    """A new file for slot `name` in `folder` (`name.new`), `size` bytes, its pages
    reserved and mapped. Reserving them now makes a full tmpfs (or disk) fail here with
    ENOSPC, where touching the pages of a sparse mapping would kill the process with
    SIGBUS."""
    tmp = folder / f"{name}.new"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return tmp, mmap.mmap(fd, size)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


_UNSEEN: set[Path] = set()


def _unseen(path: Path) -> None:
    """Said once per slot: it spilled to a disk this process cannot see (the agent and
    the workers must share a filesystem, as they do under `rove run`)."""
    if path not in _UNSEEN:
        _UNSEEN.add(path)
        try:
            where = path.readlink()
        except OSError:
            return  # removed meanwhile
        logs.get("rove.checkpoint").warning(
            f"checkpoint slot {path} spilled to {where}, which this process "
            "cannot open: its steps cannot be persisted or restored from here; give the "
            "workers enough shared memory, or a ROVE_SHM_SPILL_DIR both can read"
        )
