"""Peer replicas of flash checkpoints: the bytes of a rank's step, held in a peer's memory.

A node's agent sends each rank's newest complete step to K peers' agents (what
`rove.agent.replicas` does); a peer keeps them here, in process memory, within a
budget. What travels is what storage would write: the slot's metadata and data
and its manifest (`rove.checkpoint.storage.to_persist`), so a replica is verified
the way a persisted file is, by its size and xxh3 checksum, before it counts.

The wire format, on a TCP connection between agents (one message each way):

- a request: 4 bytes of operation (`PUT1`, `GET1`), a 4-byte big-endian length, a
  JSON header (`Offer` for a put, `Want` for a get);
- an answer: a 4-byte length and a JSON `Answer`, then for a get the payload. To a put
  the peer answers before any byte of the rank travels (go ahead, refused with why, or
  held already); after a go-ahead the sender sends the payload, and the peer answers
  again once it verified and kept it.

Bulk bytes never go through JetStream; what a peer holds is said there by the agent
(`replica_stored`). This module is torch-free and knows nothing of the control plane.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import xxhash

from rove.checkpoint.durable import CheckpointError

T = TypeVar("T")
PUT = b"PUT1"
GET = b"GET1"
#: A header larger than this is not one of ours.
MAX_HEADER = 1 << 16
_LEN = struct.Struct(">I")


class Offer(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of `source`'s `step`, as sent: `ranks` are all the ranks `source` sends
    of that step (the step is complete at the peer once it holds every one)."""

    job: str
    source: str
    round: int
    step: int
    rank: int
    ranks: tuple[int, ...]
    meta_len: int
    data_len: int
    checksum: int
    #: the incarnation of `source`'s agent that sent it (it keeps its own copy)
    incarnation: str = ""

    @property
    def size(self) -> int:
        return self.meta_len + self.data_len


class Want(msgspec.Struct, frozen=True, kw_only=True):
    job: str
    source: str
    step: int
    rank: int


class Answer(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    error: str = ""
    offer: Offer | None = None
    #: to a put: the peer holds that rank of that step already (nothing more is sent)
    held: bool = False


def decode(body: bytes, kind: type[T]) -> T:
    """A header or an answer; CheckpointError if it is not one."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"an unreadable replica header: {exc}") from exc


def frame(op: bytes, header: msgspec.Struct) -> bytes:
    body = msgspec.json.encode(header)
    return op + _LEN.pack(len(body)) + body


def answer_frame(answer: Answer) -> bytes:
    body = msgspec.json.encode(answer)
    return _LEN.pack(len(body)) + body


def length(raw: bytes) -> int:
    """The length a 4-byte prefix says; CheckpointError if it is not a header's."""
    (n,) = _LEN.unpack(raw)
    if n > MAX_HEADER:
        raise CheckpointError(f"a replica header of {n} bytes: not a rove peer")
    return int(n)


Buffer = bytes | bytearray | memoryview


def verify(offer: Offer, *parts: Buffer) -> str:
    """'' when `parts`, one after the other, are the rank `offer` describes, else what
    is wrong with them (a rank may arrive in two places: a slot's metadata and data)."""
    size = sum(len(p) for p in parts)
    if size != offer.size:
        return f"{size} bytes arrived of {offer.size}"
    digest = xxhash.xxh3_64()
    for p in parts:
        digest.update(p)
    if digest.intdigest() != offer.checksum:
        return "the bytes failed their checksum (torn or corrupted in transit)"
    return ""


@dataclass
class _Source:
    #: step -> rank -> (offer, bytes)
    steps: dict[int, dict[int, tuple[Offer, bytearray]]] = field(default_factory=dict)
    #: the newest step held for every rank it was sent with (-1: none yet)
    complete: int = -1


class ReplicaStore:
    """What one agent holds for its peers: per source node, the newest step it holds
    complete, and at most one newer step arriving; never more than `budget` bytes."""

    def __init__(self, job: str, budget: int) -> None:
        self.job = job
        self.budget = budget
        self._sources: dict[str, _Source] = {}
        #: buffers of replicas dropped, kept for the next one of their size (a fresh
        #: 1 GiB buffer costs about a second of page faults here); within the budget
        self._spare: list[bytearray] = []
        #: the ids of buffers being sent back to a peer now: never reused meanwhile
        self.serving: set[int] = set()

    def buffer(self, offer: Offer) -> bytearray:
        """Where `offer`'s bytes are received: a spare buffer of its size, else a new one
        (the spares of other sizes are let go first)."""
        for i, buf in enumerate(self._spare):
            if len(buf) == offer.size:
                return self._spare.pop(i)
        self._spare.clear()
        return bytearray(offer.size)

    def _retire(self, held: dict[int, tuple[Offer, bytearray]]) -> None:
        """Replicas dropped: their buffers become spares while the budget allows."""
        self._spare.extend(data for _, data in held.values() if id(data) not in self.serving)
        used = self.used
        while self._spare and used + sum(len(b) for b in self._spare) > self.budget:
            self._spare.pop(0)

    @property
    def used(self) -> int:
        return sum(
            o.size
            for s in self._sources.values()
            for held in s.steps.values()
            for o, _ in held.values()
        )

    def holds(self, offer: Offer) -> bool:
        """Whether the very rank `offer` describes is held already (same checksum)."""
        src = self._sources.get(offer.source)
        held = src.steps.get(offer.step, {}).get(offer.rank) if src is not None else None
        return held is not None and held[0].checksum == offer.checksum

    def refusal(self, offer: Offer) -> str:
        """Why `offer` cannot be taken ('' when it can). Makes room for it first by
        dropping what it would supersede: older incomplete steps of its source."""
        if offer.job != self.job:
            return f"this node serves job {self.job}, not {offer.job}"
        if offer.rank not in offer.ranks:
            return f"rank {offer.rank} is not among the ranks sent {list(offer.ranks)}"
        src = self._sources.setdefault(offer.source, _Source())
        if offer.step <= src.complete:
            return f"step {offer.step} of {offer.source} is not newer than step {src.complete} held"
        for step in [s for s in src.steps if src.complete < s < offer.step]:
            self._retire(src.steps.pop(step))  # an arriving step a newer one overtook
        held = src.steps.get(offer.step, {}).get(offer.rank)
        again = held[0].size if held is not None else 0
        if self.used - again + offer.size > self.budget:
            return (
                f"the peer's replica budget is full ({self.used >> 20} of "
                f"{self.budget >> 20} MiB held, {offer.size >> 20} MiB offered)"
            )
        return ""

    def put(self, offer: Offer, data: bytearray, *, verified: bool = False) -> bool:
        """Keep a rank (checked here unless the caller `verified` it); True when its step
        is now complete (older steps of its source are then dropped). Raises
        CheckpointError if it fails its check."""
        problem = "" if verified else verify(offer, data)
        if problem:
            raise CheckpointError(
                f"step {offer.step} rank {offer.rank} of {offer.source}: {problem}"
            )
        src = self._sources.setdefault(offer.source, _Source())
        ranks = src.steps.setdefault(offer.step, {})
        ranks[offer.rank] = (offer, data)
        if set(ranks) != set(offer.ranks):
            return False
        src.complete = offer.step
        for step in [s for s in src.steps if s < offer.step]:
            self._retire(src.steps.pop(step))
        return True

    def get(self, source: str, step: int, rank: int) -> tuple[Offer, bytearray] | None:
        src = self._sources.get(source)
        if src is None or step != src.complete:
            return None
        return src.steps[step].get(rank)

    def held(self, source: str) -> tuple[int, tuple[Offer, ...]] | None:
        """(step, its ranks' offers) of the newest complete step held of `source`."""
        src = self._sources.get(source)
        if src is None or src.complete < 0:
            return None
        offers = tuple(
            o for o, _ in sorted(src.steps[src.complete].values(), key=lambda h: h[0].rank)
        )
        return src.complete, offers

    def drop_newer(self, step: int) -> None:
        """A new lineage starts at `step`: no replica of a newer step may be restored."""
        for src in self._sources.values():
            for s in [s for s in src.steps if s > step]:
                self._retire(src.steps.pop(s))
            if src.complete > step:
                src.complete = -1
