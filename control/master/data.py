"""Datasets, shard leases and the data lineage, as the master folds them (pure).

Each registered dataset holds todo / leased / done shards. A request is
allocated the moment it is folded: the oldest requeued shards first, then
the next untouched keys (`cursor`). Because allocation is a function of the
folded events, every master that replays the stream allocates the same
shards, and the leader's `shard_leased` only announces what the fold decided.
So the announcement is not stored with the facts (stream ROVE_ANSWERS, memory):
a grant stays in the state until its client's next request says it arrived
(`answered`), and a new leader announces again what is still pending. A request
also acknowledges the shards its client trained since the last (`done`): a lease
costs one stored event, the request.

Rollback: the first request of a new round carries where the checkpoint that
round restored stood (`DataPosition`, None for a fresh start). The dataset is
reset to it: shards done in that lineage stay done, partly trained shards
become remainders from their offset, everything else (leased or done after
the checkpoint) goes back to todo. Acknowledgements from an older round are
refused, so nothing trained outside the lineage counts.

A stream's request that finds nothing cut yet is *parked*, not answered: the
fold of the next `stream_shards` allocates to parked requests, oldest first,
so a waiting trainer gets new records as soon as the bridge publishes them
(no polling). A request parked for `PARK_S` is answered empty (`data_due`), and the
client asks again; that answer has an id of its own, so shards allocated to
the request meanwhile are still announced.

Bad input (unknown dataset, a key out of range, an acknowledgement of a shard
the client does not hold, a duplicate, a conflicting registration) changes
nothing but a pending `data_rejected` answer.
"""

from __future__ import annotations

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.control.master import streams

#: The most shards one request may ask for.
MAX_REQUEST = 1024
#: Seconds a stream's request waits for shards to be cut before it is answered empty
#: (well under a client's answer timeout: a quiet stream is not a missing master).
PARK_S = 5.0


class Lease(msgspec.Struct, frozen=True, array_like=True):
    client: str
    node: str
    rank: int
    round: int
    offset: int
    deadline: float


class Grant(msgspec.Struct, frozen=True, array_like=True):
    """An allocated request, to announce as `shard_leased` (with the offset ranges of a
    stream dataset's shards)."""

    client: str
    request: int
    node: str
    rank: int
    shards: tuple[ev.ShardRef, ...]
    deadline: float
    exhausted: bool
    ranges: tuple[ev.StreamShard, ...] = ()


class Parked(msgspec.Struct, frozen=True, array_like=True):
    """A stream's request that found nothing cut: allocated when shards are."""

    client: str
    request: int
    node: str
    rank: int
    round: int
    count: int
    since: float


class NodeData(msgspec.Struct, frozen=True, array_like=True):
    """Per node: shards and samples acknowledged, and when (for throughput)."""

    shards: int = 0
    samples: int = 0
    first_ts: float = 0.0
    last_ts: float = 0.0


class Rejection(msgspec.Struct, frozen=True, array_like=True):
    dataset: str
    client: str
    event_id: str
    reason: str


class Dataset(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    spec: ev.DatasetSpec
    #: the newest round a registration said (its spec's epochs and lease time hold)
    spec_round: int = 0
    round: int = 0
    step: int | None = None
    announce_restore: bool = False
    restored_done: int = 0
    restored_partial: int = 0
    cursor: int = 0
    requeued: tuple[ev.ShardRef, ...] = ()
    leases: immutables.Map[int, Lease] = msgspec.field(default_factory=immutables.Map)
    #: every shard key below it is done; `done` holds the done keys above it (those
    #: past a shard still in flight), so the state is the size of what is in flight,
    #: not of how far the dataset got
    done_floor: int = 0
    done: immutables.Map[int, bool] = msgspec.field(default_factory=immutables.Map)
    grants: immutables.Map[str, Grant] = msgspec.field(default_factory=immutables.Map)
    #: per client, the requests of its grants (what its `answered` prunes)
    granted: immutables.Map[str, tuple[int, ...]] = msgspec.field(default_factory=immutables.Map)
    parked: immutables.Map[str, Parked] = msgspec.field(default_factory=immutables.Map)
    bad_clients: frozenset[str] = frozenset()
    nodes: immutables.Map[str, NodeData] = msgspec.field(default_factory=immutables.Map)
    requeued_total: int = 0
    restores: int = 0


class DataState(msgspec.Struct, frozen=True, kw_only=True):
    datasets: immutables.Map[str, Dataset] = msgspec.field(default_factory=immutables.Map)
    rejections: tuple[Rejection, ...] = ()
    rejected_total: int = 0
    #: the shard tables of stream datasets, cut by Kafka bridges (`rove.control.master.streams`)
    streams: streams.StreamState = msgspec.field(default_factory=streams.StreamState)


def total(d: DataState, ds: Dataset) -> int:
    """How many shards `ds` has: all epochs' from its spec, or a stream's cut so far."""
    if ds.spec.stream:
        stream = d.streams.streams.get(ds.name)
        return stream.count if stream is not None else 0
    return shards.total(ds.spec)


def done_count(d: DataState, ds: Dataset) -> int:
    """Shards of `ds` done in the current lineage (a stream's pruned ones included)."""
    stream = d.streams.streams.get(ds.name) if ds.spec.stream else None
    return len(ds.done) + max(ds.done_floor, stream.floor if stream is not None else 0)


def is_done(ds: Dataset, key: int) -> bool:
    return key < ds.done_floor or key in ds.done


def _done(ds: Dataset, key: int) -> Dataset:
    """`ds` with shard `key` done."""
    if key < ds.done_floor:
        return ds
    ds = replace(ds, done=ds.done.set(key, True))
    # (a state of an earlier version holds every done key, its floor 0: it rises now)
    return _raise_floor(ds, ds.done_floor) if ds.done_floor in ds.done else ds


def _raise_floor(ds: Dataset, floor: int) -> Dataset:
    """`ds` with every key below `floor` done, and the floor over the done keys above."""
    if floor < ds.done_floor:
        return ds
    below = range(ds.done_floor, floor)
    with ds.done.mutate() as done:
        for key in below if len(below) <= len(ds.done) else [k for k in ds.done if k < floor]:
            done.pop(key, None)
        while floor in done:
            del done[floor]
            floor += 1
        kept = done.finish()
    return replace(ds, done_floor=floor, done=kept)


def _reject(d: DataState, dataset: str, client: str, event_id: str, reason: str) -> DataState:
    return replace(
        d,
        rejections=(*d.rejections, Rejection(dataset, client, event_id, reason)),
        rejected_total=d.rejected_total + 1,
    )


def _put(d: DataState, ds: Dataset) -> DataState:
    return replace(d, datasets=d.datasets.set(ds.name, ds))


# --------------------------------------------------------------------------- folds


def on_registered(d: DataState, e: ev.DatasetRegistered) -> DataState:
    problem = shards.spec_problem(e.spec)
    if problem:
        return _reject(d, e.dataset, e.client, e.id, f"dataset {e.dataset}: {problem}")
    known = d.datasets.get(e.dataset)
    if known is None:
        return _put(d, Dataset(name=e.dataset, spec=e.spec, spec_round=e.round))
    if known.spec == e.spec:
        # idempotent: every rank of every round registers
        return d if e.round <= known.spec_round else _put(d, replace(known, spec_round=e.round))
    if e.round > known.spec_round and not shards.order_differs(known.spec, e.spec):
        # the same shards in the same order, for more (or fewer) epochs or another lease
        # time, from a newer round: the job run again with more steps. Its first request
        # restores the position it goes on from (`restore`), within the new end.
        return _put(d, replace(known, spec=e.spec, spec_round=e.round))
    reason = (
        f"dataset {e.dataset} is registered with {_describe(known.spec)}, but client "
        f"{e.client} registers {_describe(e.spec)}: use the same parameters (a newer "
        "round may change only the epochs or the lease time), or a new dataset name for "
        "different data"
    )
    d = _put(d, replace(known, bad_clients=known.bad_clients | {e.client}))
    return _reject(d, e.dataset, e.client, e.id, reason)


def _describe(spec: ev.DatasetSpec) -> str:
    return (
        f"size={spec.size} shard_size={spec.shard_size} epochs={spec.epochs} "
        f"seed={spec.seed} shuffle={spec.shuffle}"
    )


def on_requested(d: DataState, e: ev.ShardRequested) -> DataState:
    ds = d.datasets.get(e.dataset)
    if ds is None:
        return _reject(
            d, e.dataset, e.client, e.id, f"unknown dataset {e.dataset}: register it first"
        )
    if e.client in ds.bad_clients:
        return _reject(d, e.dataset, e.client, e.id, "this client's registration was refused")
    if not 0 <= e.count <= MAX_REQUEST:
        reason = f"count must be between 0 and {MAX_REQUEST}, not {e.count}"
        return _reject(d, e.dataset, e.client, e.id, reason)
    if len(e.done) > MAX_REQUEST:
        reason = f"at most {MAX_REQUEST} shards may be acknowledged at once, not {len(e.done)}"
        return _reject(d, e.dataset, e.client, e.id, reason)
    if e.round < ds.round:
        reason = (
            f"request from round {e.round}, but dataset {e.dataset} follows round {ds.round}: "
            "a worker of a finished round"
        )
        return _reject(d, e.dataset, e.client, e.id, reason)
    end = total(d, ds)
    if e.round > ds.round:
        stream = d.streams.streams.get(ds.name) if ds.spec.stream else None
        floor = stream.floor if stream is not None else 0
        problem = streams.restore_problem(stream, e.restore) if stream is not None else None
        if problem is not None:
            return _reject(d, e.dataset, e.client, e.id, problem)
        ds = restore(ds, e.round, e.restore_step, e.restore, end, floor)
    for ref in e.done:
        ds, problem = _acked(d, ds, e.client, e.round, ref, e.ts)
        if problem is not None:  # nothing of the request counts: the client stops
            return _reject(d, e.dataset, e.client, e.id, problem)
    ds = _answered(ds, e.client, e.answered)
    if e.count > 0:  # a client awaits one request at a time: older parked ones are void
        ds = _unpark(ds, e.client, e.request)
    deadline = e.ts + ds.spec.lease_s
    leases = ds.leases
    for key in e.held:
        lease = leases.get(key)
        if lease is not None and lease.client == e.client:
            leases = leases.set(key, replace(lease, deadline=deadline))
    ds = replace(ds, leases=leases)
    if e.count == 0:
        return _put(d, ds)
    want = Parked(e.client, e.request, e.node, e.rank, e.round, e.count, e.ts)
    if ds.spec.stream and _nothing_to_lease(ds, end):
        return _put(d, replace(ds, parked=ds.parked.set(f"{e.client}/{e.request}", want)))
    return _put(d, _grant(d, ds, want, end, e.ts))


def _grant(d: DataState, ds: Dataset, want: Parked, end: int, now: float) -> Dataset:
    """`ds` with `want`'s shards allocated (as many of `want.count` as there are) and a
    grant to announce."""
    deadline = now + ds.spec.lease_s
    ds, granted = _allocate(ds, want.count, end)
    leases = ds.leases
    for ref in granted:
        leases = leases.set(
            ref.key, Lease(want.client, want.node, want.rank, want.round, ref.offset, deadline)
        )
    ranges: tuple[ev.StreamShard, ...] = ()
    if ds.spec.stream:
        table = d.streams.streams[ds.name].shards if granted else immutables.Map()
        ranges = tuple(table[ref.key] for ref in granted)
    exhausted = not granted and _nothing_to_lease(ds, end) and not ds.spec.stream
    grant = Grant(
        want.client, want.request, want.node, want.rank, granted, deadline, exhausted, ranges
    )
    key = f"{want.client}/{want.request}"
    requests = ds.granted.get(want.client, ())
    if want.request not in requests:
        requests = (*requests, want.request)
    return replace(
        ds,
        leases=leases,
        grants=ds.grants.set(key, grant),
        granted=ds.granted.set(want.client, requests),
        parked=ds.parked.delete(key) if key in ds.parked else ds.parked,
    )


def _answered(ds: Dataset, client: str, answered: int) -> Dataset:
    """`ds` without the grants of `client`'s requests up to `answered`: they reached it."""
    requests = ds.granted.get(client, ())
    if not requests or requests[0] > answered:
        return ds
    grants = ds.grants
    for request in requests:
        if request <= answered:
            key = f"{client}/{request}"
            grants = grants.delete(key) if key in grants else grants
    left = tuple(r for r in requests if r > answered)
    granted = ds.granted.set(client, left) if left else ds.granted.delete(client)
    return replace(ds, grants=grants, granted=granted)


def _unpark(ds: Dataset, client: str, request: int) -> Dataset:
    """`ds` without `client`'s parked requests older than `request` (answered empty)."""
    if not ds.parked:
        return ds
    stale = [k for k, w in ds.parked.items() if w.client == client and w.request < request]
    if not stale:
        return ds
    parked = ds.parked
    for key in stale:
        parked = parked.delete(key)
    return replace(ds, parked=parked)


def _nothing_to_lease(ds: Dataset, end: int) -> bool:
    """No shard of `ds` (of `end`) is requeued or untouched: all are leased or done."""
    return not ds.requeued and ds.cursor >= end


def _allocate(ds: Dataset, count: int, end: int) -> tuple[Dataset, tuple[ev.ShardRef, ...]]:
    taken = list(ds.requeued[:count])
    requeued = ds.requeued[len(taken) :]
    cursor = ds.cursor
    while len(taken) < count and cursor < end:
        taken.append(ev.ShardRef(cursor, 0))
        cursor += 1
    return replace(ds, requeued=requeued, cursor=cursor), tuple(taken)


def restore(
    ds: Dataset,
    round_: int,
    step: int | None,
    pos: ev.DataPosition | None,
    end: int,
    floor: int = 0,
) -> Dataset:
    """`ds` (of `end` shards) rolled back to the lineage of a checkpoint (or to nothing
    trained). Shards below `floor` (a stream's pruned ones) are done in it."""
    ranges = shards.clip(shards.union(pos.done), floor, end) if pos else ()
    partial = {r.key: r.offset for r in pos.partial if floor <= r.key < end} if pos else {}
    top = max([*(last for _, last in ranges), *partial, floor - 1]) + 1
    done_floor = floor
    if ranges and ranges[0][0] <= done_floor:  # (merged: the others start past a hole)
        done_floor, ranges = ranges[0][1] + 1, ranges[1:]
    done = immutables.Map({k: True for k in shards.from_ranges(ranges)})
    requeued = tuple(
        ev.ShardRef(k, partial.get(k, 0)) for k in range(done_floor, top) if k not in done
    )
    return replace(
        ds,
        round=round_,
        step=step,
        announce_restore=True,
        restored_done=done_floor - floor + len(done),
        restored_partial=sum(1 for o in partial.values() if o),
        cursor=top,
        requeued=requeued,
        leases=immutables.Map(),
        done_floor=done_floor,
        done=done,
        grants=immutables.Map(),
        granted=immutables.Map(),
        parked=immutables.Map(),  # requests of the round before: their clients are gone
        restores=ds.restores + 1,
    )


def on_stream_shards(d: DataState, e: ev.StreamShardsAdded) -> DataState:
    """New shards in the table; requests parked on the dataset get them, oldest first."""
    d = replace(d, streams=streams.on_shards(d.streams, e))
    ds = d.datasets.get(e.dataset)
    if ds is None or not ds.parked:
        return d
    end = total(d, ds)
    for want in sorted(ds.parked.values(), key=lambda w: (w.since, w.client, w.request)):
        if _nothing_to_lease(ds, end):
            break
        ds = _grant(d, ds, want, end, e.ts)
    return _put(d, ds)


def on_stream_checkpointed(d: DataState, e: ev.StreamCheckpointed) -> DataState:
    return replace(d, streams=streams.on_checkpointed(d.streams, e))


def on_undecodable(d: DataState, e: ev.RecordsUndecodable) -> DataState:
    return replace(d, streams=streams.on_undecodable(d.streams, e))


def on_committed(d: DataState, e: ev.CkptCommitted) -> DataState:
    """A checkpoint committed: each stream's shards below its position there are pruned,
    from the table and from the dataset's done shards."""
    tables = d.streams.streams
    for name, stream in d.streams.streams.items():
        pruned = streams.prune(stream, e.step, e.round)
        if pruned is stream:
            continue
        tables = tables.set(name, pruned)
        ds = d.datasets.get(name)
        if ds is not None:
            d = _put(d, _raise_floor(ds, pruned.floor))
    return replace(d, streams=replace(d.streams, streams=tables))


def on_leased(d: DataState, e: ev.ShardLeased) -> DataState:
    """An announced answer: its grant, or its parked request (answered empty), is done
    with. (A parked request answered empty may have been granted shards meanwhile:
    that grant stays, to be announced.)"""
    ds = d.datasets.get(e.dataset)
    if ds is None:
        return d
    key = f"{e.client}/{e.request}"
    grant = ds.grants.get(key)
    if grant is not None and grant.shards == e.shards:
        ds = _answered(ds, e.client, e.request)
    if key in ds.parked:
        ds = replace(ds, parked=ds.parked.delete(key))
    return _put(d, ds)


def on_done(d: DataState, e: ev.ShardDone) -> DataState:
    ds = d.datasets.get(e.dataset)
    if ds is None:
        return _reject(d, e.dataset, e.client, e.id, f"unknown dataset {e.dataset}")
    ds, problem = _acked(d, ds, e.client, e.round, e.shard, e.ts)
    if problem is not None:
        return _reject(d, e.dataset, e.client, e.id, problem)
    return _put(d, ds)


def _acked(
    d: DataState, ds: Dataset, client: str, round_: int, shard: ev.ShardRef, ts: float
) -> tuple[Dataset, str | None]:
    """`ds` with `shard` trained by `client` (in round `round_`, at `ts`), or `ds` as it
    is and why the acknowledgement is refused."""
    key = shard.key
    end = total(d, ds)
    lease = ds.leases.get(key)
    problem = None
    if not 0 <= key < end:
        problem = f"shard {key} is out of range: dataset {ds.name} has shards 0..{end - 1}"
    elif round_ < ds.round:
        problem = f"acknowledgement from round {round_}; the dataset follows round {ds.round}"
    elif lease is None:
        problem = (
            f"duplicate acknowledgement of shard {key}"
            if is_done(ds, key)
            else f"shard {key} is not leased to anyone"
        )
    elif lease.client != client:
        problem = f"shard {key} is leased to {lease.client}, not to {client}"
    if problem is not None:
        return ds, problem
    assert lease is not None
    # for the status only: the master never computes an epoch's shard order (a
    # shuffle of every shard id), so the one short shard of an epoch counts as full
    if ds.spec.stream:
        cut = d.streams.streams[ds.name].shards.get(key)
        if cut is None:
            # pruned: a committed checkpoint trained it before this acknowledgement came
            # (it rides in the next request); the floor counts it done already
            return replace(ds, leases=ds.leases.delete(key)), None
        samples = max(0, cut.records - lease.offset)
    else:
        samples = max(0, min(ds.spec.shard_size, ds.spec.size) - lease.offset)
    node = ds.nodes.get(lease.node, NodeData())
    node = NodeData(
        node.shards + 1, node.samples + samples, node.first_ts or ts, max(node.last_ts, ts)
    )
    return _done(
        replace(ds, leases=ds.leases.delete(key), nodes=ds.nodes.set(lease.node, node)), key
    ), None


def on_requeued(d: DataState, e: ev.ShardRequeued) -> DataState:
    ds = d.datasets.get(e.dataset)
    if ds is None:
        return d
    # a stream's shards below the floor were pruned: a committed checkpoint trained them
    # (their acknowledgement, riding in a request, had not come yet); not to train again
    stream = d.streams.streams.get(ds.name) if ds.spec.stream else None
    floor = stream.floor if stream is not None else 0
    leases = ds.leases
    back = []
    for ref in e.shards:
        lease = leases.get(ref.key)
        if lease is not None and (not e.client or lease.client == e.client):
            leases = leases.delete(ref.key)
            if ref.key >= floor:
                back.append(ev.ShardRef(ref.key, lease.offset))
    if not back:
        return _put(d, replace(ds, leases=leases)) if leases is not ds.leases else d
    requeued = tuple(sorted((*ds.requeued, *back), key=lambda r: r.key))
    return _put(
        d,
        replace(ds, leases=leases, requeued=requeued, requeued_total=ds.requeued_total + len(back)),
    )


def on_restored(d: DataState, e: ev.DataRestored) -> DataState:
    ds = d.datasets.get(e.dataset)
    if ds is None or ds.round != e.round:
        return d
    return _put(d, replace(ds, announce_restore=False))


def on_rejected(d: DataState, e: ev.DataRejected) -> DataState:
    left = tuple(r for r in d.rejections if (r.event_id, r.client) != (e.event_id, e.client))
    return replace(d, rejections=left)
