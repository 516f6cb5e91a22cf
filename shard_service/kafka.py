"""Reading a leased stream shard from Kafka: exactly its offset range, no consumer group.

`RangeReader.read(shard, offset)` assigns the shard's partition at
`shard.start + offset` (`assign` + `seek`: no group membership, so no
rebalance ever moves data between trainers) and yields its records up to
`shard.end`. Positions count records from the range's start, as the data
position does (`ShardRef.offset`), so a partly trained shard resumes where the
restored checkpoint stood.

Records the broker no longer keeps (retention deleted them before they were
trained) are not silently skipped: `read` raises `DataError` naming the
partition, the offsets and the likely cause, because skipping them would break
exactly-once relative to the model. Records in the range that compaction or
transaction markers removed are simply absent; the range still ends at `end`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from rove.control import events as ev
from rove.control import logs
from rove.shard_service.keeper import DataError

#: librdkafka's own log lines (connection retries every second) stay out of rove's
#: output: rove says what matters itself.
_LIBRDKAFKA = logs.silent("rove.kafka.librdkafka")


class Record(msgspec.Struct, frozen=True, array_like=True):
    """One record of a shard: its position in the shard, offset, key, value, and when
    it was produced (seconds since the epoch, 0 if unknown)."""

    position: int
    offset: int
    key: bytes | None
    value: bytes | None
    ts: float


def expired(low: int, shard: ev.StreamShard, offset: int) -> str | None:
    """Why records `shard.start + offset`.. cannot be read any more, or None."""
    first = shard.start + offset
    if low <= first:
        return None
    lost_to = min(low, shard.end)
    return (
        f"records {first}..{lost_to - 1} of partition {shard.partition} were deleted by the "
        f"topic's retention before they were trained (the oldest kept is {low}): raise the "
        "retention above the longest time a shard may wait, restore included"
    )


class RangeReader:
    def __init__(
        self, bootstrap: str, topic: str, *, poll_s: float = 1.0, stall_s: float = 60.0
    ) -> None:
        self.topic = topic
        self.poll_s = poll_s
        self.stall_s = stall_s
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"rove-reader-{topic}",  # required by the client; never joined
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "logger": _LIBRDKAFKA,
            }
        )

    def read(self, shard: ev.StreamShard, offset: int = 0) -> Iterator[Record]:
        """The records of `shard` from position `offset` on, in order.

        Raises:
            DataError: the records were deleted by retention, or the broker sent
                nothing for `stall_s` while the range was not done.
        """
        if shard.start + offset >= shard.end:
            return
        tp = TopicPartition(self.topic, shard.partition)
        try:
            low, _high = self.consumer.get_watermark_offsets(tp, timeout=10.0)
        except KafkaException as exc:
            raise DataError(f"cannot read partition {shard.partition}: {exc.args[0]}") from exc
        problem = expired(low, shard, offset)
        if problem is not None:
            raise DataError(f"topic {self.topic}: {problem}")
        self.consumer.assign([TopicPartition(self.topic, shard.partition, shard.start + offset)])
        last_progress = time.monotonic()
        try:
            while True:
                msg = self.consumer.poll(self.poll_s)
                error = msg.error() if msg is not None else None
                if msg is None or (error is not None and error.code() == KafkaError._PARTITION_EOF):
                    if time.monotonic() - last_progress > self.stall_s:
                        raise DataError(
                            f"topic {self.topic}: no record of partition {shard.partition} "
                            f"came for {self.stall_s:g}s, though the range ends at {shard.end}"
                        )
                    continue
                if error is not None:
                    raise DataError(f"topic {self.topic}: {error}")
                at = msg.offset()
                if at is None or at >= shard.end:
                    return
                last_progress = time.monotonic()
                kind, ms = msg.timestamp()
                yield Record(
                    at - shard.start, at, msg.key(), msg.value(), ms / 1000 if kind else 0.0
                )
                if at + 1 >= shard.end:
                    return
        finally:
            self.consumer.unassign()

    def close(self) -> None:
        self.consumer.close()
