"""The job-following service base: follow the job, act on what is folded, publish facts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import structlog

from rove.control.bus import records
from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from rove.control.master.service import JobService
from tests import factories
from tests.support import eventually, nats_without_jetstream, patience, stored_events


class StopWhenTwoNodesJoined(JobService):
    """A toy service: once two nodes have joined, it asks the job to stop."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(bus, "j1", name="probe", tick_s=30.0)
        self.seen: list[str] = []

    def on_event(self, rec: records.Recorded) -> None:
        self.seen.append(ev.kind(rec.event))
        if isinstance(rec.event, ev.NodeJoined):
            self.wake()  # act now, not at the next 30 s tick

    async def serve(self) -> None:
        while not self.stopping:
            if len(self.state.nodes) >= 2:
                self.emit(
                    ev.StopRequested(
                        **ev.envelope("j1", "service:probe", self.clock(), "j1", "probe-stop"),
                        reason="two nodes are enough",
                    )
                )
                return
            await self.doze()


async def test_a_service_catches_up_acts_on_folded_events_and_publishes_facts(bus: Bus) -> None:
    await bus.publish(factories.joined("n1"))  # before the service starts: caught up
    service = StopWhenTwoNodesJoined(bus)
    task = asyncio.create_task(service.run())
    await eventually(lambda: service.seen, timeout=patience(10))  # (caught up)
    assert not task.done() and service.seen == ["node_joined"]
    await bus.publish(factories.joined("n2", n=1))
    await asyncio.wait_for(task, patience(10))  # woken by the fold, before its 30 s tick
    stops = [r.event for r in await stored_events(bus) if isinstance(r.event, ev.StopRequested)]
    assert [s.reason for s in stops] == ["two nodes are enough"]


async def test_stop_ends_a_dozing_service(bus: Bus) -> None:
    service = StopWhenTwoNodesJoined(bus)
    task = asyncio.create_task(service.run())
    await asyncio.sleep(0.2)
    service.stop()
    await asyncio.wait_for(task, patience(10))


@pytest.mark.parametrize("daemon", ["a job service", "a pool agent"])
async def test_stop_ends_a_daemon_still_waiting_for_jetstream(tmp_path: Path, daemon: str) -> None:
    """A daemon started while JetStream does not answer (here a server without it: the
    same wait as a cluster without quorum) waits however long: a master, scaler or
    bridge to follow its job, a pool agent for its pool's registry (a KV bucket).
    `stop()` (a daemon's first signal) ends that wait instead of being heard only once
    it is over; a pool agent stops without joining the pool."""
    from rove.agent.daemon import PoolDaemon

    with nats_without_jetstream() as port:
        bus = await Bus.connect(
            BusOptions(url=f"nats://127.0.0.1:{port}", create_streams=False, name="probe")
        )
        with structlog.testing.capture_logs() as said:
            if daemon == "a job service":
                service: StopWhenTwoNodesJoined | PoolDaemon = StopWhenTwoNodesJoined(bus)
                waits = "waiting for the bus: probe following"
            else:
                service = PoolDaemon(bus, "p1", "a1", state_dir=tmp_path / "state", standby=False)
                waits = "waiting for the bus: the registry of pool p1"
            task = asyncio.create_task(service.run())
            await eventually(lambda: any(waits in e["event"] for e in said), timeout=patience(30))
            assert not task.done()
            service.stop()
            await asyncio.wait_for(task, patience(10))
        assert task.exception() is None
        if isinstance(service, StopWhenTwoNodesJoined):
            assert service.seen == []
        await bus.close()
