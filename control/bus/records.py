"""Reading stored messages: decode, validate, or turn into a dead letter.

`read(...)` never raises. A payload that is not msgpack, is msgpack but not an
event of the catalogue, or is an event on the wrong subject becomes a
`Rejection`, which consumers log with its stream sequence and skip; the
leading master records it as an `event_rejected` dead letter.
"""

from __future__ import annotations

from typing import NamedTuple

import msgspec

from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import ConfigError, InvalidEventError


class Recorded(NamedTuple):
    """An event as stored: where, at which sequence, and what."""

    stream: str
    seq: int
    subject: str
    event: ev.AnyEvent
    #: when the server stored it, by the server's clock (Unix seconds; 0.0: not read:
    #: only a feed asked for it reads it, `Bus.subscribe`'s `stored_times`): unlike
    #: `event.ts`, not the publisher's clock
    stored: float = 0.0


class Rejection(NamedTuple):
    """A stored payload that is not a valid event for its subject."""

    stream: str
    seq: int
    subject: str
    error: str
    payload: bytes


def read(
    stream: str, seq: int, subject: str, payload: bytes, stored: float = 0.0
) -> Recorded | Rejection:
    try:
        event = ev.decode(payload)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: test it first
        return Rejection(stream, seq, subject, f"not a rove event: {exc}", payload)
    except msgspec.DecodeError as exc:
        return Rejection(stream, seq, subject, f"not msgpack: {exc}", payload)
    try:
        subjects.check_subject(event, subject)
    except InvalidEventError as exc:
        return Rejection(stream, seq, subject, str(exc), payload)
    return Recorded(stream, seq, subject, event, stored)


_heartbeat = msgspec.msgpack.Decoder(ev.Heartbeat)


def read_heartbeat(job: str, subject: str, payload: bytes) -> ev.Heartbeat | str:
    """A live heartbeat of `job` as `read` would take it, or why not (the leader's hot
    path: 25,000 a second at 25,000 nodes; `benchmarks/heartbeat_path.py`)."""
    try:
        hb = _heartbeat.decode(payload)
    except msgspec.ValidationError as exc:
        return f"not a rove heartbeat: {exc}"
    except msgspec.DecodeError as exc:
        return f"not msgpack: {exc}"
    try:
        expected = subjects.heartbeat(job, hb.node)
    except ConfigError as exc:
        return str(exc)
    if hb.job != job or subject != expected:
        return f"a heartbeat of job {hb.job} node {hb.node} arrived on {subject}"
    return hb


def job_of_subject(subject: str) -> str | None:
    """The job token of a `rove.ev.<job>...` / `rove.hb.<job>...` subject."""
    parts = subject.split(".")
    return parts[2] if len(parts) > 2 and parts[0] == "rove" else None


def dead_letter(
    job: str, rejections: list[Rejection], *, master: str, epoch: int, now: float
) -> ev.EventRejected:
    """The `event_rejected` decision recording a burst of `rejections` on one subject
    (in stream order): one dead letter with their count, the first one's error and head.
    Its id names the first one's sequence, whichever master records it."""
    first, last = rejections[0], rejections[-1]
    return ev.EventRejected(
        **ev.envelope(job, f"master:{master}", now, "rejected", first.stream, first.seq),
        epoch=epoch,
        stream=first.stream,
        stream_seq=first.seq,
        subject=first.subject,
        error=first.error[:1000],
        payload_size=len(first.payload),
        payload_head=first.payload[: ev.PAYLOAD_HEAD_BYTES],
        count=len(rejections),
        last_seq=last.seq,
    )
