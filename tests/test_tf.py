"""TensorFlow parameter-server jobs through failures, with real processes: a `rove master`
and a `rove run --tf-ps` node running a chief (examples/tf_ps.py), one parameter server
and two workers on loopback, over a real nats-server.

One job takes three kills in turn: a worker (restarted in place: no new round, the
same chief), the parameter server (a new round: the chief restores its checkpoint and
the loss goes on from there), then the chief (the same). In the lineage of the final
model, every sample of the data set was trained exactly once.
"""

from __future__ import annotations

import collections
import os
import re
import signal
from pathlib import Path

import pytest

from rove.control import events as ev
from rove.control import shards
from rove.control.bus import Bus
from rove.control.master import data as data_fold
from tests.lineage import lineage, rows
from tests.support import (
    ROOT,
    MasterProc,
    RunProc,
    eventually,
    finished,
    fold_records,
    stored_events,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "examples" / "tf_ps.py"
SAMPLES, SHARD = 9600, 96  # 100 shards


def node(tmp_path: Path, bus: Bus, job: str, script: Path, *args: str) -> RunProc:
    return RunProc(
        tmp_path,
        "n0",
        *("--nats", bus.url, "--job", job, "--node-id", "n0", "--local-addr", "127.0.0.1"),
        *("--tf-ps", "--num-ps", "1", "--nproc-per-node", "4", "--max-restarts", "5"),
        *("--heartbeat-interval", "0.5", "--checkpoint-dir", str(tmp_path / "ckpt")),
        str(script),
        *args,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
    )


async def started(bus: Bus, job: str) -> list[ev.WorkersStarted]:
    return [
        r.event for r in await stored_events(bus, job) if isinstance(r.event, ev.WorkersStarted)
    ]


def steps(trace: Path) -> int:
    return max((r["step"] for r in rows(trace) if "step" in r), default=0)


async def test_a_worker_a_parameter_server_and_the_chief_killed_in_turn_train_each_sample_once(
    bus: Bus, tmp_path: Path
) -> None:
    job = "tf-chaos"
    trace = tmp_path / "trace.jsonl"
    master = MasterProc(bus.url, job, "m1", tmp_path, "--node-timeout", "10")
    run = node(
        tmp_path, bus, job, SCRIPT,
        *("--samples", str(SAMPLES), "--shard-size", str(SHARD), "--window", "4"),
        *("--trace", str(trace)),
    )  # fmt: skip
    try:
        # 1. a worker: restarted in place, nothing else
        await eventually(lambda: steps(trace) >= 12, timeout=240)
        (first,) = await started(bus, job)
        chief, ps, worker0 = first.pids[0], first.pids[1], first.pids[2]
        os.kill(worker0, signal.SIGKILL)
        at = steps(trace)
        await eventually(lambda: steps(trace) >= at + 12, timeout=240)
        events = [r.event for r in await stored_events(bus, job)]
        restarts = [e for e in events if isinstance(e, ev.TaskRestarted)]
        assert [(e.role, e.index, e.kind) for e in restarts] == [
            ("worker", 0, ev.FailureKind.KILLED)
        ]
        assert len(await started(bus, job)) == 1, "no new round for a worker"
        assert os.kill(chief, 0) is None and os.kill(ps, 0) is None, "the rest untouched"

        # 2. the parameter server: a new round, restored from the last checkpoint
        os.kill(ps, signal.SIGKILL)
        await eventually(lambda: len({r["round"] for r in rows(trace)}) >= 2, timeout=240)
        at = steps(trace)
        await eventually(lambda: steps(trace) >= at + 8, timeout=240)
        second = (await started(bus, job))[-1]

        # 3. the chief: the same
        os.kill(second.pids[0], signal.SIGKILL)
        codes = await finished(bus, job, {"n0": run}, [run, master])
        assert codes == {"n0": 0}, run.log()[-4000:]
    finally:
        run.stop()
        master.stop()

    stored = await stored_events(bus, job)
    events = [r.event for r in stored]
    rounds = [e for e in events if isinstance(e, ev.RoundCompleted)]
    assert len(rounds) == 3, [(r.round, r.reason) for r in rounds]
    # the master holds every shard done: each acknowledged once a checkpoint covered it
    data = fold_records(stored, job).data
    ds = data.datasets["tf-regression"]
    assert data_fold.done_count(data, ds) == shards.total(ds.spec) == SAMPLES // SHARD
    assert [t.role for t in rounds[-1].tasks] == ["chief", "ps", "worker", "worker"]
    exits = [e for e in events if isinstance(e, ev.WorkerExited)]
    assert [e.reason.split(":")[0] for e in exits] == ["parameter server 0", "the chief"]
    restored = [r["restored"] for r in rows(trace) if "restored" in r]
    assert restored[0] == 0 and all(s > 0 for s in restored[1:]), restored
    count = collections.Counter(lineage(trace))
    every = {(0, i) for i in range(SAMPLES)}
    assert set(count) == every, f"missing: {sorted(every - set(count))[:10]}"
    assert {k: n for k, n in count.items() if n > 1} == {}, "trained twice in the lineage"
    # the loss goes on from the checkpoint after each restore (it does not start over)
    losses = [float(x) for x in re.findall(r"\[chief\] step \d+ +loss ([\d.]+)", run.log())]
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
