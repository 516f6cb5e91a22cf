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
"""

from __future__ import annotations

from collections.abc import Mapping

import immutables
import msgspec
from msgspec.structs import replace

from rove.control import events as ev

#: Gaps kept for `rove status` (their count is unbounded).
RECENT_GAPS = 20


class Gap(msgspec.Struct, frozen=True, array_like=True):
    """Offsets `start` to `end` of `partition` were never cut into a shard."""

    partition: int
    start: int
    end: int


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
