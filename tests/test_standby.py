"""A standby master follows the job's events but not its heartbeats; it reads them
when it takes over (real nats-server, masters in this process)."""

from __future__ import annotations

import asyncio

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.master.runner import MasterRunner
from tests import factories
from tests.support import eventually


def runner(bus: Bus, master_id: str) -> MasterRunner:
    return MasterRunner(bus, "j1", master_id, ev.JobSpec(node_timeout_s=60), tick_s=0.05)


async def test_a_standby_reads_no_heartbeats_until_it_leads(any_bus: Bus) -> None:
    bus = any_bus
    leader, standby = runner(bus, "m1"), runner(bus, "m2")
    first = asyncio.create_task(leader.run())
    await eventually(lambda: leader.role == "leader")
    second = asyncio.create_task(standby.run())
    try:
        await eventually(lambda: standby.role == "standby")
        await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(5)])
        await bus.publish_many([factories.heartbeat(f"n{i}", seq=2) for i in range(5)])
        await eventually(lambda: len(leader.liveness) == 5)
        await eventually(lambda: len(standby.state.nodes) == 5)
        assert standby.liveness == {}, "a standby does not follow heartbeats"
        await bus.publish_many([factories.heartbeat("n1", seq=3)])
        await asyncio.sleep(0.3)
        assert standby.liveness == {}

        leader.stop()  # the standby takes over: it reads the newest heartbeat of each node
        await first
        await eventually(lambda: standby.role == "leader", timeout=60)
        await eventually(lambda: len(standby.liveness) == 5)
        assert standby.liveness["n1"].seq == 3
    finally:
        leader.stop()
        standby.stop()
        await asyncio.gather(first, second)


async def test_a_tick_longer_than_the_lease_does_not_depose_the_leader(bus: Bus) -> None:
    """A round of 25,000 members or a wave of lost nodes can make one tick long: the
    lease is renewed beside it, so the leader stays leader and nobody else is elected."""
    leader, standby = runner(bus, "m1"), runner(bus, "m2")
    _, ttl = await bus.lease_bucket()
    ticked = leader._tick
    slow_once = asyncio.Event()

    async def slow_tick(epoch: int) -> None:
        if not slow_once.is_set():
            slow_once.set()
            await asyncio.sleep(ttl * 2)  # e.g. a long publish of many parts
        await ticked(epoch)

    leader._tick = slow_tick  # type: ignore[method-assign]
    first = asyncio.create_task(leader.run())
    await eventually(lambda: leader.role == "leader")
    second = asyncio.create_task(standby.run())
    try:
        await eventually(lambda: slow_once.is_set())
        await asyncio.sleep(ttl * 2.5)
        assert leader.role == "leader" and standby.role == "standby"
        assert standby.state.epoch == leader.state.epoch == 1, "nobody else was elected"
    finally:
        leader.stop()
        standby.stop()
        await asyncio.gather(first, second)
