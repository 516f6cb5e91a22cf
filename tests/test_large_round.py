"""A master forms one round of 12,000 members from 12,000 joins through a real
nats-server with its default max_payload (1 MiB), and an agent that starts reading
afterwards (the newest message of each subject) finds it whole.

Whole, the round is about 1.6 MB of long Kubernetes-like node names: before it went in
parts a master crashed publishing it (`MaxPayloadError`) at about 11,000 nodes. (A
30,000-member round, 4 MB, crosses a real server in `tests/test_parts.py`; here the
master forms it from its joins, which costs a minute at 30,000 on a busy 2-core
machine, and 12,000 is past the cliff.)"""

from __future__ import annotations

import asyncio
import itertools

import nats.js.errors
import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import parts, subjects
from rove.control.master.runner import MasterRunner
from tests.factories import JOB
from tests.support import eventually

NODES = 12_000
#: a node name as long as rove takes (64), as Kubernetes node names run
LONG = "gke-training-pool-a100-highmem-8-{:05d}-7f9c2b1d-x4kq-europe-w4a1"
HOST = "gke-training-pool-a100-highmem-8-{:05d}-7f9c2b1d-x4kq.europe-west4-a.internal"


def _fact(i: int, what: str) -> dict[str, object]:
    node = LONG.format(i)
    return {
        "job": JOB,
        "id": ev.make_id(JOB, node, "inc", what),
        "producer": f"agent:{node}",
        "ts": 1000.0,
        "node": node,
        "incarnation": f"inc-{i:08x}",
    }


@pytest.mark.slow
async def test_a_master_forms_a_round_over_the_servers_max_payload_an_agent_reads_whole(
    bus: Bus,
) -> None:
    params = ev.RdzvParams(min_nodes=NODES, max_nodes=NODES, last_call_s=0.5)
    runner = MasterRunner(bus, JOB, "m1", ev.JobSpec(node_timeout_s=3600), tick_s=0.1)
    task = asyncio.create_task(runner.run())
    try:
        await eventually(lambda: runner.role == "leader", timeout=60)
        await bus.publish_many(
            ev.NodeJoined(**_fact(i, "joined"), host=HOST.format(i), pid=i, nproc_per_node=8)
            for i in range(NODES)
        )
        await bus.publish_many(
            ev.RdzvJoined(
                **_fact(i, "rdzv"),
                addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                nproc_per_node=8,
                ports=(29500, 29501),
                params=params,
            )
            for i in range(NODES)
        )
        await eventually(lambda: len(runner.state.rdzv.members) == NODES, timeout=240)
    finally:
        runner.stop()
        await task

    # an agent that starts now reads the newest message of each of the master's subjects
    newest: list[ev.Event] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.master(JOB, ">"),
        lambda rec: newest.append(rec.event),
        lambda rej: pytest.fail(f"a stored message was rejected: {rej}"),
        last_per_subject=True,
    )
    try:
        await feed.caught_up.wait()
    finally:
        await feed.stop()
    rounds = [e for e in newest if isinstance(e, ev.RoundCompleted)]
    assert len(rounds) == 1
    members = rounds[0].members
    assert [m.node for m in members] == [LONG.format(i) for i in range(NODES)]
    assert [m.first_rank for m in members] == [8 * i for i in range(NODES)]
    assert rounds[0].world_size == 8 * NODES

    # and it crossed in parts, none of them near the server's limit
    sizes = []
    for i in itertools.count():
        try:
            msg = await bus.js.get_last_msg(
                subjects.EVENTS_STREAM, subjects.part(JOB, "round_completed", i)
            )
        except nats.js.errors.NotFoundError:
            break
        sizes.append(len(msg.data or b""))
    assert sum(sizes) > 1024 * 1024, "over the server's max_payload, whole"
    assert max(sizes) <= parts.PART_BYTES + 4096
