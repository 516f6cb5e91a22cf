"""TensorFlow parameter-server jobs through failures, with real processes: a `rove master`
and a `rove run --tf-ps` node running a chief (examples/tf_ps.py), one parameter server
and two workers on loopback, over a real nats-server.

One job takes three kills in turn: a worker (restarted in place: no new round, the
same chief), the parameter server (a new round, its tasks from spares that imported
TensorFlow before the failure: the chief restores its checkpoint and the loss goes on
from there), then the chief (the same). In the lineage of the final
model, every sample of the data set was trained exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import os
import re
import signal
from pathlib import Path
from typing import TypeVar

import psutil
import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.control.master import data as data_fold
from tests.lineage import lineage, rows
from tests.support import (
    ROOT,
    MasterProc,
    RunProc,
    eventually,
    finished,
    fold_records,
    rove_cli,
    stored_events,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "examples" / "tf_ps.py"
SAMPLES, SHARD = 9600, 96  # 100 shards
E = TypeVar("E")


def node(
    tmp_path: Path, bus: Bus, job: str, script: Path, *args: str, name: str = "n0", nodes: int = 1
) -> RunProc:
    return RunProc(
        tmp_path,
        name,
        *("--nats", bus.url, "--job", job, "--node-id", name, "--local-addr", "127.0.0.1"),
        *("--tf-ps", "--num-ps", "1", "--nproc-per-node", str(4 // nodes), "--nnodes", str(nodes)),
        *("--max-restarts", "5", "--last-call-timeout", "1"),
        *("--heartbeat-interval", "0.5", "--checkpoint-dir", str(tmp_path / "ckpt")),
        str(script),
        *args,
        # (a temporary folder of the test's own: what the job leaves there is checked)
        env={"TF_CPP_MIN_LOG_LEVEL": "2", "TMPDIR": str(scratch(tmp_path))},
    )


def scratch(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir(exist_ok=True)
    return path


async def events_of(bus: Bus, job: str, kind: type[E]) -> list[E]:
    return [r.event for r in await stored_events(bus, job) if isinstance(r.event, kind)]


async def started(bus: Bus, job: str) -> list[ev.WorkersStarted]:
    return await events_of(bus, job, ev.WorkersStarted)


async def pids_by_rank(bus: Bus, job: str, round_: int) -> dict[int, int]:
    """Each rank's task pid in `round_`, over every node (ranks follow join order)."""
    return {
        rank: pid
        for e in await started(bus, job)
        if e.round == round_
        for rank, pid in zip(e.ranks, e.pids, strict=True)
    }


def steps(trace: Path) -> int:
    return max((r["step"] for r in rows(trace) if "step" in r), default=0)


async def test_a_worker_a_parameter_server_and_the_chief_killed_in_turn_train_each_sample_once(
    bus: Bus, tmp_path: Path
) -> None:
    """Two nodes of two processes: the first to join runs the chief and the parameter
    server, the other the two workers."""
    job = "tf-chaos"
    trace = tmp_path / "trace.jsonl"
    master = MasterProc(bus.url, job, "m1", tmp_path, "--node-timeout", "10")
    args = (
        *("--samples", str(SAMPLES), "--shard-size", str(SHARD), "--window", "4"),
        *("--trace", str(trace)),
    )
    runs = {n: node(tmp_path, bus, job, SCRIPT, *args, name=n, nodes=2) for n in ("n0", "n1")}
    try:
        # 1. a worker: restarted in place, nothing else
        await eventually(lambda: steps(trace) >= 12, timeout=240)
        ranks = await pids_by_rank(bus, job, 1)
        chief, ps, worker0 = ranks[0], ranks[1], ranks[2]
        os.kill(worker0, signal.SIGKILL)
        at = steps(trace)
        await eventually(lambda: steps(trace) >= at + 12, timeout=240)
        events = [r.event for r in await stored_events(bus, job)]
        restarts = [e for e in events if isinstance(e, ev.TaskRestarted)]
        assert [(e.role, e.index, e.kind) for e in restarts] == [
            ("worker", 0, ev.FailureKind.KILLED)
        ]
        assert len(await started(bus, job)) == 2, "no new round for a worker"
        assert os.kill(chief, 0) is None and os.kill(ps, 0) is None, "the rest untouched"
        # The restarted worker took one of its node's spares; the next round (below) is
        # to start every task from a spare, so the node must have them all again first.
        # It starts the new one once the restarted worker serves: on busy cores, more
        # than 12 steps after the kill (the other worker trains on meanwhile).
        at_workers = next(r for r in runs.values() if "worker 0 ended (killed" in r.log())
        await eventually(
            lambda: at_workers.log().count("TensorFlow spares ready to start") >= 2, timeout=240
        )

        # 2. the parameter server: a new round, restored from the last checkpoint
        os.kill(ps, signal.SIGKILL)
        await eventually(lambda: len({r["round"] for r in rows(trace)}) >= 2, timeout=240)
        at = steps(trace)
        await eventually(lambda: steps(trace) >= at + 8, timeout=240)
        # every task of the new round, on both nodes, is a spare (rove.agent.tf_spare):
        # a process started before the master decided the round, not at its start
        decided = [e.ts for e in await events_of(bus, job, ev.RoundCompleted) if e.round == 2]
        born = {
            r: psutil.Process(p).create_time() for r, p in (await pids_by_rank(bus, job, 2)).items()
        }
        assert sorted(born) == [0, 1, 2, 3], born
        assert all(t < decided[0] for t in born.values()), (born, decided)
        # each task (and each spare) leads a session of its own, as torch's workers do: a
        # terminal's Ctrl-C reaches it once, through rove (the chief printed two
        # KeyboardInterrupt tracebacks: the terminal's and rove's)
        assert all(os.getsid(p) == p for p in (await pids_by_rank(bus, job, 2)).values())
        # 3. the chief: the same
        os.kill((await pids_by_rank(bus, job, 2))[0], signal.SIGKILL)
        codes = await finished(bus, job, runs, [*runs.values(), master])
        assert codes == {"n0": 0, "n1": 0}, {n: r.log()[-3000:] for n, r in runs.items()}
    finally:
        for r in runs.values():
            r.stop()
        master.stop()

    stored = await stored_events(bus, job)
    events = [r.event for r in stored]
    rounds = [e for e in events if isinstance(e, ev.RoundCompleted)]
    assert len(rounds) == 3, [(r.round, r.reason) for r in rounds]
    # the killed tasks' autograph files went with their node's temporary folder (they
    # were left in /tmp, a few at every kill)
    assert sorted(p.name for p in scratch(tmp_path).iterdir()) == []
    # the master holds every shard done: each acknowledged once a checkpoint covered it
    data = fold_records(stored, job).data
    ds = data.datasets["tf-regression"]
    assert data_fold.done_count(data, ds) == shards.total(ds.spec) == SAMPLES // SHARD
    tasks = rounds[-1].tasks  # the first node to join runs the chief and the PS
    assert [t.role for t in tasks] == ["chief", "ps", "worker", "worker"]
    assert tasks[0].node == tasks[1].node != tasks[2].node == tasks[3].node
    exits = [e for e in events if isinstance(e, ev.WorkerExited)]
    assert [e.reason.split(":")[0] for e in exits] == ["parameter server 0", "the chief"]
    restored = [r["restored"] for r in rows(trace) if "restored" in r]
    assert restored[0] == 0 and all(s > 0 for s in restored[1:]), restored
    count = collections.Counter(lineage(trace))
    every = {(0, i) for i in range(SAMPLES)}
    assert set(count) == every, f"missing: {sorted(every - set(count))[:10]}"
    assert {k: n for k, n in count.items() if n > 1} == {}, "trained twice in the lineage"
    # the loss goes on from the checkpoint after each restore (it does not start over)
    chief_log = runs[tasks[0].node].log()
    losses = [float(x) for x in re.findall(r"\[chief\] step \d+ +loss ([\d.]+)", chief_log)]
    assert losses[0] > 0.5 and max(losses[len(losses) // 2 :]) < losses[0] / 4, losses


async def test_a_chief_that_fails_in_its_own_code_again_and_again_fails_the_job_fast(
    bus: Bus, tmp_path: Path
) -> None:
    job = "tf-broken"
    script = tmp_path / "broken.py"
    script.write_text("raise ValueError('the learning rate must be positive, got -1')\n")
    master = MasterProc(bus.url, job, "m1", tmp_path)
    run = node(tmp_path, bus, job, script)
    try:
        codes = await finished(bus, job, {"n0": run}, [run, master])
    finally:
        run.stop()
        master.stop()
    assert codes == {"n0": 1}
    events = [r.event for r in await stored_events(bus, job)]
    (ended,) = [e for e in events if isinstance(e, ev.JobEnded)]
    assert ended.phase is ev.JobPhase.FAILED
    assert "ValueError: the learning rate must be positive, got -1" in ended.reason
    assert len([e for e in events if isinstance(e, ev.RoundCompleted)]) == 2, "one retry only"


def test_a_managed_job_starts_its_parameter_server_on_a_node_of_its_own(tmp_path: Path) -> None:
    """`rove run --standalone --auto-scale --ps-node-cpu 1`: the scaler starts the
    parameter server's node (one process, `--tf-role ps`) apart from the chief's and
    the worker's, and the round places the tasks so."""
    import json

    from tests.support import rove_cli

    env = {"ROVE_HOME": str(tmp_path / "home"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    run = rove_cli(
        *("run", "--standalone", "--auto-scale", "--job", "tfm", "--nnodes", "2"),
        *("--nproc-per-node", "2", "--tf-ps", "--num-ps", "1", "--ps-node-cpu", "1"),
        *("--max-restarts", "2", "--checkpoint-dir", str(tmp_path / "ckpt")),
        *(str(SCRIPT), "--samples", "2000"),
        timeout=240,
        env=env,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = rove_cli("events", "--job", "tfm", "--type", "round_completed", "--json", env=env)
    [first, *_] = [json.loads(line) for line in out.stdout.splitlines()]
    placed = {(t[0], t[3]) for t in first["tasks"]}  # (role, node)
    assert placed == {("ps", "n0-a0"), ("chief", "n1-a0"), ("worker", "n1-a0")}, first
    plans = rove_cli("events", "--job", "tfm", "--type", "scale_plan", "--json", env=env)
    [initial, *_] = [json.loads(line) for line in plans.stdout.splitlines()]
    assert [(n["node"], n.get("role", "")) for n in initial["launch"]] == [
        ("n0-a0", "ps"),
        ("n1-a0", ""),
    ]


async def test_a_ctrl_c_ends_the_parameter_servers_and_workers_at_once(tmp_path: Path) -> None:
    """rove run passes a Ctrl-C on as SIGINT: the servers, waiting inside TensorFlow's
    join where Python's handler never runs, waited out the 10 s grace for a SIGKILL."""
    job = RunProc(
        tmp_path,
        "tfint",
        *("--standalone", "--job", "tfint", "--tf-ps", "--num-ps", "1", "--num-workers", "2"),
        *("--checkpoint-dir", str(tmp_path / "ckpt")),
        str(SCRIPT),
        *("--samples", "200000"),
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    try:
        await eventually(lambda: re.search(r"\[chief\] step \d+ ", job.log()), timeout=300)
        job.proc.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(job.wait, 120)
        assert code == 128 + signal.SIGINT, job.log()[-3000:]
    finally:
        job.stop()
    log = job.log()
    assert "rove: job tfint stopped: rove run received SIGINT" in log, log[-3000:]
    assert "did not end within" not in log, log[-3000:]
    # each task's output is where `rove logs` reads a worker's (it found nothing)
    chief = await asyncio.to_thread(rove_cli, "logs", "--job", "tfint", "--rank", "0")
    assert chief.returncode == 0 and re.search(r"^step \d+ ", chief.stdout, re.M), chief
    every = await asyncio.to_thread(rove_cli, "logs", "--job", "tfint")
    titles = re.findall(r"^==> round 1, node \S+, rank (\d), stdout <==$", every.stdout, re.M)
    assert titles == ["0", "1", "2", "3"], every.stdout[:2000]
