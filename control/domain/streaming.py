"""Cutting a topic into stream shards (pure): what a Kafka bridge publishes next.

`cut(next, watermarks, ..., now)` returns the shards to publish for the
records that arrived since the last shards (`next`: each partition's end of
the last shard, as the master folded it). A partition's new records are cut
into shards of `shard_records`; a last, smaller shard is cut only once its
oldest record has waited `linger_s` (freshness: a slow partition still
trains soon, a busy one gets full shards). A partition never seen starts at
its low watermark; one whose `next` fell below the low watermark (retention
expired records before a shard covered them) continues from the low
watermark, and the master records the gap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from rove.control.catalogue import events as ev


def cut(
    next_offsets: Mapping[int, int],
    watermarks: Iterable[ev.Watermark],
    *,
    shard_records: int,
    linger_s: float,
    waiting_since: Mapping[int, float],
    now: float,
) -> tuple[list[ev.StreamShard], dict[int, float]]:
    """The shards to publish now, and since when each partition's uncut records wait
    (the `waiting_since` to pass next time)."""
    if shard_records < 1:
        raise ValueError(f"shard_records must be at least 1, got {shard_records}")
    shards: list[ev.StreamShard] = []
    waiting: dict[int, float] = {}
    for w in sorted(watermarks, key=lambda w: w.partition):
        start = max(next_offsets.get(w.partition, w.low), w.low)
        while w.high - start >= shard_records:
            shards.append(ev.StreamShard(w.partition, start, start + shard_records))
            start += shard_records
        if w.high > start:
            since = waiting_since.get(w.partition, now)
            if now - since >= linger_s:
                shards.append(ev.StreamShard(w.partition, start, w.high))
            else:
                waiting[w.partition] = since
    return shards, waiting
