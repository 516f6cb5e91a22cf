"""A Kafka stream trained through rove: `rove kafka-bridge` cuts the topic, a real
`rove master` leases the shards, and a `StreamIterable` with two DataLoader worker
processes reads them from librdkafka's mock cluster. A run stops half-way and saves
its data position; a new round restores it: the two runs together deliver every
produced offset exactly once, and the record no decoder reads is skipped, counted
and named."""

from __future__ import annotations

import asyncio
import collections
from pathlib import Path
from typing import Any

import pytest
import torch

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.shard_service.kafka import Record
from tests import factories
from tests.kafkamock import KafkaCluster
from tests.support import BridgeProc, MasterProc, patience, stored_events

pytestmark = pytest.mark.slow

JOB = factories.JOB
PER_PARTITION = {0: 70, 1: 53}


def decode(record: Record) -> torch.Tensor:
    _topic, partition, offset = record.value.decode().split("/")  # type: ignore[union-attr]
    return torch.tensor([int(partition), int(offset)])


async def test_a_stream_resumed_from_its_position_delivers_every_offset_once(
    bus: Bus, kafka: KafkaCluster, tmp_path: Path
) -> None:
    from rove.shard_service.stream import StreamIterable

    await bus.publish(factories.joined("n0"))
    MasterProc(bus.url, JOB, "m1", tmp_path)
    for partition, n in PER_PARTITION.items():
        kafka.produce("clicks", partition, n // 2)
    kafka.garbage("clicks", 1)
    for partition, n in PER_PARTITION.items():
        kafka.produce("clicks", partition, n - n // 2)
    BridgeProc(
        bus.url,
        JOB,
        "b1",
        tmp_path,
        *("--bootstrap", kafka.bootstrap, "--topic", "clicks", "--shard-records", "8"),
        *("--linger", "0.3", "--poll", "0.2"),
    )
    garbage_offset = PER_PARTITION[1] // 2
    want = {(0, o) for o in range(PER_PARTITION[0])} | {
        (1, o) for o in range(PER_PARTITION[1] + 1) if o != garbage_offset
    }

    def make(round_: int) -> Any:
        return StreamIterable(
            "clicks",
            bootstrap=kafka.bootstrap,
            topic="clicks",
            decode=decode,
            nats=bus.url,
            job=JOB,
            round=round_,
        )

    def run(
        round_: int, state: dict[str, Any] | None, stop_after: int | None
    ) -> tuple[list[Any], dict[str, Any]]:
        data = make(round_)
        if state is not None:
            data.load_state_dict(state)
            # the produce time of the newest record saved comes back with the position
            assert data.newest_ts == state["newest_ts"] > 0
        # timeout: a batch not coming for this long fails the test (the stream never ends)
        loader = data.loader(batch_size=5, num_workers=2, lockstep=False, timeout=patience(20))
        seen: list[tuple[int, int]] = []
        try:
            for n, batch in enumerate(loader):
                assert [tuple(x) for x in batch.tolist()] == loader.last_delivered
                seen += loader.last_delivered
                if stop_after is not None and n == stop_after:
                    break
                if stop_after is None and want <= {*seen, *before_seen}:
                    break
        except RuntimeError as exc:  # the loader's timeout: report what did come
            assert "timed out" in str(exc)
        position = data.position()
        state_out = data.state_dict()
        # the saved done shards become the base: none is held one by one any more
        assert not data.done and data.position() == position
        data.close()
        return seen, state_out

    before_seen: list[tuple[int, int]] = []
    before, state = await asyncio.to_thread(run, 1, None, 9)  # 50 records in
    before_seen.extend(before)
    after, _ = await asyncio.to_thread(run, 2, state, None)
    count = collections.Counter(before + after)
    assert set(count) == want, sorted(want ^ set(count))[:20]
    assert set(count.values()) == {1}, [k for k, v in count.items() if v > 1][:10]
    restored = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.DataRestored)
    ]
    assert [(e.dataset, e.round) for e in restored][-1] == ("clicks", 2)
    # the record no decoder reads is a dead letter on the bus, naming where it is
    dead = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.RecordsUndecodable)
    ]
    assert [(e.dataset, e.partition, e.offsets, e.count) for e in dead] == [
        ("clicks", 1, (garbage_offset,), 1)
    ]
    assert "UnicodeDecodeError" in dead[0].error or "ValueError" in dead[0].error
