"""A node whose clock is off from the master's is judged by when the master hears it,
and the times it stamps are read on the master's clock: one a few minutes behind trains
(it was declared lost at every join, and the job never formed); one a few minutes ahead
forms its round after the last call (not minutes later), is declared lost a node
timeout after it died (not minutes later), and leaves when the job it waits in ends
(it took the end for an earlier run's). On one NATS server and on a 3-node cluster."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from tests.support import TRAIN, Cluster, MasterProc, RunProc, job_events, patience, rove_cli

pytestmark = pytest.mark.slow

SKEWED = Path(__file__).parent / "scripts" / "skewed_clock"
SKEW_S = 180.0
TIMEOUT_S = 4


@pytest.fixture(params=["one server", "3-node cluster"])
def nats_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "one server":
        server = EmbeddedServer(tmp_path / "nats")
        server.start()
        assert server.url is not None
        yield server.url
        server.stop()
    else:
        cluster = Cluster(tmp_path / "cluster")
        cluster.start()
        yield cluster.url
        cluster.stop()


def _node(
    tmp_path: Path, url: str, job: str, node: str, skew: float, *train: str, nnodes: str = "2"
) -> RunProc:
    return RunProc(
        tmp_path,
        node,
        *("--nats", url, "--job", job, "--node-id", node, "--nnodes", nnodes),
        *("--max-restarts", "3", "--nproc-per-node", "1"),
        *(str(TRAIN), "--data", "generated", *train),
        env={
            "PYTHONPATH": os.pathsep.join([str(SKEWED), os.environ.get("PYTHONPATH", "")]),
            "ROVE_TEST_CLOCK_SKEW_S": str(skew),
        },
    )


async def _events(url: str, job: str) -> list[ev.Event]:
    bus = await Bus.connect(BusOptions(url=url))
    try:
        return await job_events(bus, job)
    finally:
        await bus.close()


async def test_a_node_whose_clock_is_minutes_behind_the_masters_trains(
    nats_url: str, tmp_path: Path
) -> None:
    job = "behind"
    master = MasterProc(nats_url, job, "m1", tmp_path, "--node-timeout", str(TIMEOUT_S))
    late = _node(tmp_path, nats_url, job, "n1", -SKEW_S, "--steps", "40")
    right = _node(tmp_path, nats_url, job, "n2", 0.0, "--steps", "40")
    assert right.wait(240) == 0, right.log()[-3000:]
    assert late.wait(60) == 0, late.log()[-3000:]
    events = await _events(nats_url, job)
    assert not [e for e in events if isinstance(e, ev.NodeLost)], "no node was lost"
    (done,) = [e for e in events if isinstance(e, ev.JobEnded)]
    assert done.phase is ev.JobPhase.FINISHED
    said = master.log()
    assert f"node n1's clock is {SKEW_S:.0f}" in said and "behind this master's" in said, said
    assert "node n2's clock" not in said
    master.stop()


async def test_a_node_minutes_ahead_forms_its_round_on_time_and_is_lost_on_time(
    nats_url: str, tmp_path: Path
) -> None:
    job = "ahead"
    master = MasterProc(nats_url, job, "m1", tmp_path, "--node-timeout", str(TIMEOUT_S))
    train = ("--steps", "100000", "--step-sleep", "0.05")
    early = _node(tmp_path, nats_url, job, "n1", SKEW_S, *train, nnodes="1:2")
    deadline = time.monotonic() + patience(180)
    while "step 20/" not in early.log():
        assert time.monotonic() < deadline, early.log()[-3000:] + master.log()[-3000:]
        time.sleep(0.2)
    # Its join is stamped three minutes ahead: read on the master's clock, the round of
    # one formed after the last call (5 s), not three minutes later
    events = await _events(nats_url, job)
    (asked, *_) = [e for e in events if isinstance(e, ev.RdzvJoined)]
    (formed, *_) = [e for e in events if isinstance(e, ev.RoundCompleted)]
    assert formed.ts < asked.ts - SKEW_S / 2, (formed.ts, asked.ts)
    early.kill()  # SIGKILL: no node_left; its workers die with it
    # Judged by its stamps (three minutes ahead), it was declared lost three minutes
    # after it died; judged by when it was last heard, a node timeout after
    deadline = time.monotonic() + patience(60)
    lost: list[ev.NodeLost] = []
    while not lost:
        assert time.monotonic() < deadline, master.log()[-3000:]
        time.sleep(0.5)
        lost = [e for e in await _events(nats_url, job) if isinstance(e, ev.NodeLost)]
    assert [e.node for e in lost] == ["n1"]
    assert lost[0].last_seen < time.time(), "when it was last heard, by the master's clock"
    master.stop()


async def test_a_node_minutes_ahead_leaves_when_the_job_it_waits_in_is_stopped(
    nats_url: str, tmp_path: Path
) -> None:
    job = "ahead-stop"
    master = MasterProc(nats_url, job, "m1", tmp_path)
    early = _node(tmp_path, nats_url, job, "n1", SKEW_S, "--steps", "40")  # (of 2 nodes)
    deadline = time.monotonic() + patience(60)
    while not [e for e in await _events(nats_url, job) if isinstance(e, ev.RdzvJoined)]:
        assert time.monotonic() < deadline, early.log()[-3000:] + master.log()[-3000:]
        time.sleep(0.2)
    rove_cli("stop", "--job", job, "--nats", nats_url, "--reason", "no second node", check=True)
    # The job's end is stamped three minutes before the node's start by its own clock:
    # it took that for the end of an earlier run and waited on, for ever
    assert early.wait(60) != 0, early.log()[-3000:]
    assert f"job {job} stopped: no second node" in early.log(), early.log()[-3000:]
    master.stop()
