"""Reading leased stream shards from Kafka (rove.shard_service.kafka) against librdkafka's
mock cluster: exactly the offset range, from a partly trained position, and records
lost to retention named instead of skipped."""

from __future__ import annotations

from typing import Any

import pytest

from rove.control.catalogue import events as ev
from rove.shard_service.kafka import RangeReader, expired
from rove.shard_service.keeper import DataError
from tests.kafkamock import KafkaCluster

pytestmark = pytest.mark.slow


def test_a_shard_is_read_exactly_and_a_partly_trained_one_resumes_at_its_position(
    kafka: KafkaCluster,
) -> None:
    kafka.produce("clicks", 2, 30)
    reader = RangeReader(kafka.bootstrap, "clicks", stall_s=30)
    try:
        got = list(reader.read(ev.StreamShard(2, 10, 20)))
        assert [r.offset for r in got] == list(range(10, 20))
        assert [r.position for r in got] == list(range(10))
        assert got[0].value == b"clicks/2/10" and got[0].ts > 0
        rest = list(reader.read(ev.StreamShard(2, 20, 30), offset=7))
        assert [r.value for r in rest] == [b"clicks/2/27", b"clicks/2/28", b"clicks/2/29"]
        assert list(reader.read(ev.StreamShard(2, 0, 5), offset=5)) == []
        # back to an earlier range: a seek, nothing fetched for the later one leaks in
        again = list(reader.read(ev.StreamShard(2, 0, 12)))
        assert [r.offset for r in again] == list(range(12))
        # the next range of the partition continues where the last ended
        assert [r.offset for r in reader.read(ev.StreamShard(2, 12, 15))] == [12, 13, 14]
    finally:
        reader.close()


def test_ranges_of_several_partitions_are_read_at_once_each_exactly_and_in_order(
    kafka: KafkaCluster,
) -> None:
    """`take` reads a range per partition as the records come; one that ends makes way
    for the partition's next range, which continues without a seek."""
    for p in range(3):
        kafka.produce("clicks", p, 40)
    reader = RangeReader(kafka.bootstrap, "clicks", stall_s=30)
    reading = {0: (ev.StreamShard(0, 0, 25), 0), 1: (ev.StreamShard(1, 5, 40), 3)}
    reading[2] = (ev.StreamShard(2, 30, 30), 0)  # an empty range ends at once
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    ended: list[int] = []
    try:
        while reading:
            for p, msgs, whole in reader.take(reading):
                offsets = [m.offset() for m in msgs]
                assert offsets == sorted(offsets) and not (set(offsets) & set(got[p]))
                got[p] += offsets
                if whole:
                    ended.append(p)
                    del reading[p]
                    if p == 0 and got[0][-1] == 24:  # partition 0's next range follows
                        reading[0] = (ev.StreamShard(0, 25, 40), 0)
        assert got == {0: list(range(40)), 1: list(range(8, 40)), 2: []}
        assert ended[0] == 2 and sorted(ended) == [0, 0, 1, 2]
        assert not any(reader._buffer.values()), "no record is left waiting"
    finally:
        reader.close()


def test_a_partitions_next_ranges_follow_the_one_being_read_without_fetching_twice(
    kafka: KafkaCluster,
) -> None:
    """As a loader worker does: the ranges held are prepared, the range being read of
    each partition first. The next ranges continue where it ends: no seek, so no
    record is fetched twice."""
    kafka.produce("clicks", 0, 60)
    reader = RangeReader(kafka.bootstrap, "clicks", stall_s=30)
    fetched = 0
    consume = reader.consumer.consume

    class Counting:
        def consume(self, num_messages: int, timeout: float) -> list[Any]:
            nonlocal fetched
            got = consume(num_messages=num_messages, timeout=timeout)
            fetched += len(got)
            return got

        def __getattr__(self, name: str) -> Any:
            return getattr(reader.consumer_, name)

    reader.consumer_ = reader.consumer  # type: ignore[attr-defined]
    reader.consumer = Counting()  # type: ignore[assignment]
    held = [(ev.StreamShard(0, a, a + 15), 0) for a in range(0, 60, 15)]
    read: list[int] = []
    try:
        while held:
            reader.prepare(held)
            for _p, msgs, ended in reader.take({0: held[0]}):
                read += [m.offset() for m in msgs]
                if ended:
                    held.pop(0)
        assert read == list(range(60))
        assert fetched == 60, "a record fetched twice: the next range was seeked to early"
    finally:
        reader.consumer = reader.consumer_  # type: ignore[attr-defined]
        reader.close()


def test_records_not_produced_yet_are_waited_for_then_a_stall_is_an_error(
    kafka: KafkaCluster,
) -> None:
    kafka.produce("clicks", 0, 3)
    reader = RangeReader(kafka.bootstrap, "clicks", poll_s=0.2, stall_s=1.0)
    try:
        with pytest.raises(DataError, match="no record of partition 0 came for 1s"):
            list(reader.read(ev.StreamShard(0, 0, 10)))
    finally:
        reader.close()


def test_a_range_retention_deleted_is_an_error_naming_its_records_not_a_silent_jump(
    kafka: KafkaCluster,
) -> None:
    """librdkafka's mock keeps a few MB per partition and deletes older records, as
    retention does: reading a range it deleted fails, naming the records."""
    kafka.produce("clicks", 3, 20)
    kafka.bulk("clicks", 3, 120, 100_000)  # ~12 MB: the first records go
    reader = RangeReader(kafka.bootstrap, "clicks", stall_s=30)
    try:
        with pytest.raises(DataError, match=r"records 5\.\.\d+ of partition 3 were deleted"):
            list(reader.read(ev.StreamShard(3, 0, 20), offset=5))
    finally:
        reader.close()


def test_records_deleted_by_retention_are_an_error_naming_them() -> None:
    shard = ev.StreamShard(1, 100, 200)
    assert expired(100, shard, 0) is None
    assert expired(150, shard, 60) is None
    said = expired(150, shard, 20)
    assert said is not None and "records 120..149 of partition 1 were deleted" in said
    assert "raise the retention" in said
