"""Two agents under one node id (two `rove run` on one machine without `--node-id`, or
machines with the same host name): the newest takes the node's place and the older one
leaves, saying why, where both had waited for each other without end. On one server and
on the 3-node cluster users deploy."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from tests.support import TRAIN, MasterProc, RunProc, eventually, job_events

pytestmark = pytest.mark.slow


async def test_a_second_agent_under_a_node_id_takes_its_place_and_the_first_says_why(
    any_bus: Bus, tmp_path: Path
) -> None:
    job = "twins"
    MasterProc(any_bus.url, job, "m1", tmp_path)
    flags = ("--nats", any_bus.url, "--job", job, "--nnodes", "2", "--nproc-per-node", "1")

    def node(name: str, node_id: str) -> RunProc:
        return RunProc(tmp_path, name, *flags, "--node-id", node_id, str(TRAIN), "--steps", "3")

    async def joined() -> list[ev.NodeJoined]:
        return [e for e in await job_events(any_bus, job) if isinstance(e, ev.NodeJoined)]

    first = node("first", "twin")
    await eventually(joined, timeout=60)  # (the second joins after it: the newer one)
    second = node("second", "twin")
    assert await asyncio.to_thread(first.wait, 120) == 1, first.log()[-3000:]
    said = first.log()
    assert (
        f"another agent joined job {job} as node twin (pid {second.proc.pid} on " in said
        and "need their own --node-id" in said
    ), said[-3000:]
    other = node("other", "other")  # the second one waited on: a second node ends its wait
    assert await asyncio.to_thread(second.wait, 180) == 0, second.log()[-3000:]
    assert await asyncio.to_thread(other.wait, 180) == 0, other.log()[-3000:]
    events = await job_events(any_bus, job)
    by_pid = {e.pid: e.incarnation for e in events if isinstance(e, ev.NodeJoined)}
    told = [e for e in events if isinstance(e, ev.NodeReplaced)]
    assert [(t.node, t.incarnation, t.by_incarnation) for t in told] == [
        ("twin", by_pid[first.proc.pid], by_pid[second.proc.pid])
    ]
    (last,) = [e for e in events if isinstance(e, ev.RoundCompleted)]
    assert sorted((m.node, m.incarnation) for m in last.members) == sorted(
        [("twin", by_pid[second.proc.pid]), ("other", by_pid[other.proc.pid])]
    )
