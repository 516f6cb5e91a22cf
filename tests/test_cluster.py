"""A 3-node JetStream cluster: losing a node while publishing loses and doubles nothing."""

from __future__ import annotations

import asyncio

import pytest

from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import subjects
from tests import factories
from tests.support import Cluster, patience, stored_events

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # restarts a NATS node on its ports


async def test_kill_9_of_a_cluster_node_while_publishing_stores_every_event_once_in_order(
    nats_cluster: Cluster,
) -> None:
    bus = await Bus.connect(
        BusOptions(url=nats_cluster.url, replicas=3, reconnect_forever=True, lease_ttl_s=2)
    )
    try:
        info = await bus.js.stream_info(subjects.EVENTS_STREAM)
        assert info.config.num_replicas == 3
        leader = info.cluster.leader if info.cluster else None
        victim = next(n for n in nats_cluster.nodes if n.server_name == leader)

        sent = []

        async def publish_all() -> None:
            for i in range(400):
                event = factories.joined(f"n{i}", n=i)
                await bus.publish(event, deadline_s=30)
                sent.append(event)
                await asyncio.sleep(0.005)

        publisher = asyncio.create_task(publish_all())
        while len(sent) < 100:
            await asyncio.sleep(0.01)
        victim.kill()  # the stream leader dies mid-stream
        await asyncio.wait_for(publisher, patience(120))

        recs = await stored_events(bus)
        assert [r.event for r in recs] == sent, "each event once, in publish order"
        assert [r.seq for r in recs] == list(range(1, len(sent) + 1))
    finally:
        await bus.close()
