"""Reading leased stream shards from Kafka: exactly their offset ranges, no consumer group.

`RangeReader.read(shard, offset)` yields the records of the shard's partition
from `shard.start + offset` up to `shard.end` (`assign` + `seek`: no group
membership, so no rebalance ever moves data between trainers). Positions
count records from the range's start, as the data position does
(`ShardRef.offset`), so a partly trained shard resumes where the restored
checkpoint stood.

`take(ranges)` reads a range of each of several partitions at once, as
librdkafka delivers them (what a loader worker does with the ranges it leased).
A reader keeps every partition it has read assigned, so that librdkafka goes
on fetching in the background: a range that continues where the partition's
last range ended is read on without a seek; one that starts elsewhere is a
seek. Records fetched for a partition no range is reading wait in a bounded
buffer (the partition is paused while its buffer is full).

Records the broker no longer keeps (retention deleted them before they were
trained) are not silently skipped: `read` raises `DataError` naming the
partition, the offsets and the likely cause, because skipping them would break
exactly-once relative to the model. Records in the range that compaction or
transaction markers removed are simply absent; the range still ends at `end`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from itertools import islice
from typing import cast

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from rove.control.catalogue import events as ev
from rove.control.process import kafka_settings, logs
from rove.shard_service.keeper import DataError

#: librdkafka's own log lines (connection retries every second) stay out of rove's
#: output: rove says what matters itself.
_LIBRDKAFKA = logs.silent("rove.kafka.librdkafka")


def _offset(msg: Message) -> int:
    """A record's offset (a message read from a partition always has one)."""
    return cast(int, msg.offset())


class Record:
    """One record of a shard: its `position` in the shard (`offset - start`), `offset`,
    `key`, `value`, and `ts`, when it was produced (seconds since the epoch, 0 if
    unknown). A view of the Kafka message: each field is read when asked."""

    __slots__ = ("_msg", "_start")

    def __init__(self, msg: Message, start: int) -> None:
        self._msg = msg
        self._start = start

    @property
    def offset(self) -> int:
        return _offset(self._msg)

    @property
    def position(self) -> int:
        return _offset(self._msg) - self._start

    @property
    def key(self) -> bytes | None:
        return self._msg.key()

    @property
    def value(self) -> bytes | None:
        return self._msg.value()

    @property
    def ts(self) -> float:
        kind, ms = self._msg.timestamp()
        return ms / 1000 if kind else 0.0

    def __repr__(self) -> str:
        return f"Record(partition={self._msg.partition()}, offset={self.offset})"


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
        self,
        bootstrap: str,
        topic: str,
        *,
        poll_s: float = 1.0,
        stall_s: float = 60.0,
        batch: int = 1000,
        buffer_bytes: int = 1 << 20,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        """`settings`: the user's librdkafka settings (TLS, SASL: see
        `rove.control.process.kafka_settings`), under the reader's own.

        Raises:
            ConfigError: librdkafka refuses a setting (an unknown name, a bad value).
        """
        self.topic = topic
        self.poll_s = poll_s
        self.stall_s = stall_s
        self.batch = batch
        self.buffer_bytes = buffer_bytes
        #: the Kafka client's last error of its own (a refused login, unreachable brokers)
        self.client_error = ""
        self.consumer = kafka_settings.consumer(
            settings or {},
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"rove-reader-{topic}",  # required by the client; never joined
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                # an offset the broker no longer keeps is an error, never a silent jump
                "auto.offset.reset": "error",
                # a fetch waiting for new data holds back the next range's start
                "fetch.wait.max.ms": 20,
                # what librdkafka prefetches for all assigned partitions together
                "queued.max.messages.kbytes": 32768,
                "logger": _LIBRDKAFKA,
                "error_cb": self._client_error,
            },
        )
        #: partition -> the offset below which every record was read or dropped: the
        #: records from there on come from the buffer, then from the consumer
        self._next: dict[int, int] = {}
        self._buffer: dict[int, deque[Message]] = {}
        self._buffered_bytes: dict[int, int] = {}
        self._paused: set[int] = set()
        #: partitions of the ranges to be read next (`prepare`)
        self._planned: set[int] = set()
        #: an error librdkafka reported for a partition not being read: raised when it is
        self._failed: dict[int, KafkaError] = {}
        #: partition -> the range `take` reads of it, and when it last got a record
        self._reading: dict[int, tuple[ev.StreamShard, int]] = {}
        self._progress: dict[int, float] = {}

    def prepare(self, ranges: Iterable[tuple[ev.StreamShard, int]]) -> None:
        """The `(shard, offset)` ranges to be read next, in order: a partition no range is
        being read of fetches from where the first of its ranges starts (one being read
        goes on; its next range follows). A partition none of them needs, and none is
        being read of, buffers little (another reader may hold its next ranges) before
        it pauses."""
        firsts: dict[int, int] = {}
        for shard, offset in ranges:
            if shard.start + offset < shard.end:
                firsts.setdefault(shard.partition, shard.start + offset)
        for p, at in firsts.items():
            if p not in self._reading:  # (one being read goes on: its next range follows)
                self._position(p, at)
        self._planned = set(firsts) | set(self._reading)

    def read(self, shard: ev.StreamShard, offset: int = 0) -> Iterator[Record]:
        """The records of `shard` from position `offset` on, one by one: `take` for one
        range.

        Raises:
            DataError: as `take`.
        """
        while True:
            for _p, msgs, ended in self.take({shard.partition: (shard, offset)}):
                yield from (Record(m, shard.start) for m in msgs)
                if ended:
                    return

    def take(
        self, ranges: Mapping[int, tuple[ev.StreamShard, int]]
    ) -> list[tuple[int, list[Message], bool]]:
        """One read of the ranges being read, at most one per partition (partition ->
        `(shard, offset)`, the range's records from position `offset` on): for each
        partition that got any, `(partition, messages, ended)`, the Kafka messages of its
        range that came since the last `take` (in offset order) and whether the range is
        now whole. Waits up to `poll_s` when none was fetched yet. A range given again
        continues where it stood; a new one for a partition starts (a seek if it is not
        where the partition's last range ended).

        All ranges are read as librdkafka fetches them, so records wait in no buffer of
        this reader. (Messages are Kafka's; a caller makes each `Record` only when it
        uses it: a record object per message, made a whole fetch at a time, would
        outlive the young garbage collections while the fetch is decoded, reach the old
        generation and bring on full collections, which cost tenths of a second in a
        process that imported torch.)

        Raises:
            DataError: records of a range were deleted by retention, a range stopped
                arriving for `stall_s`, or the broker failed its partition.
        """
        now = time.monotonic()
        out: list[tuple[int, list[Message], bool]] = []
        for p, (shard, offset) in ranges.items():
            if self._reading.get(p) != (shard, offset):
                self._reading[p] = (shard, offset)
                self._progress[p] = now
                first = shard.start + offset
                if first >= shard.end:
                    out.append(self._ended(p, shard, []))
                    continue
                self._position(p, first)
        if out:
            return out
        if not any(self._buffer[p] for p in ranges):
            self._fetch(ranges)
        for p, (shard, _at) in ranges.items():
            buffer = self._buffer[p]
            if buffer:
                msgs, ended = self._take(buffer, shard)
                if msgs:
                    self._progress[p] = now
                    self._next[p] = _offset(msgs[-1]) + 1
                if ended or self._next[p] >= shard.end:
                    out.append(self._ended(p, shard, msgs))
                elif msgs:
                    out.append((p, msgs, False))
            elif now - self._progress[p] > self.stall_s:
                raise DataError(
                    f"topic {self.topic}: no record of partition {p} came for "
                    f"{self.stall_s:g}s, though the range ends at {shard.end}"
                    + kafka_settings.last_error(self.client_error)
                )
        return out

    def _ended(
        self, p: int, shard: ev.StreamShard, msgs: list[Message]
    ) -> tuple[int, list[Message], bool]:
        """Partition `p`'s range is whole with `msgs`: the next range starts at its end."""
        self._next[p] = max(self._next.get(p, shard.end), shard.end)
        del self._reading[p]
        return p, msgs, True

    def _position(self, p: int, first: int) -> None:
        """Make offset `first` the next record partition `p` delivers, and fetch it."""
        if p not in self._next:
            self.consumer.incremental_assign([TopicPartition(self.topic, p, first)])
            self._next[p] = first
            self._buffer[p] = deque()
            self._buffered_bytes[p] = 0
            return
        if self._next[p] != first:  # not where the partition's last range ended: a seek
            self._buffer[p].clear()
            self._buffered_bytes[p] = 0
            self._failed.pop(p, None)
            self._resume(p)
            at = TopicPartition(self.topic, p, first)
            try:
                self.consumer.seek(at)
            except KafkaException:  # a partition not fetching yet cannot seek: assign anew
                self.consumer.incremental_unassign([TopicPartition(self.topic, p)])
                self.consumer.incremental_assign([at])
            self._next[p] = first
        elif self._buffered_bytes[p] < self.buffer_bytes // 2:
            self._resume(p)

    def _take(self, buffer: deque[Message], shard: ev.StreamShard) -> tuple[list[Message], bool]:
        """The buffered records of `shard`'s range (and whether it ended): they leave the
        buffer; records past the range stay for the next one."""
        end, p = shard.end, shard.partition
        if _offset(buffer[-1]) < end:
            msgs, ended = list(buffer), False
            buffer.clear()
        else:
            # the first record at or past `end`: offsets rise by one a record or more,
            # so it is at most `end - first` records in
            cut = max(0, min(len(buffer) - 1, end - _offset(buffer[0])))
            while cut > 0 and _offset(buffer[cut - 1]) >= end:
                cut -= 1
            msgs, ended = [buffer.popleft() for _ in range(cut)], True
        if self._buffered_bytes[p]:  # records kept while another partition was read
            self._buffered_bytes[p] = max(0, self._buffered_bytes[p] - sum(map(len, msgs)))
            if p in self._paused and self._buffered_bytes[p] < self.buffer_bytes // 2:
                self._resume(p)
        return msgs, ended

    def _fetch(self, ranges: Mapping[int, tuple[ev.StreamShard, int]]) -> None:
        """One `consume`: records go to their partitions' buffers (errors of a partition
        being read are raised, those of others kept for when they are read)."""
        for p in ranges:
            if p in self._failed:
                shard, offset = ranges[p]
                raise self._error(self._failed.pop(p), shard, offset)
        # what is fetched already, at once; else wait for the next record (a batch
        # `consume` would wait for a whole batch, holding fresh records back)
        got = self.consumer.consume(num_messages=self.batch, timeout=0)
        if not got:
            got = self.consumer.consume(num_messages=1, timeout=self.poll_s)
        # (librdkafka drops what it fetched before a seek: every record here is current)
        buffers = self._buffer
        before = {p: len(b) for p, b in buffers.items() if p not in ranges}
        for msg in got:  # the one loop over every record: kept to the least
            if msg.error() is None:
                buffers[msg.partition()].append(msg)  # type: ignore[index]
            else:
                self._failure(msg, ranges)
        for p, had in before.items():  # kept for later: counted against the buffer's bound
            buffer = buffers[p]
            if len(buffer) > had:
                self._buffered_bytes[p] += sum(map(len, islice(buffer, had, None)))
                bound = self.buffer_bytes if p in self._planned else self.buffer_bytes // 32
                if self._buffered_bytes[p] > bound:
                    self._pause(p)

    def _failure(self, msg: Message, ranges: Mapping[int, tuple[ev.StreamShard, int]]) -> None:
        """An error librdkafka delivered: raised if it is a partition being read's (or
        the consumer's), else kept for when that partition is read."""
        error, p = cast(KafkaError, msg.error()), msg.partition()
        if error.code() == KafkaError._PARTITION_EOF:
            return
        if p is None or p < 0:
            raise self._error(error, *next(iter(ranges.values())))
        if p in ranges:
            raise self._error(error, *ranges[p])
        self._failed[p] = error

    def _pause(self, p: int) -> None:
        if p not in self._paused:
            self.consumer.pause([TopicPartition(self.topic, p)])
            self._paused.add(p)

    def _resume(self, p: int) -> None:
        if p in self._paused:
            self.consumer.resume([TopicPartition(self.topic, p)])
            self._paused.discard(p)

    def _error(self, error: KafkaError, shard: ev.StreamShard, offset: int) -> DataError:
        if error.code() == KafkaError._AUTO_OFFSET_RESET:  # the offset is out of range
            try:
                low, _high = self.consumer.get_watermark_offsets(
                    TopicPartition(self.topic, shard.partition), timeout=10.0
                )
            except KafkaException as exc:
                return DataError(f"cannot read partition {shard.partition}: {exc.args[0]}")
            problem = expired(low, shard, offset)
            if problem is not None:
                return DataError(f"topic {self.topic}: {problem}")
        return DataError(f"topic {self.topic}, partition {shard.partition}: {error}")

    def _client_error(self, error: KafkaError) -> None:
        self.client_error = kafka_settings.kept_error(self.client_error, error)

    def close(self) -> None:
        self.consumer.close()
