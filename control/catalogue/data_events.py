"""The data part of the event catalogue: datasets, their shards and leases (dynamic
data sharding, docs/data.md). A trainer's client registers a dataset, asks for shards
and acknowledges them (facts); the master leases, requeues, restores and rejects
(decisions). A stream dataset's shards are offset ranges of a Kafka topic
(`rove.control.catalogue.stream_events`).

`rove.control.catalogue.events` re-exports everything here; import from there.
"""

from __future__ import annotations

import enum

import msgspec

from rove.control.catalogue.event_base import Decision, Event
from rove.control.catalogue.stream_events import StreamShard


class RequeueReason(enum.StrEnum):
    """Why leased shards went back to todo."""

    LEASE_EXPIRED = "lease_expired"
    NODE_LOST = "node_lost"
    #: its node left on purpose (`node_left`: stopped, finished, or scaled in)
    NODE_LEFT = "node_left"
    ROUND_RESTARTED = "round_restarted"


class DatasetSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A dataset of `size` indexed samples, split into shards of `shard_size` indices.

    Each epoch visits the shards in an order shuffled from `seed` and `epoch`
    (when `shuffle`), so every master and client computes the same shards.
    A lease not renewed within `lease_s` goes back to todo.
    """

    size: int
    shard_size: int
    epochs: int = 1
    seed: int = 0
    shuffle: bool = True
    lease_s: float = 600.0
    #: The shards are not computed from this spec but cut from a Kafka topic by a bridge
    #: (`stream_shards`, docs/streaming.md): `size` and `shard_size` are 0, one epoch.
    stream: bool = False


class ShardRef(msgspec.Struct, frozen=True, array_like=True):
    """Shard `key` (epoch * shards-per-epoch + position in the epoch's order), from `offset`.

    `offset` > 0 is the remainder of a shard partly trained before a restore.
    """

    key: int
    offset: int = 0


class DataPosition(msgspec.Struct, frozen=True, kw_only=True):
    """What the lineage of a checkpoint has trained of a dataset.

    `done`: inclusive ranges of shard keys fully trained; `partial`: shards
    trained up to an offset. Everything else is still to train.
    """

    done: tuple[tuple[int, int], ...] = ()
    partial: tuple[ShardRef, ...] = ()


class DatasetRegistered(Event, tag="dataset_registered", frozen=True, kw_only=True):
    """A trainer declares `dataset` (idempotent; a different spec is rejected, but for
    another number of epochs or lease time from a newer `round` than any before: a job
    run again with more steps)."""

    dataset: str
    spec: DatasetSpec
    client: str
    node: str = ""
    rank: int = 0
    #: the client's rendezvous round (0: not said, as before it was)
    round: int = 0


class ShardRequested(Event, tag="shard_requested", frozen=True, kw_only=True):
    """`client` asks for `count` more shards and renews the leases it `held`.

    It also acknowledges the shards it trained since its last request (`done`, as
    `shard_done` would, one by one: a lease is one stored event, not three), and
    says the newest of its requests whose shards reached it (`answered`): the master
    stops announcing those. `count` 0 with `done` only acknowledges: a main process
    sends such a request on behalf of the DataLoader worker holding the leases.

    Its first request in a round carries where the restored checkpoint stood
    (`restore`, None for a fresh start): the dataset is rolled back to it.
    """

    dataset: str
    client: str
    request: int
    count: int
    node: str = ""
    rank: int = 0
    round: int = 0
    held: tuple[int, ...] = ()
    restore: DataPosition | None = None
    restore_step: int | None = None
    done: tuple[ShardRef, ...] = ()
    answered: int = 0


class ShardDone(Event, tag="shard_done", frozen=True, kw_only=True):
    """`client` trained every sample of `shard` (from its offset). rove's clients
    acknowledge inside requests instead (`ShardRequested.done`, a stored event for many
    shards); this one is still folded, one shard per event."""

    dataset: str
    client: str
    shard: ShardRef
    node: str = ""
    rank: int = 0
    round: int = 0


class ShardLeased(Decision, tag="shard_leased", frozen=True, kw_only=True):
    """Answer to `client`'s `request`: `shards` are its until `deadline` (renewed by requests).

    Published to stream ROVE_ANSWERS (memory), not stored with the facts: the fold of
    the request already allocated these shards, so any master announces the same.
    A client may receive one twice (after a failover) and keeps the first.

    No shards and `exhausted`: every shard of every epoch is done or leased (a stream
    is never exhausted). For a stream dataset, `ranges[i]` is the offset range of
    `shards[i]` (whose `offset` then counts records from the range's start).

    `lapsed`: the grant's leases expired before its client confirmed it (the request
    was folded more than `lease_s` after it was made, or no master could announce it
    in time); its shards went back to the queue, none are given here, and the client
    asks again (and ignores the grant itself, should it still come).
    """

    dataset: str
    client: str
    request: int
    shards: tuple[ShardRef, ...]
    deadline: float
    node: str = ""
    rank: int = 0
    exhausted: bool = False
    ranges: tuple[StreamShard, ...] = ()
    lapsed: bool = False


class ShardRequeued(Decision, tag="shard_requeued", frozen=True, kw_only=True):
    """Leased shards back to todo, and why."""

    dataset: str
    shards: tuple[ShardRef, ...]
    reason: RequeueReason
    client: str = ""


class DataRestored(Decision, tag="data_restored", frozen=True, kw_only=True):
    """`dataset` follows the lineage of round `round`, restored from `step` (None: fresh)."""

    dataset: str
    round: int
    done_shards: int
    partial_shards: int
    step: int | None = None


class DataRejected(Decision, tag="data_rejected", frozen=True, kw_only=True):
    """A data request or acknowledgement refused; nothing in the dataset changed."""

    dataset: str
    client: str
    event_id: str
    reason: str
