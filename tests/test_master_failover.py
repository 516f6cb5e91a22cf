"""Masters as real processes: one leader and standbys, kill -9 failover, SIGSTOP fencing."""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path

import pytest

from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain import goodput as gp
from rove.control.master import snapshots
from rove.control.master.election import current_holder
from rove.control.master.state import NodeStatus
from tests.conftest import TEST_LEASE_TTL
from tests.support import (
    Agents,
    Cluster,
    MasterProc,
    eventually,
    fold_records,
    patience,
    stored_events,
)

pytestmark = pytest.mark.slow

NODE_TIMEOUT = 1.5
MARGIN = 4.0


def start_masters(url: str, tmp_path: Path, *ids: str) -> dict[str, MasterProc]:
    args = ("--node-timeout", str(NODE_TIMEOUT), "--snapshot-every", "50")
    return {i: MasterProc(url, "j1", i, tmp_path, *args) for i in ids}


async def leader_of(bus: Bus) -> str:
    kv, _ = await bus.lease_bucket()

    async def holder() -> str | None:
        h = await current_holder(kv, subjects.lease_key("j1"))
        return h.master if h else None

    return str(await eventually(holder, timeout=30))


async def elections(bus: Bus) -> list[tuple[int, ev.MasterElected]]:
    return [
        (r.seq, r.event) for r in await stored_events(bus) if isinstance(r.event, ev.MasterElected)
    ]


async def test_kill_9_of_the_leader_hands_over_to_a_standby_with_nothing_lost_or_doubled(
    bus: Bus, tmp_path: Path
) -> None:
    masters = start_masters(bus.url, tmp_path, "ma", "mb")
    agents = Agents(bus)
    try:
        first = await leader_of(bus)
        standby = next(m for m in masters if m != first)
        await eventually(lambda: "master is following the job" in masters[standby].log())
        await agents.steady("s1", "s2", "s3")
        churn = agents.start_churn(every=0.1)
        await asyncio.sleep(3.0)  # decisions flowing: churn nodes are being declared lost

        masters[first].kill()
        killed_at = time.time()
        await asyncio.sleep(3.0)  # events keep flowing with no leader, then to the new one
        churned = await agents.stop_churn(churn)

        new = await eventually(
            lambda: _elected_after(bus, first), timeout=TEST_LEASE_TTL + MARGIN + 10
        )
        assert new.master == standby
        assert new.ts - killed_at <= TEST_LEASE_TTL + MARGIN, (
            "standby took over within TTL + margin"
        )

        async def all_churn_lost() -> bool:
            state = fold_records(await stored_events(bus))
            return all(state.nodes[n].status is NodeStatus.LOST for n in churned)

        await eventually(all_churn_lost, timeout=30)
        recs = await stored_events(bus)
        lost = collections.Counter(r.event.node for r in recs if isinstance(r.event, ev.NodeLost))
        assert set(lost) == set(churned), "every silent node was declared lost, none forgotten"
        assert max(lost.values()) == 1, "no decision was recorded twice"
        assert not {"s1", "s2", "s3"} & set(lost), "heartbeating nodes were never declared lost"

        (_, old), (new_seq, newer) = (await elections(bus))[-2:]
        assert old.master == first and newer.master == standby and newer.epoch > old.epoch
        stale = [
            r
            for r in recs
            if isinstance(r.event, ev.Decision) and r.seq > new_seq and r.event.epoch != newer.epoch
        ]
        assert stale == [], "no write of the dead leader's epoch after the new election"
        assert "elected leader" in masters[standby].log()
    finally:
        await agents.stop()
        codes = {m: p.stop() for m, p in masters.items()}
    assert codes[standby] == 0

    # The new leader's final snapshot equals an independent fold of the stream prefix,
    # and so does the goodput ledger it carries.
    loaded = await snapshots.load(bus, "j1")
    assert loaded is not None and loaded.state.leader == standby
    snap = loaded.state
    recs = await stored_events(bus)
    assert snap == fold_records(recs, upto=snap.applied_seq)
    prefix = [r.event for r in recs if r.seq <= snap.applied_seq]
    assert loaded.goodput == gp.of_events(prefix)


async def _elected_after(bus: Bus, old_master: str) -> ev.MasterElected | None:
    found = [e for _, e in await elections(bus) if e.master != old_master]
    return found[-1] if found else None


async def test_two_masters_give_one_leader_and_one_standby(bus: Bus, tmp_path: Path) -> None:
    masters = start_masters(bus.url, tmp_path, "m1", "m2")
    try:
        leader = await leader_of(bus)
        other = next(m for m in masters if m != leader)
        await eventually(lambda: "master is following the job" in masters[other].log())
        await asyncio.sleep(TEST_LEASE_TTL * 2)
        assert [e.master for _, e in await elections(bus)] == [leader]
        assert "elected leader" not in masters[other].log()
        assert await leader_of(bus) == leader
    finally:
        for p in masters.values():
            p.stop()


async def test_a_paused_leader_is_fenced_by_the_server_and_steps_down(
    bus: Bus, tmp_path: Path
) -> None:
    masters = start_masters(bus.url, tmp_path, "pa", "pb")
    agents = Agents(bus)
    try:
        paused = await leader_of(bus)
        other = next(m for m in masters if m != paused)
        await eventually(lambda: "master is following the job" in masters[other].log())
        await agents.steady("s1", "quiet")
        await asyncio.sleep(NODE_TIMEOUT + 0.5)  # the leader has seen both nodes alive

        agents.silent.add("quiet")  # the paused leader will find "quiet" lost when it wakes
        masters[paused].pause()
        new = await eventually(lambda: _elected_after(bus, paused), timeout=TEST_LEASE_TTL + 15)
        assert new.master == other
        await asyncio.sleep(NODE_TIMEOUT + 0.5)
        masters[paused].resume()

        await eventually(
            lambda: "deposed: stepping down to standby" in masters[paused].log(), timeout=15
        )
        recs = await stored_events(bus)
        new_seq = next(r.seq for r in recs if r.event == new)
        from_paused = [
            r
            for r in recs
            if r.seq > new_seq
            and isinstance(r.event, ev.Decision)
            and r.event.producer == f"master:{paused}"
        ]
        assert from_paused == [], "the server stored nothing the deposed leader wrote"
        assert await leader_of(bus) == other
        assert masters[paused].proc.poll() is None, "it stays up as a standby"

        # ... and it is a working standby: kill the new leader, the old one leads again.
        masters[other].kill()
        back = await eventually(lambda: _elected_after(bus, other), timeout=TEST_LEASE_TTL + 15)
        assert back.master == paused
    finally:
        await agents.stop()
        for p in masters.values():
            p.stop()


async def test_an_in_process_master_that_crashes_is_restarted_and_leads(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rove.control.master import runner as runner_module

    real_run = runner_module.MasterRunner.run
    calls = []

    async def crash_once(self: runner_module.MasterRunner) -> None:
        calls.append(self)
        if len(calls) == 1:
            raise RuntimeError("a bug in the master")
        await real_run(self)

    monkeypatch.setattr(runner_module.MasterRunner, "run", crash_once)
    supervised = runner_module.SupervisedMaster(bus, "j1", "m1", ev.JobSpec())
    task = asyncio.create_task(supervised.run())
    try:
        await eventually(
            lambda: supervised.runner is not None and supervised.runner.role == "leader"
        )
        assert len(calls) == 2, "restarted once after the crash"
    finally:
        supervised.stop()
        await asyncio.wait_for(task, patience(30))


async def test_a_leader_puts_the_memory_streams_back_as_its_one_server_restarts(
    tmp_path: Path,
) -> None:
    """An external single server restarted (an upgrade, a crash) has lost its memory
    streams. The leader puts them back as it reconnects, and leads on: before, nothing
    did until a lease failed to publish for 10 s and the leader stepped down to lead
    again, and a job with no lease to send had no answers stream at all."""
    import nats.js.errors

    from rove.control.bus.embedded import EmbeddedServer
    from rove.control.master.runner import MasterRunner
    from tests.support import free_port

    server = EmbeddedServer(tmp_path / "nats", port=free_port())
    server.start()
    bus = await Bus.connect(BusOptions(url=server.url, reconnect_forever=True))
    runner = MasterRunner(bus, "j1", "m1", ev.JobSpec(node_timeout_s=600), tick_s=0.05)
    task = asyncio.create_task(runner.run())

    async def answers_stream() -> bool:
        try:
            await bus.js.stream_info(subjects.ANSWER_STREAM)
        except nats.js.errors.NotFoundError:
            return False
        return True

    try:
        await eventually(lambda: runner.role == "leader", timeout=30)
        server.kill()
        await asyncio.to_thread(server.start)  # its port, its store: the memory is gone
        await eventually(answers_stream, timeout=30)
        assert runner.role == "leader"
        assert len(await elections(bus)) == 1, "put back by the leader, not a new election"
    finally:
        runner.stop()
        await task
        await bus.close()
        server.stop()


@pytest.mark.restarts_nats
@pytest.mark.xdist_group("nats-b")
async def test_a_leader_cut_off_from_nats_past_the_node_timeout_loses_no_live_node(
    tmp_path: Path,
) -> None:
    """The server is down for three node timeouts; the node beats again once it is back.
    Its silence was the leader's own deafness: the leader counts it from its reconnection.
    Before, it declared the node lost as it reconnected (every node of a real job, whose
    workers had trained on throughout, after a 3-node cluster restarted at once)."""
    from rove.control.bus.embedded import EmbeddedServer
    from rove.control.master.runner import MasterRunner
    from tests.support import free_port

    timeout = 2.0
    server = EmbeddedServer(tmp_path / "nats", port=free_port())
    server.start()
    # (the leader keeps its lease through the outage: a new leader waits a timeout anyway)
    options = BusOptions(url=server.url, reconnect_forever=True, lease_ttl_s=60)
    bus = await Bus.connect(options)
    runner = MasterRunner(bus, "j1", "m1", ev.JobSpec(node_timeout_s=timeout), tick_s=0.05)
    task = asyncio.create_task(runner.run())
    agents = Agents(bus, deadline_s=1.0)  # as an agent: a fresh heartbeat when one fails
    try:
        await eventually(lambda: runner.role == "leader", timeout=30)
        await agents.steady("n1")
        await eventually(lambda: "n1" in runner.replica.liveness, timeout=30)
        server.kill()
        await asyncio.sleep(3 * timeout)  # (the fault: the node's heartbeats reach nobody)
        await asyncio.to_thread(server.start)
        back = time.time()

        def beating_again() -> bool:
            hb = runner.replica.liveness.get("n1")
            return hb is not None and hb.ts > back

        await eventually(beating_again, timeout=30)
        # two node timeouts of ticks after the reconnection, the node beating throughout
        await eventually(lambda: time.time() > back + 2 * timeout, timeout=30)
        assert not task.done()
        lost = [r.event for r in await stored_events(bus) if isinstance(r.event, ev.NodeLost)]
        assert lost == [], "a node that beat again was declared lost as the leader reconnected"
        assert runner.role == "leader"
    finally:
        await agents.stop()
        runner.stop()
        await task
        await bus.close()
        server.stop()


@pytest.mark.restarts_nats
@pytest.mark.xdist_group("nats-b")
async def test_a_master_started_while_the_cluster_has_no_quorum_waits_and_then_leads(
    nats_cluster: Cluster, tmp_path: Path
) -> None:
    """(It exited with ServiceUnavailableError, 10008, from its replica's subscribe.)"""
    bus = await Bus.connect(BusOptions(url=nats_cluster.url, replicas=3))
    await bus.close()  # the streams exist, on three servers
    for node in nats_cluster.nodes[1:]:
        node.kill()  # two of three: JetStream has no quorum
    master = MasterProc(nats_cluster.url, "j1", "m1", tmp_path)
    await eventually(lambda: "waiting for the bus" in master.log(), timeout=60)
    await asyncio.sleep(3)
    assert master.proc.poll() is None, master.log()[-3000:]
    for node in nats_cluster.nodes[1:]:
        node.start()
    await eventually(lambda: "elected leader" in master.log(), timeout=90)
    assert master.proc.poll() is None
    master.stop()
