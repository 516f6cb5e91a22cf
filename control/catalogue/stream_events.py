"""The streaming part of the event catalogue: shards of a Kafka topic, cut as data arrives.

A *stream* dataset is fed by `rove kafka-bridge`: it watches a topic's
partitions and their high watermarks and publishes `stream_shards`, each shard
a `(partition, start, end)` range of offsets (end exclusive). Within a
partition the bridge's shards are contiguous: the master's fold
(`rove.control.master.streams`) keeps, per partition, the end of the last
shard, so a restarted or second bridge continues there and creates nothing
twice; a shard starting beyond it is a *gap* (records the bridge never saw:
expired by retention), recorded and shown, never silently skipped.

`rove.control.catalogue.events` re-exports everything here; import from there.
"""

from __future__ import annotations

import msgspec

from rove.control.catalogue.event_base import Event


class StreamShard(msgspec.Struct, frozen=True, array_like=True):
    """Offsets `start` (inclusive) to `end` (exclusive) of `partition`."""

    partition: int
    start: int
    end: int

    @property
    def records(self) -> int:
        return self.end - self.start


class Watermark(msgspec.Struct, frozen=True, array_like=True):
    """A partition's oldest kept offset and its next offset, as the bridge last read them."""

    partition: int
    low: int
    high: int


class StreamShardsAdded(Event, tag="stream_shards", frozen=True, kw_only=True):
    """The bridge `bridge` cut new `shards` of `topic` for dataset `dataset`, having read
    the partitions' `watermarks`. Shards already published (a restarted bridge's
    repeat) are ignored by the fold."""

    dataset: str
    topic: str
    bridge: str
    shards: tuple[StreamShard, ...] = ()
    watermarks: tuple[Watermark, ...] = ()


class StreamCheckpointed(Event, tag="stream_checkpointed", frozen=True, kw_only=True):
    """Rank 0 of the trainers saved `step` (in `round`) with this data position of stream
    dataset `dataset`: `done` (inclusive key ranges) and `partial` (key, records trained)
    are the shards of the table trained in the lineage of that step. `newest_ts`: the
    produce time of the newest record trained in it (0: unknown).

    The master turns it into the topic's offset vector; once the step is committed,
    the bridge mirrors that vector to the Kafka consumer group (`--group`)."""

    dataset: str
    client: str
    step: int
    round: int = 0
    done: tuple[tuple[int, int], ...] = ()
    partial: tuple[tuple[int, int], ...] = ()
    newest_ts: float = 0.0


class RecordsUndecodable(Event, tag="records_undecodable", frozen=True, kw_only=True):
    """Dead letters: `count` records of `partition` that the trainer's decoder could not
    read were skipped while client `client` read a shard of stream dataset `dataset`
    (training went on). `offsets`: the first of them (at most 16); `error`: the first
    decoder error, shortened."""

    dataset: str
    client: str
    partition: int
    offsets: tuple[int, ...]
    count: int
    error: str = ""
