"""Master snapshots: the folded state with the last applied stream sequence.

The newest snapshot of a job is the last message on `rove.snap.<job>` (a
rollup keeps only that one). The state is compressed (zlib, level 1: a 25,000-node
state of 11.7 MB becomes 0.84 MB in 35 ms and comes back in 25 ms; fetching it whole
from the object store took 0.9 s of a restarted master's 1.2 s). Snapshots still
larger than the inline limit (128 KiB) go to the object store, which stores them in
chunks of 128 KiB, and the message holds a pointer: no message grows with the job.
Each new snapshot deletes the object of the one before it (a reader that fetched the
old pointer just then reads the pointer again). A snapshot that fails to decode is
logged and ignored: the master replays the whole stream instead. Any master may
write one: a snapshot is a fold of a stream prefix, the same whoever folded it.

The master's goodput ledger (`rove.control.domain.goodput.Ledger`, a fold of the same
prefix) follows the state in the same compressed bytes (`goodput_size` of them), so a
master restarted or taking over goes on with the job's whole goodput, not the part
since its snapshot. A ledger that cannot be read is said and dropped; the state is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from typing import NamedTuple

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import Header

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.domain import goodput as gp
from rove.control.master.state import JobState, decode_state, encode_state

log = structlog.get_logger("rove.snapshots")

#: Above this many bytes the state goes to the object store, in chunks of as many.
INLINE_LIMIT = 128 * 1024
FORMAT = 1


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    format: int = FORMAT
    job: str
    applied_seq: int
    epoch: int
    master: str
    ts: float
    size: int
    state: bytes | None = None
    object_name: str | None = None
    #: "zlib", or "" for a state stored as it was encoded (snapshots before it)
    compression: str = ""
    #: bytes of the goodput ledger after the state's `size` (0: none, as before it)
    goodput_size: int = 0


class Loaded(NamedTuple):
    """A snapshot read back: the state, and the goodput ledger of the same events
    (None: the snapshot has none, or it could not be read)."""

    state: JobState
    goodput: gp.Ledger | None = None


#: A job of N nodes is snapshotted at most every N / this many events (and at least
#: every `--snapshot-every`): at 25,000 nodes, every 5,000 events.
NODE_SHARE = 5


def due(behind: int, nodes: int, since_s: float, *, every_events: int, every_s: float) -> bool:
    """Whether a leader `behind` events and `since_s` seconds after its last snapshot
    writes one now. A snapshot costs what the state holds (about its `nodes`: 0.15 s
    at 25,000): taken at most once per a fifth as many events, it costs each event
    O(1) however large the job, and a master restarted replays at most that many."""
    if behind <= 0:
        return False
    return behind >= max(every_events, nodes // NODE_SHARE) or since_s >= every_s


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Snapshot)


def _pack(state: JobState, goodput: bytes) -> tuple[int, bytes]:
    data = encode_state(state)
    z = zlib.compressobj(1)
    return len(data), z.compress(data) + z.compress(goodput) + z.flush()


async def save(
    bus: Bus, state: JobState, *, master: str, now: float, goodput: gp.Ledger | None = None
) -> Snapshot:
    """Write `state` (and `goodput`, the ledger folded from the same events) as the
    job's newest snapshot."""
    # the ledger changes with every event: encoded here, before the loop moves on
    ledger = gp.encode(goodput) if goodput is not None else b""
    # (a thread: zlib lets go of the GIL, so the lease renewal and the feeds go on)
    size, data = await asyncio.to_thread(_pack, state, ledger)
    snap = Snapshot(
        job=state.job,
        applied_seq=state.applied_seq,
        epoch=state.epoch,
        master=master,
        ts=now,
        size=size,
        compression="zlib",
        goodput_size=len(ledger),
    )
    previous = await _pointer(bus, state.job)
    if len(data) <= INLINE_LIMIT:
        snap = msgspec.structs.replace(snap, state=data)
    else:
        obs = await bus.js.create_object_store(subjects.SNAPSHOT_OBJECTS)
        name = f"{state.job}/{state.applied_seq}"
        await obs.put(name, data)  # in chunks of 128 KiB (nats-py's default)
        snap = msgspec.structs.replace(snap, object_name=name)
    await bus.publish_raw(
        subjects.snapshot(state.job),
        _enc.encode(snap),
        {Header.ROLLUP.value: "sub"},
        deadline_s=10.0,
    )
    old = previous.object_name if previous is not None else None
    if old is not None and old != snap.object_name:
        with contextlib.suppress(nats.js.errors.NotFoundError):
            obs = await bus.js.object_store(subjects.SNAPSHOT_OBJECTS)
            await obs.delete(old)
    log.debug(
        "snapshot written",
        job=state.job,
        applied_seq=state.applied_seq,
        bytes=size,
        compressed=len(data),
    )
    return snap


async def _pointer(bus: Bus, job: str) -> Snapshot | None:
    """The newest snapshot message of `job` (its state or its pointer), or None."""
    try:
        msg = await bus.js.get_last_msg(
            subjects.SNAPSHOT_STREAM, subjects.snapshot(job), direct=True
        )
        return _dec.decode(msg.data or b"")
    except (nats.js.errors.NotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None


async def load(bus: Bus, job: str) -> Loaded | None:
    """The newest valid snapshot of `job`, or None (no snapshot, or a bad one)."""
    for attempt in (1, 2):
        try:
            return await _load(bus, job)
        except _Replaced:
            if attempt == 2:
                break  # replaced twice while being read: replay instead
    return None


class _Replaced(Exception):
    """The object a pointer named was deleted: a newer snapshot replaced it."""


async def _load(bus: Bus, job: str) -> Loaded | None:
    try:
        msg = await bus.js.get_last_msg(
            subjects.SNAPSHOT_STREAM, subjects.snapshot(job), direct=True
        )
    except nats.js.errors.NotFoundError:
        return None
    try:
        snap = _dec.decode(msg.data or b"")
        if snap.state is not None:
            data = snap.state
        elif snap.object_name is not None:
            obs = await bus.js.object_store(subjects.SNAPSHOT_OBJECTS)
            try:
                data = (await obs.get(snap.object_name)).data or b""
            except nats.js.errors.ObjectNotFoundError:
                if await _pointer(bus, job) != snap:
                    raise _Replaced() from None
                raise
        else:
            raise msgspec.ValidationError("snapshot holds neither state nor a pointer")
        if snap.compression == "zlib":
            data = zlib.decompress(data)
        elif snap.compression:
            raise msgspec.ValidationError(f"unknown compression {snap.compression!r}")
        view = memoryview(data)
        state = decode_state(view[: snap.size] if snap.goodput_size else data)
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        nats.js.errors.NotFoundError,
        zlib.error,
    ) as exc:
        log.warning(
            "ignoring an unreadable snapshot; replaying the whole stream",
            job=job,
            seq=msg.seq,
            error=str(exc),
        )
        return None
    if state.job != job or state.applied_seq != snap.applied_seq:
        log.warning("ignoring a snapshot of another job or a torn one", job=job, seq=msg.seq)
        return None
    return Loaded(
        state, _ledger(view[snap.size : snap.size + snap.goodput_size], job, msg.seq or 0)
    )


def _ledger(data: memoryview, job: str, seq: int) -> gp.Ledger | None:
    """The goodput ledger a snapshot carries (None: none, or one that cannot be read:
    said, and goodput then covers the events since the snapshot)."""
    if not data:
        return None
    try:
        return gp.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning(
            "the snapshot's goodput ledger cannot be read; goodput starts from the snapshot",
            job=job,
            seq=seq,
            error=str(exc),
        )
        return None
