"""Stream datasets (Kafka topics cut into offset ranges by a bridge), as the master folds
them (pure).

Each stream dataset keeps its shard table: shard keys are given in fold order
(the first shard folded is key 0), so every master that replays the stream
numbers the shards alike. Per partition it keeps `next`, the end of the last
shard: a bridge (restarted, or a second one) continues from there, and a
shard that starts before it was published already and is ignored. A shard
that starts after it leaves a *gap* of records nobody will train (expired by
retention before a bridge read them): it is recorded, and shown by
`rove status`, never silently skipped.

The tables live in the data state (`DataState.streams`): the data fold leases a
stream dataset's shards in key order, with their offset ranges, under the
rules of index shards (`rove.control.master.data`).

A stream has no end, so the table is pruned: once a checkpoint commits, every
shard below its position's *floor* (the first shard not done in it) is done in
every position a job can still restore (restores go to the committed step or a
newer one), and leaves the table. A position older than the floor cannot be
replayed any more, and a restore to one is refused (`restore_problem`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.domain import shards

#: Gaps kept for `rove status` (their count is unbounded).
RECENT_GAPS = 20
#: Dead letters (undecodable records) kept for `rove status` (their count is unbounded).
RECENT_DEAD = 20
#: Saved offset vectors kept per stream: a step is committed a few saves after it is
#: saved, so the newest ones suffice to find the one a commit names.
RECENT_SAVES = 64


class Gap(msgspec.Struct, frozen=True, array_like=True):
    """Offsets `start` to `end` of `partition` were never cut into a shard."""

    partition: int
    start: int
    end: int


class Saved(msgspec.Struct, frozen=True, array_like=True):
    """The topic's offset vector in the lineage of `step` (saved in `round`): per partition,
    the first offset not trained (what a Kafka consumer group would commit). `floor`:
    every shard key below it is done in that lineage."""

    step: int
    round: int
    offsets: tuple[tuple[int, int], ...]
    ts: float
    newest_ts: float
    floor: int = 0


class DeadLetter(msgspec.Struct, frozen=True, array_like=True):
    """A record of `partition` at `offset` no decoder could read (`error`: the first such)."""

    partition: int
    offset: int
    error: str


class Stream(msgspec.Struct, frozen=True, kw_only=True):
    dataset: str
    topic: str
    shards: immutables.Map[int, ev.StreamShard] = msgspec.field(default_factory=immutables.Map)
    count: int = 0
    records: int = 0
    next: immutables.Map[int, int] = msgspec.field(default_factory=immutables.Map)
    watermarks: tuple[ev.Watermark, ...] = ()
    gaps: tuple[Gap, ...] = ()
    gap_records: int = 0
    last_ts: float = 0.0
    #: events whose topic did not match the dataset's (ignored)
    conflicts: int = 0
    #: the newest offset vectors trainers saved in checkpoints (oldest first)
    saved: tuple[Saved, ...] = ()
    #: shards below it are done in every position that can be restored: pruned
    floor: int = 0
    #: records skipped as undecodable (dead letters), and the newest of them
    undecodable: int = 0
    dead_letters: tuple[DeadLetter, ...] = ()


class StreamState(msgspec.Struct, frozen=True, kw_only=True):
    streams: immutables.Map[str, Stream] = msgspec.field(default_factory=immutables.Map)


def on_shards(s: StreamState, e: ev.StreamShardsAdded) -> StreamState:
    known = s.streams.get(e.dataset)
    stream = known if known is not None else Stream(dataset=e.dataset, topic=e.topic)
    if stream.topic != e.topic:
        return _put(s, replace(stream, conflicts=stream.conflicts + 1))
    shards, nxt, gaps = stream.shards, stream.next, list(stream.gaps)
    count, records, gap_records = stream.count, stream.records, stream.gap_records
    for shard in e.shards:
        if shard.end <= shard.start or shard.start < 0:
            continue  # empty or malformed: nothing to train
        at = nxt.get(shard.partition)
        if at is not None and shard.start < at:
            continue  # published before (a restarted bridge's repeat)
        if at is not None and shard.start > at:
            gaps.append(Gap(shard.partition, at, shard.start))
            gap_records += shard.start - at
        shards = shards.set(count, shard)
        count += 1
        records += shard.records
        nxt = nxt.set(shard.partition, shard.end)
    return _put(
        s,
        replace(
            stream,
            shards=shards,
            count=count,
            records=records,
            next=nxt,
            watermarks=e.watermarks or stream.watermarks,
            gaps=tuple(gaps[-RECENT_GAPS:]),
            gap_records=gap_records,
            last_ts=e.ts,
        ),
    )


def _put(s: StreamState, stream: Stream) -> StreamState:
    return replace(s, streams=s.streams.set(stream.dataset, stream))


def lag(stream: Stream) -> Mapping[int, int]:
    """Records per partition that the broker holds and no shard covers yet."""
    return {
        w.partition: max(0, w.high - max(stream.next.get(w.partition, w.low), w.low))
        for w in stream.watermarks
    }


def on_checkpointed(s: StreamState, e: ev.StreamCheckpointed) -> StreamState:
    stream = s.streams.get(e.dataset)
    if stream is None:
        return s  # a position of a table nobody cut (cannot be turned into offsets)
    position = ev.DataPosition(done=e.done, partial=tuple(ev.ShardRef(k, o) for k, o in e.partial))
    done = shards.union(e.done)
    floor = min(shards.prefix(done), stream.count)
    saved = Saved(e.step, e.round, offsets(stream, position), e.ts, e.newest_ts, floor)
    return _put(s, replace(stream, saved=(*stream.saved, saved)[-RECENT_SAVES:]))


def on_undecodable(s: StreamState, e: ev.RecordsUndecodable) -> StreamState:
    stream = s.streams.get(e.dataset)
    if stream is None:
        return s
    letters = (DeadLetter(e.partition, at, e.error[:300]) for at in e.offsets)
    return _put(
        s,
        replace(
            stream,
            undecodable=stream.undecodable + max(0, e.count),
            dead_letters=(*stream.dead_letters, *letters)[-RECENT_DEAD:],
        ),
    )


def offsets(stream: Stream, position: ev.DataPosition) -> tuple[tuple[int, int], ...]:
    """Per partition, the first offset the lineage of `position` has not trained: the start
    (plus what was trained of it) of the partition's first shard not done, else the end of
    the partition's last shard."""
    partial = {r.key: r.offset for r in position.partial}
    first: dict[int, int] = {}
    for key in undone(shards.union(position.done), stream.floor, stream.count):
        shard = stream.shards[key]  # keys of a partition follow its offsets
        if shard.partition not in first:
            first[shard.partition] = shard.start + partial.get(key, 0)
            if len(first) == len(stream.next):
                break
    return tuple(sorted((p, first.get(p, end)) for p, end in stream.next.items()))


def undone(done: shards.Ranges, lo: int, hi: int) -> Iterator[int]:
    """The keys `lo`..`hi - 1` not in `done`, in order (done runs are skipped whole)."""
    key = lo
    for first, last in done:
        if last < key:
            continue
        yield from range(key, min(first, hi))
        key = max(key, last + 1)
        if key >= hi:
            return
    yield from range(key, hi)


def prune(stream: Stream, step: int, round_: int) -> Stream:
    """`stream` once `step` (of `round_`) committed: the shards below the floor of its saved
    position leave the table."""
    vector = committed(stream, step, round_)
    if vector is None or vector.floor <= stream.floor:
        return stream
    with stream.shards.mutate() as table:
        for key in range(stream.floor, vector.floor):
            table.pop(key, None)
        pruned = table.finish()
    return replace(stream, shards=pruned, floor=vector.floor)


def restore_problem(stream: Stream, position: ev.DataPosition | None) -> str | None:
    """Why a restore of `position` cannot be replayed (its shards were pruned), or None."""
    if not stream.floor:
        return None
    if position is not None and shards.prefix(shards.union(position.done)) >= stream.floor:
        return None
    what = "no data position (a fresh start)" if position is None else "an older data position"
    return (
        f"stream {stream.dataset}: the restore brings {what}, but shards 0..{stream.floor - 1} "
        "were pruned once a newer checkpoint committed, so it cannot be replayed; restore "
        "from the newest committed checkpoint (or start a new job to train the topic anew)"
    )


def committed(stream: Stream, step: int | None, round_: int = 0) -> Saved | None:
    """The offset vector of the committed `step`: the newest saved with that step (and
    saved in `round_`, when given)."""
    if step is None:
        return None
    return next(
        (v for v in reversed(stream.saved) if v.step == step and round_ in (0, v.round)),
        None,
    )


def freshness(stream: Stream) -> float | None:
    """Seconds from producing the newest trained record to the save that covered it, at
    the newest save (None: nothing saved, or no produce times)."""
    last = stream.saved[-1] if stream.saved else None
    if last is None or last.newest_ts <= 0:
        return None
    return max(0.0, last.ts - last.newest_ts)


def expired(stream: Stream, vector: Saved | None) -> list[Gap]:
    """Records of `vector`'s lineage not trained yet that the broker no longer keeps
    (retention shorter than the restore interval): a restore to it would need them."""
    if vector is None:
        return []
    low = {w.partition: w.low for w in stream.watermarks}
    return [Gap(p, at, low[p]) for p, at in vector.offsets if p in low and low[p] > at]
