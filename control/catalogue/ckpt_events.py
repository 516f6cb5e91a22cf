"""The checkpoint part of the event catalogue: the steps nodes hold in memory, persist,
find and fail to persist, the peer replicas they hold (facts), and the commits the
master decides (docs/checkpoint.md).

`rove.control.catalogue.events` re-exports everything here; import from there.
"""

from __future__ import annotations

import msgspec

from rove.control.catalogue.event_base import Decision, NodeFact


class CkptInMemory(NodeFact, tag="ckpt_in_memory", frozen=True, kw_only=True):
    """Every local rank of `node` holds `step` in shared memory (saved in `round`).

    `recovered`: a new agent of `node` found `step` in the slots its earlier agent left
    (killed, it took its place; the round it was saved in is not known): the master
    takes it only if it knew `node` held that very step, of ranks all among these, in
    the lineage going on (nodes sharing a machine's memory see each other's slots)."""

    step: int
    ranks: tuple[int, ...]
    round: int = 0
    recovered: bool = False
    #: those of `ranks` whose slots spilled to disk: shared memory had no room for them
    #: (`rove.checkpoint.shm`); they restore from there as from memory
    spilled: tuple[int, ...] = ()


class CkptPersisted(NodeFact, tag="ckpt_persisted", frozen=True, kw_only=True):
    """`node` persisted `step` of these ranks to storage (files renamed into place);
    `round`: the round whose lineage the step belongs to."""

    step: int
    ranks: tuple[int, ...]
    world_size: int
    location: str = ""
    round: int = 0


class CkptFound(NodeFact, tag="ckpt_found", frozen=True, kw_only=True):
    """As it started, `node` found `step` committed in its checkpoint storage
    (`location`): an earlier run of the job left it, and the job goes on from it."""

    step: int
    location: str = ""


class ReplicaRank(msgspec.Struct, frozen=True, array_like=True):
    """One rank's bytes held as a replica: their size and xxh3-64 checksum."""

    rank: int
    size: int
    checksum: int


class ReplicaStored(NodeFact, tag="replica_stored", frozen=True, kw_only=True):
    """`node` (the holder) keeps in its memory, verified, every rank that `source` ran
    of `step` (saved in `round`): a peer replica of `source`'s flash checkpoint,
    recoverable without storage while `node` lives (docs/checkpoint.md)."""

    source: str
    step: int
    round: int
    ranks: tuple[ReplicaRank, ...]
    #: the incarnation of `source`'s agent that sent it: while that agent lives it keeps
    #: its own copy of the step too, for its ranks, after its slots moved on
    source_incarnation: str = ""


class CkptFailed(NodeFact, tag="ckpt_failed", frozen=True, kw_only=True):
    """Persisting `step` failed on `node` (disk full, unwritable path, ...)."""

    step: int
    error: str


class CkptCommitted(Decision, tag="ckpt_committed", frozen=True, kw_only=True):
    """Every rank of the world persisted `step`: it is the job's restore point on storage.
    `round`: the round of the lineage it belongs to."""

    step: int
    world_size: int
    round: int = 0
