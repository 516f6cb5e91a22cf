"""The envelope every event carries: the base classes of the catalogue.

`rove.control.catalogue.events` re-exports all of this; import from there. This module
exists so that parts of the catalogue kept in their own modules
(`rove.control.catalogue.scale_events`) can build on the bases without an import cycle.
"""

from __future__ import annotations

from typing import TypedDict

import msgspec


class Event(msgspec.Struct, tag_field="type", frozen=True, kw_only=True):
    """Fields every event carries."""

    job: str
    id: str
    producer: str
    ts: float


class Decision(Event, frozen=True, kw_only=True):
    """An event the leading master decided; `epoch` fences stale masters."""

    epoch: int


class NodeFact(Event, frozen=True, kw_only=True):
    """A fact an agent reports about its node; `incarnation` names the agent's run."""

    node: str
    incarnation: str


# --------------------------------------------------------------------------- envelopes


class Envelope(TypedDict):
    """The fields every event carries, built by `envelope` (a typed `**` for any event)."""

    job: str
    id: str
    producer: str
    ts: float


class DecisionEnvelope(Envelope):
    epoch: int


class NodeEnvelope(Envelope):
    node: str
    incarnation: str


def envelope(job: str, producer: str, ts: float, *id_parts: object) -> Envelope:
    """The common fields of an event whose deterministic id is made of the job and
    `id_parts` (the stream is shared by every job: ids must differ across jobs)."""
    return {"job": job, "id": make_id(job, *id_parts), "producer": producer, "ts": ts}


def decision_envelope(
    job: str, epoch: int, master: str, ts: float, *id_parts: object
) -> DecisionEnvelope:
    """The common fields of a master decision: its id names the job, the epoch and
    what it answers, so a repeat in the same epoch is deduplicated and a deposed
    master's copy is refused by the fence, never absorbed."""
    return {
        "job": job,
        "id": make_id(job, epoch, *id_parts),
        "producer": f"master:{master}",
        "ts": ts,
        "epoch": epoch,
    }


def node_envelope(
    job: str, node: str, incarnation: str, ts: float, *id_parts: object
) -> NodeEnvelope:
    """The common fields of an agent's fact: its id names the node and its incarnation."""
    return {
        "job": job,
        "id": make_id(node, incarnation, *id_parts),
        "producer": f"agent:{node}",
        "ts": ts,
        "node": node,
        "incarnation": incarnation,
    }


def make_id(*parts: object) -> str:
    """A deterministic event id from its identifying parts (used as `Nats-Msg-Id`)."""
    return ":".join(str(p) for p in parts)
