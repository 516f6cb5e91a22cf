"""Exactly-once data across failures, with real processes.

A 2 nodes x 2 workers DDP job (examples/train_sharded.py) trains 2 epochs of
generated samples drawn from leased shards, with a flash checkpoint every
step. While it runs, the chaos kills (kill -9) a random worker, the leading
master (a standby takes over), and a whole agent (its workers die with it; the
job continues on one node, then the agent comes back and the job grows to two
nodes again), in an order and at times drawn from the seed. Every rank logs
the (epoch, index) of each sample it trained, with the step. Rebuilding the
lineage of the final model (a restored round discards the steps after the
step it restored), every index of every epoch must appear exactly once.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import time
from pathlib import Path

import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from tests.lineage import lineage, progress, rows
from tests.support import (
    ROOT,
    MasterProc,
    RunProc,
    chaos_seeds,
    eventually,
    finished,
    pid_alive,
    stored_events,
)

# the job's own end is bounded (with a diagnosis) by `finished`, inside this
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "examples" / "train_sharded.py"
SAMPLES, EPOCHS = 1500, 2
JOB = "chaos"


async def leader(bus: Bus) -> str:
    elected = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.MasterElected)
    ]
    return elected[-1].master if elected else ""


def random_plan(seed: int) -> list[tuple[str, int]]:
    rnd = random.Random(seed)
    actions = ["worker", "master", "agent"]
    rnd.shuffle(actions)
    total_steps = SAMPLES * EPOCHS // (4 * 8)  # about, at 4 ranks
    # In the first half: a killed agent's node comes back well before the job ends (one
    # back after the end would rightly start the job's next run, training it again).
    at = sorted(rnd.sample(range(total_steps // 6, total_steps // 2), 3))
    return list(zip(actions, at, strict=True))


@pytest.mark.parametrize("seed", chaos_seeds(11))
async def test_every_sample_once_per_epoch_through_worker_agent_and_master_kills(
    bus: Bus, tmp_path: Path, seed: int
) -> None:
    await chaos(bus, tmp_path, seed, random_plan(seed))


async def test_training_goes_on_while_no_master_leads(bus: Bus, tmp_path: Path) -> None:
    """The leading master dies a third into the first epoch. Until the standby is
    elected, the samplers train on shards they leased ahead: steps keep coming, also
    in the second half of the leaderless window."""
    steps_per_epoch = SAMPLES // (4 * 8)
    _, killed = await chaos(bus, tmp_path, 5, [("master", steps_per_epoch // 3)])
    elected = [
        r.event.ts
        for r in await stored_events(bus, JOB)
        if isinstance(r.event, ev.MasterElected) and r.event.ts > killed["master"]
    ]
    leaderless = (killed["master"], min(elected))
    times = [r["t"] for r in rows(tmp_path / "trace.jsonl") if "t" in r]
    middle = sum(leaderless) / 2
    assert any(leaderless[0] < t < middle for t in times), "steps right after the kill"
    assert any(middle < t < leaderless[1] for t in times), "and still before the new leader"


async def chaos(
    bus: Bus,
    tmp_path: Path,
    seed: int,
    plan: list[tuple[str, int]],
) -> tuple[list[int], dict[str, float]]:
    """Run the job, doing each (action, at step) of `plan` (kill a worker, the leading
    master or an agent); check the lineage, and that no master exited but those killed;
    return the world size of each round, and when each action was done."""
    rnd = random.Random(seed)
    trace = tmp_path / "trace.jsonl"
    masters = {
        m: MasterProc(bus.url, JOB, m, tmp_path, "--node-timeout", "4") for m in ("m1", "m2")
    }
    await eventually(lambda: leader(bus), timeout=30)

    def agent(node: str, name: str) -> RunProc:
        return RunProc(
            tmp_path,
            name,
            *("--nats", bus.url, "--job", JOB, "--node-id", node, "--local-addr", "127.0.0.1"),
            *("--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "30"),
            *("--heartbeat-interval", "0.5", "--last-call-timeout", "1"),
            *("--checkpoint-dir", str(tmp_path / "ckpt")),
            str(SCRIPT),
            *("--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--step-sleep", "0.12"),
            *("--seed", str(seed), "--trace", str(trace)),
            env={"ROVE_SHM_DIR": str(tmp_path / "shm")},  # (killed agents leave slots behind)
        )

    nodes = {"na": agent("na", "na-1"), "nb": agent("nb", "nb-1")}
    everyone = list(nodes.values())
    killed_master = ""
    done_actions = []
    killed: dict[str, float] = {}
    try:
        for action, when in plan:
            await eventually(lambda w=when: progress(trace) >= w, timeout=240)
            latest = max(r["round"] for r in rows(trace))
            killed.setdefault(action, time.time())
            if action == "worker":
                pids = sorted({r["pid"] for r in rows(trace) if r["round"] == latest})
                victim = rnd.choice([p for p in pids if pid_alive(p)] or pids)
                os.kill(victim, signal.SIGKILL)
                # the next action waits for this one's round: the poll above can see a step
                # a few steps late, and an agent killed while the round restarts would make
                # one round of two faults
                await eventually(
                    lambda seen=latest: max(r["round"] for r in rows(trace)) > seen, timeout=120
                )
            elif action == "master":
                name = killed_master = await leader(bus)
                masters[name].kill()
                fresh = f"m{len(masters) + 1}"
                masters[fresh] = MasterProc(bus.url, JOB, fresh, tmp_path, "--node-timeout", "4")
            else:
                node = rnd.choice(sorted(nodes))
                nodes[node].kill()
                # the job goes on with one node; then the node comes back
                await eventually(
                    lambda seen=latest: max(r["round"] for r in rows(trace)) > seen, timeout=120
                )
                nodes[node] = agent(node, f"{node}-2")
                everyone.append(nodes[node])
            done_actions.append(action)
        codes = await finished(bus, JOB, nodes, [*everyone, *masters.values()])
        assert codes == {"na": 0, "nb": 0}, {n: p.log()[-3000:] for n, p in nodes.items()}
        for name, m in masters.items():
            if name != killed_master:
                # (a master stops with 0 once the job has ended)
                assert m.proc.poll() in (None, 0), f"master {name} failed:\n{m.log()[-3000:]}"
                assert "Traceback" not in m.log(), f"master {name}:\n{m.log()[-3000:]}"
    finally:
        for p in everyone:
            p.stop()
        for m in masters.values():
            m.stop()

    assert done_actions == [a for a, _ in plan]
    trained = collections.Counter(lineage(trace))
    expected = {(e, i) for e in range(EPOCHS) for i in range(SAMPLES)}
    assert set(trained) == expected, f"missing: {sorted(expected - set(trained))[:10]}"
    repeated = {k: n for k, n in trained.items() if n > 1}
    assert not repeated, f"trained more than once in the lineage: {list(repeated.items())[:10]}"
    rounds = {r["round"] for r in rows(trace)}
    assert len(rounds) >= 1 + 2 * done_actions.count("agent") + done_actions.count("worker")
    restored = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.DataRestored)
    ]
    if {"worker", "agent"} & set(done_actions):
        assert any(e.step for e in restored), "a round resumed the data from a checkpoint"
    by_round = {r["round"]: r["world"] for r in rows(trace) if "world" in r}
    return [by_round[k] for k in sorted(by_round)], killed
