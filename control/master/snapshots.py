"""Master snapshots: the folded state with the last applied stream sequence.

The newest snapshot of a job is the last message on `rove.snap.<job>` (a
rollup keeps only that one). Snapshots larger than the inline limit go to the
object store and the message holds a pointer. A snapshot that fails to
decode is logged and ignored: the master replays the whole stream instead.
Any master may write one: a snapshot is a fold of a stream prefix, which is
the same whoever folded it.
"""

from __future__ import annotations

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import Header

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.master.state import JobState, decode_state, encode_state

log = structlog.get_logger("rove.snapshots")

#: Above this many bytes the state goes to the object store (NATS max_payload is 1 MiB).
INLINE_LIMIT = 512 * 1024
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


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Snapshot)


async def save(bus: Bus, state: JobState, *, master: str, now: float) -> Snapshot:
    data = encode_state(state)
    snap = Snapshot(
        job=state.job,
        applied_seq=state.applied_seq,
        epoch=state.epoch,
        master=master,
        ts=now,
        size=len(data),
    )
    if len(data) <= INLINE_LIMIT:
        snap = msgspec.structs.replace(snap, state=data)
    else:
        obs = await bus.js.create_object_store(subjects.SNAPSHOT_OBJECTS)
        name = f"{state.job}/{state.applied_seq}"
        await obs.put(name, data)
        snap = msgspec.structs.replace(snap, object_name=name)
    await bus.publish_raw(
        subjects.snapshot(state.job),
        _enc.encode(snap),
        {Header.ROLLUP.value: "sub"},
        deadline_s=10.0,
    )
    log.debug("snapshot written", job=state.job, applied_seq=state.applied_seq, bytes=len(data))
    return snap


async def load(bus: Bus, job: str) -> JobState | None:
    """The newest valid snapshot of `job`, or None (no snapshot, or a bad one)."""
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
            data = (await obs.get(snap.object_name)).data or b""
        else:
            raise msgspec.ValidationError("snapshot holds neither state nor a pointer")
        state = decode_state(data)
    except (msgspec.DecodeError, msgspec.ValidationError, nats.js.errors.NotFoundError) as exc:
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
    return state
