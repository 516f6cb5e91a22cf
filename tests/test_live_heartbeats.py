"""The leader reads live heartbeats through a core NATS subscription (the cheapest
path), the newest stored ones of every node when it starts following, and again after
its connection comes back: a heartbeat sent while it was cut off is not missed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from rove.control.bus import records
from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.master.replica import Replica
from tests import factories
from tests.factories import JOB
from tests.support import Cluster, eventually


class Relay:
    """A TCP relay to the server that can drop its connections and refuse new ones."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.open = True
        self.url = ""
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"nats://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.open = False
        for w in self._writers:
            w.close()
        self._writers = []

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def relay(nats_server: EmbeddedServer) -> AsyncIterator[Relay]:
    assert nats_server.url is not None
    r = Relay(int(nats_server.url.rsplit(":", 1)[1]))
    await r.start()
    yield r
    r.close()


async def test_a_heartbeat_sent_while_the_reader_was_cut_off_is_read_when_it_is_back(
    bus: Bus, relay: Relay
) -> None:
    reader = await Bus.connect(
        BusOptions(url=relay.url, create_streams=False, reconnect_forever=True)
    )
    replica = Replica(reader, JOB)
    try:
        await bus.publish(factories.heartbeat("n1", seq=1, ts=10.0))
        await replica.start()
        assert replica.liveness["n1"].seq == 1, "the newest stored, read on starting"
        await bus.publish(factories.heartbeat("n1", seq=2, ts=11.0))
        await eventually(lambda: replica.liveness["n1"].seq == 2)  # live

        relay.cut()
        await eventually(lambda: not reader.nc.is_connected)
        await bus.publish(factories.heartbeat("n1", seq=3, ts=12.0))
        await bus.publish(factories.heartbeat("n2", seq=1, ts=12.0))
        await asyncio.sleep(0.5)
        assert replica.liveness["n1"].seq == 2 and "n2" not in replica.liveness, "missed live"
        relay.heal()
        # nothing new is sent: what was sent while it was away is read from the stream
        await eventually(lambda: "n2" in replica.liveness, timeout=30)
        assert replica.liveness["n1"].seq == 3
        await bus.publish(factories.heartbeat("n1", seq=4, ts=13.0))
        await eventually(lambda: replica.liveness["n1"].seq == 4)  # and live again
    finally:
        await replica.stop()
        await reader.close()


async def test_on_a_3_node_cluster_heartbeats_sent_to_one_server_reach_a_reader_on_another(
    cluster_bus: Bus, shared_cluster: Cluster
) -> None:
    """As deployed: agents and the leader connected to different servers of the cluster."""
    first, _, third = (f"nats://127.0.0.1:{p}" for p in shared_cluster.client_ports)
    agent = await Bus.connect(BusOptions(url=first, create_streams=False))
    reader = await Bus.connect(BusOptions(url=third, create_streams=False))
    replica = Replica(reader, JOB)
    try:
        await agent.publish(factories.heartbeat("n1", seq=1))
        await replica.start()
        assert replica.liveness["n1"].seq == 1, "stored (R3), read from another server"
        sent = 1

        async def a_live_one_arrives() -> bool:
            # (until the subscription's interest has reached the other server: each one
            # after that arrives)
            nonlocal sent
            sent += 1
            await agent.publish(factories.heartbeat("n1", seq=sent))
            await asyncio.sleep(0.1)
            return replica.liveness["n1"].seq == sent

        await eventually(a_live_one_arrives)
        for _ in range(3):
            sent += 1
            await agent.publish(factories.heartbeat("n1", seq=sent))
            await eventually(lambda seq=sent: replica.liveness["n1"].seq == seq)
    finally:
        await replica.stop()
        await reader.close()
        await agent.close()


async def test_a_live_heartbeat_that_is_not_one_or_is_on_another_nodes_subject_is_ignored(
    bus: Bus,
) -> None:
    replica = Replica(bus, JOB)
    await replica.start()
    try:
        await bus.nc.publish(subjects.heartbeat(JOB, "n3"), b"\xc1 not msgpack")
        forged = ev.encode(factories.heartbeat("n4", seq=9))
        await bus.nc.publish(subjects.heartbeat(JOB, "n5"), forged)
        await bus.nc.publish(subjects.heartbeat(JOB, "n6"), ev.encode(factories.heartbeat("n6")))
        await eventually(lambda: "n6" in replica.liveness)
        assert set(replica.liveness) == {"n6"}
    finally:
        await replica.stop()


async def test_a_nodes_clock_off_is_measured_from_its_live_heartbeats(bus: Bus) -> None:
    """Arrival (the replica's clock) minus stamp, for the nodes off by `SKEW_SAID_S` or
    more: what the leader adds to their stamps (`skew`). A node whose clock is set right
    is dropped."""
    replica = Replica(bus, JOB, clock=lambda: 1000.0)
    await replica.start()
    try:
        for seq, ts in [(1, 940.0), (2, 941.5)]:  # a minute behind, then set a little
            await bus.nc.publish(
                subjects.heartbeat(JOB, "n1"), ev.encode(factories.heartbeat("n1", seq=seq, ts=ts))
            )
            await eventually(lambda seq=seq: _seq(replica, "n1") == seq)  # type: ignore[misc]
            assert replica.clock_off == {"n1": 1000.0 - ts}
        await bus.nc.publish(
            subjects.heartbeat(JOB, "n2"), ev.encode(factories.heartbeat("n2", ts=999.9))
        )
        await bus.nc.publish(
            subjects.heartbeat(JOB, "n1"), ev.encode(factories.heartbeat("n1", seq=3, ts=999.0))
        )
        await eventually(lambda: _seq(replica, "n1") == 3 and "n2" in replica.liveness)
        assert replica.clock_off == {}
    finally:
        await replica.stop()


def _seq(replica: Replica, node: str) -> int:
    hb = replica.liveness.get(node)
    return hb.seq if hb is not None else 0


def test_read_heartbeat_takes_what_read_takes() -> None:
    hb = factories.heartbeat("n1", seq=3)
    payload, subject = ev.encode(hb), subjects.heartbeat(JOB, "n1")
    assert records.read_heartbeat(JOB, subject, payload) == hb
    recorded = records.read(subjects.HEARTBEAT_STREAM, 1, subject, payload)
    assert isinstance(recorded, records.Recorded) and recorded.event == hb
    assert "arrived on" in str(records.read_heartbeat(JOB, subjects.heartbeat(JOB, "n2"), payload))
    assert "arrived on" in str(records.read_heartbeat("other", subject, payload))
    assert "not a rove heartbeat" in str(
        records.read_heartbeat(JOB, subject, ev.encode(factories.joined("n1")))
    )
    assert "not msgpack" in str(records.read_heartbeat(JOB, subject, b"\xc1"))


def test_a_leader_hears_from_its_last_reconnection_and_not_while_away() -> None:
    """`live.Hearing`: since when live heartbeats could reach this client. nats-py counts
    a reconnection, is connected, flushes, and only then calls back: a tick in between
    already hears from the reconnection, as does one that never saw the client away
    (it was blocked in a publish the whole outage)."""
    from types import SimpleNamespace

    from nats.aio.client import Client

    from rove.control.bus import live
    from rove.control.bus.natsclient import RoveNatsClient

    nc = RoveNatsClient()
    now = [100.0]
    hearing = live.Hearing(SimpleNamespace(nc=nc), lambda: now[0])  # type: ignore[arg-type]
    nc._status = Client.CONNECTED
    now[0] = 110.0
    assert hearing.since() == 100.0, "connected throughout"
    nc._status = Client.RECONNECTING
    now[0] = 120.0
    assert hearing.since() == 120.0, "away: nothing heard until now"

    def reconnect(at: float) -> None:
        now[0] = at
        nc.stats["reconnects"] += 1
        nc._status = Client.CONNECTED

    reconnect(130.0)
    now[0] = 131.0
    assert hearing.since() == 131.0, "reconnected, before the callback"
    now[0] = 135.0
    for listener in nc.reconnected:
        listener()
    now[0] = 200.0
    assert hearing.since() == 135.0
    reconnect(300.0)  # away and back without a look meanwhile
    now[0] = 301.0
    assert hearing.since() == 301.0
    hearing.close()
    assert nc.reconnected == []


async def test_a_leader_hears_afresh_after_its_loop_ran_nothing_not_after_a_slow_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pause is the loop running nothing (a SIGSTOP, a call that held it): nothing was
    read meanwhile, so silence counts from the wake. A tick that awaited long with the
    loop free (heartbeats read meanwhile) is no pause: the hearing used to start afresh
    at every tick of a leader whose ticks took over `PAUSED_S`, and no node could ever
    be found lost."""
    from types import SimpleNamespace

    from nats.aio.client import Client

    from rove.control.bus import live
    from rove.control.bus.natsclient import RoveNatsClient

    monkeypatch.setattr(live, "PAUSED_S", 0.6)
    monkeypatch.setattr(live, "BEAT_S", 0.05, raising=False)
    nc = RoveNatsClient()
    nc._status = Client.CONNECTED
    now = [100.0]
    hearing = live.Hearing(SimpleNamespace(nc=nc), lambda: now[0])  # type: ignore[arg-type]
    try:
        for at in (110.0, 120.0, 130.0):  # ticks 1.2 s apart, the loop free between them
            await asyncio.sleep(1.2)
            now[0] = at
            assert hearing.since() == 100.0, "a slow tick is no pause"
        now[0] = 140.0
        time.sleep(1.2)  # the loop held (as stopped): the tick's ask comes first after it
        assert hearing.since() == 140.0, "paused: heard only from the wake"
        now[0] = 150.0
        await asyncio.sleep(0.3)
        assert hearing.since() == 140.0
        now[0] = 160.0
        time.sleep(1.2)
        await asyncio.sleep(0.2)  # the loop's own stamp sees it first this time
        now[0] = 170.0
        assert hearing.since() == 160.0
    finally:
        hearing.close()
