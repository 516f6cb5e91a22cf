"""Every job ends, and ends whole: its last checkpoint committed before it is declared
finished, on one NATS server and on a 3-node cluster."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from rove.control.bus import stored
from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from tests.support import (
    TRAIN,
    Cluster,
    MasterProc,
    RunProc,
    eventually,
    job_events,
    rove_cli,
    shm_root,
    trace_rows,
)

pytestmark = pytest.mark.slow

STEPS = 12


def _flash_train(tmp_path: Path) -> list[str]:
    """examples/train.py saving a flash checkpoint every step: its last step is its last
    save, and the job ends right after it."""
    return [
        str(TRAIN),  # flash checkpoints and leased shards: its defaults under rove
        "--ckpt-every",
        "1",
        "--steps",
        str(STEPS),
        "--trace",
        str(tmp_path / "trace.jsonl"),
    ]


def _assert_ended_whole(tmp_path: Path, ckpt: Path, events: list[ev.Event]) -> None:
    last_trained = max(r["step"] for r in trace_rows(tmp_path / "trace.jsonl"))
    assert last_trained == STEPS
    committed = json.loads((ckpt / "committed").read_text())["step"]
    assert committed == last_trained, "the last step trained is the committed one"
    kinds = [(type(e).__name__, getattr(e, "step", None)) for e in events]
    commit_at = kinds.index(("CkptCommitted", STEPS))
    ended = next(i for i, e in enumerate(events) if isinstance(e, ev.JobEnded))
    assert commit_at < ended, "committed before the job was declared finished"
    end = events[ended]
    assert isinstance(end, ev.JobEnded) and end.phase is ev.JobPhase.FINISHED
    assert f"its last checkpoint, step {STEPS}, is committed to storage" in end.reason


def test_a_job_that_ends_right_after_a_flash_save_commits_that_step_first(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    node = RunProc(
        tmp_path,
        "solo",
        "--standalone",
        "--job",
        "endjob",
        "--nproc-per-node",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        "--persist-every",
        "5",  # the last step is not one of those due: it is persisted because it is last
        *_flash_train(tmp_path),
    )
    assert node.wait(180) == 0, node.log()[-3000:]
    assert f"its last checkpoint, step {STEPS}, is committed" in node.log()
    events = _stored(tmp_path / "rove-home", "endjob")
    _assert_ended_whole(tmp_path, ckpt, events)
    assert not list(shm_root().glob("rove-ckpt-endjob*")), "memory freed once it ended"


def _stored(home: Path, job: str) -> list[ev.Event]:
    """The events of an ended standalone job, read from its server's store on disk."""
    from rove.control.bus.embedded import EmbeddedServer

    async def read() -> list[ev.Event]:
        server = EmbeddedServer(home / "jobs" / job / "nats")
        server.start()
        try:
            assert server.url is not None
            bus = await Bus.connect(BusOptions(url=server.url))
            try:
                return await job_events(bus, job)
            finally:
                await bus.close()
        finally:
            server.stop()

    return asyncio.run(read())


async def test_on_a_3_node_cluster_the_last_step_is_committed_before_the_job_ends(
    nats_cluster: Cluster, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    job = "endjob3"
    master = MasterProc(nats_cluster.url, job, "m1", tmp_path)
    node = RunProc(
        tmp_path,
        "n1",
        "--nats",
        nats_cluster.url,
        "--job",
        job,
        "--node-id",
        "n1",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--checkpoint-dir",
        str(ckpt),
        *_flash_train(tmp_path),
    )
    assert await asyncio.to_thread(node.wait, 240) == 0, node.log()[-3000:]
    bus = await Bus.connect(BusOptions(url=nats_cluster.url, replicas=3))
    try:
        events = await job_events(bus, job)
    finally:
        await bus.close()
    master.stop()
    _assert_ended_whole(tmp_path, ckpt, events)


DEADLOCK = Path(__file__).parent / "scripts" / "teardown_deadlock.py"


def _deadlock_job(tmp_path: Path, name: str, *flags: str, hold: bool) -> RunProc:
    return RunProc(
        tmp_path,
        name,
        "--standalone",
        "--job",
        name,
        "--nproc-per-node",
        "2",
        "--hang-timeout",
        "5",
        *flags,
        str(DEADLOCK),
        env={"ROVE_HOLD_PROCESS_GROUPS": "1" if hold else "0"},
    )


def test_a_script_that_would_deadlock_in_torchs_gloo_teardown_ends_when_groups_are_held(
    tmp_path: Path,
) -> None:
    node = _deadlock_job(tmp_path, "held", hold=True)
    assert node.wait(180) == 0, node.log()[-3000:]
    log = node.log()
    assert "rank 0: done" in log and "rank 1: done" in log, "no rank deadlocked"
    assert "is stuck" not in log


def test_a_rank_waiting_for_a_busy_process_of_its_own_after_its_peer_returned_is_not_stuck(
    tmp_path: Path,
) -> None:
    """Rank 0 uploads the final model with a child process (`aws s3 cp`, here a busy
    loop) while rank 1 has returned: rank 0 uses no CPU itself. It was taken for stuck
    in `Popen._try_wait` after the exit timeout and the job failed as a hang."""
    script = tmp_path / "upload.py"
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 12: pass"
    script.write_text(
        "import os, subprocess, sys\n"
        "if os.environ['RANK'] == '0':\n"
        f"    subprocess.run([sys.executable, '-c', {busy!r}], check=True)\n"
        "print('rank', os.environ['RANK'], 'done', flush=True)\n"
    )
    node = RunProc(
        tmp_path,
        "upload",
        *("--standalone", "--job", "upload", "--nproc-per-node", "2", "--hang-timeout", "4"),
        str(script),
    )
    assert node.wait(180) == 0, node.log()[-3000:]
    log = node.log()
    assert "rank 0 done" in log and "rank 1 done" in log
    assert "is stuck" not in log, log[-3000:]


def test_a_rank_stuck_after_its_peer_returned_is_one_line_on_the_console_naming_its_stacks(
    tmp_path: Path,
) -> None:
    """(Its py-spy stacks, some twenty lines, were printed on the console too.)"""
    script = tmp_path / "sleeps.py"
    script.write_text("import os, time\nif os.environ['RANK'] == '0':\n    time.sleep(300)\n")
    node = RunProc(
        tmp_path,
        "sleeps",
        *("--standalone", "--job", "sleeps", "--nproc-per-node", "2", "--hang-timeout", "3"),
        str(script),
        env={"ROVE_VERBOSE": "0"},  # the console as people see it
    )
    assert node.wait(180) == 1, node.log()[-3000:]
    console = node.log()
    (stacks,) = (tmp_path / "rove-home").rglob("stacks/round1-local0-*.txt")
    assert "time.sleep" in stacks.read_text() or "<module>" in stacks.read_text()
    said = [
        line for line in console.splitlines() if line.startswith("rove: worker rank 0 is stuck")
    ]
    assert len(said) == 1 and f"(stacks: {stacks})" in said[0], console[-3000:]
    assert "Thread " not in console and "MainThread" not in console, console[-3000:]
    rove_log = next((tmp_path / "rove-home").rglob("logs/*/rove.log")).read_text()
    assert "stacks of worker pid" in rove_log, "the stacks are in the job's log"


@pytest.mark.parametrize("start", ["warm", "fresh"])
def test_a_rank_stuck_in_torchs_teardown_after_its_peer_returned_is_named_and_ended(
    tmp_path: Path, start: str
) -> None:
    """The workaround switched off, torch deadlocks rank 0 as it drops its DDP module
    after rank 1 returned: the agent writes its stacks, names the deadlock, ends the rank
    and the job ends saying so."""
    flags = () if start == "warm" else ("--no-warm-start",)
    node = _deadlock_job(tmp_path, f"stuck-{start}", *flags, hold=False)
    assert node.wait(240) == 0, node.log()[-3000:]
    log = node.log()
    assert "rank 1: done" in log and "rank 0: done" not in log, "rank 0 deadlocked"
    assert "worker rank 0 is stuck in torch's gloo teardown deadlock" in log
    assert "after rank 1 returned; its work was done: ending it" in log
    assert "c10d::ProcessGroupGloo::~ProcessGroupGloo" in log, "its stacks are in the log"
    (stacks,) = (tmp_path / "rove-home").rglob("stacks/round1-local0-*.txt")
    assert "gil_scoped_acquire" in stacks.read_text()
    (end,) = [x for x in log.splitlines() if x.startswith(f"rove: job stuck-{start} finished")]
    assert "rank 0 was ended, stuck in torch's gloo teardown deadlock" in end


async def test_a_rerun_under_an_ended_jobs_name_is_its_next_run_and_the_earlier_stay_readable(
    bus: Bus, tmp_path: Path
) -> None:
    """As torchrun runs an `--rdzv-id` again. (Once refused: "already ended earlier".)"""
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello from run', os.environ['TORCHELASTIC_RUN_ID'])\n")
    master = MasterProc(bus.url, "again", "m1", tmp_path, "--keep-serving")
    for i in range(3):
        node = RunProc(
            tmp_path,
            f"run{i + 1}",
            *("--nats", bus.url, "--rdzv-id", "again", "--node-id", f"n{i + 1}", "--nnodes", "1"),
            str(script),
        )
        assert await asyncio.to_thread(node.wait, 120) == 0, node.log()[-3000:]
        assert "hello from run again" in node.log()
        assert "job again finished" in node.log()
        if i:  # (said once: the runs before are history to it, not runs to join)
            said = "job again ended earlier (finished); its run {} starts now, with this node"
            assert node.log().count(said.format(i + 1)) == 1, node.log()[-3000:]
            assert "run 2 of job again started" not in node.log()
    events = await job_events(bus, "again")
    assert [e.run for e in events if isinstance(e, ev.RunStarted)] == [2, 3]
    assert sum(isinstance(e, ev.JobEnded) for e in events) == 3
    # n3 joins to start run 3, and once more in it; not again for run 2, long over when
    # it came (it once did, and a join of n3 folded after that could start run 3 at it,
    # leaving n3's first join in run 2: `rove status --run 2` listed n3)
    joins = [e.node for e in events if isinstance(e, ev.NodeJoined)]
    assert joins.count("n2") == 2 and joins.count("n3") == 2, joins
    first = rove_cli("events", "--job", "again", "--run", "1", "--nats", bus.url, check=True)
    assert "node_joined" in first.stdout and "n1" in first.stdout
    assert "n2" not in first.stdout and "run_started" not in first.stdout
    # n1 leaving after its run ended is its run's (it began the second run's goodput once)
    assert "node_left" in first.stdout.splitlines()[-1], first.stdout
    second_events = rove_cli("events", "--job", "again", "--run", "2", "--nats", bus.url)
    assert "node_joined" in second_events.stdout.splitlines()[0], second_events.stdout
    assert "n1" not in second_events.stdout, second_events.stdout
    second = rove_cli("status", "--job", "again", "--run", "2", "--nats", bus.url, check=True)
    assert second.stdout.startswith("job again (run 2): finished"), second.stdout
    assert "n2" in second.stdout and "n3" not in second.stdout
    newest = rove_cli("status", "--job", "again", "--nats", bus.url, check=True)
    assert newest.stdout.startswith("job again (run 3): finished"), newest.stdout
    none = rove_cli("events", "--job", "again", "--run", "4", "--nats", bus.url)
    assert none.returncode == 2 and "the job has run 3 times (runs 1-3)" in none.stderr
    master.stop()


def test_a_state_that_grows_and_shrinks_mid_job_is_persisted_at_every_later_step(
    tmp_path: Path,
) -> None:
    """(A state that outgrew its slot was never persisted again: the agent kept mapping
    the slot's old file and saw only old steps, and the job ended rc 0.)"""
    ckpt = tmp_path / "ckpt"
    script = Path(__file__).parent / "scripts" / "growing_state.py"
    node = RunProc(
        tmp_path,
        "grows",
        *("--standalone", "--job", "grows", "--nproc-per-node", "2"),
        *("--checkpoint-dir", str(ckpt), "--keep-checkpoints", "20"),
        str(script),
    )
    assert node.wait(180) == 0, node.log()[-3000:]
    events = _stored(tmp_path / "rove-home", "grows")
    persisted = {e.step for e in events if isinstance(e, ev.CkptPersisted)}
    assert set(range(6, 15)) <= persisted, f"every step after the growth: {sorted(persisted)}"
    assert json.loads((ckpt / "committed").read_text())["step"] == 14
    grown = sorted(ckpt.glob("step-00000008/rank-*.ckpt"))
    assert len(grown) == 2 and all(p.stat().st_size > 8_000_000 for p in grown), "whole"


def test_a_job_run_again_with_more_steps_goes_on_from_its_step_and_its_data_position(
    tmp_path: Path,
) -> None:
    """Training longer: the rerun asks for more epochs of the same shards, and goes on
    from the committed step and the shards it had trained. (It failed on its first
    step: "positions only carry over to the same dataset parameters".)"""
    ckpt = tmp_path / "ckpt"
    args = ("--standalone", "--job", "longer", "--checkpoint-dir", str(ckpt), str(TRAIN))
    data = ("--samples", "640", "--shard-size", "32", "--ckpt-every", "5")  # 20 shards
    first = RunProc(tmp_path, "first", *args, *data, "--steps", "10")  # 2 epochs
    assert first.wait(120) == 0, first.log()[-3000:]
    again = RunProc(tmp_path, "again", *args, *data, "--steps", "40")  # 5 epochs
    assert again.wait(120) == 0, again.log()[-3000:]
    log = again.log()
    assert "restored step 10 from storage" in log, log[-3000:]
    assert "rove: job longer finished" in log
    events = _stored(tmp_path / "rove-home", "longer")
    epochs = [e.spec.epochs for e in events if isinstance(e, ev.DatasetRegistered)]
    assert (epochs[0], epochs[-1]) == (2, 5)
    restored = [e for e in events if isinstance(e, ev.DataRestored) and e.step is not None]
    assert restored, "the rerun's data follows its checkpoint's lineage"
    assert (restored[-1].step, restored[-1].done_shards) == (10, 20), "a whole epoch done"


async def test_a_node_joining_a_run_under_way_does_not_take_its_committed_step_for_an_earlier_runs(
    bus: Bus, tmp_path: Path
) -> None:
    """It said `found step N committed in DIR by an earlier run of the job: it goes on from
    there` on its console: the step was the job's own progress."""
    master = MasterProc(bus.url, "joining", "m1", tmp_path)
    common = (
        *("--nats", bus.url, "--job", "joining", "--nnodes", "1:2", "--nproc-per-node", "1"),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), "--last-call-timeout", "1"),
    )
    train = (str(TRAIN), "--steps", "300", "--ckpt-every", "5", "--step-sleep", "0.05")
    nodes = [RunProc(tmp_path, "n1", *common, "--node-id", "n1", *train)]
    try:

        async def committed() -> bool:
            return any(isinstance(e, ev.CkptCommitted) for e in await job_events(bus, "joining"))

        await eventually(committed, timeout=180)
        nodes.append(RunProc(tmp_path, "n2", *common, "--node-id", "n2", *train))

        async def joined() -> bool:  # n2 joined the run under way, in a round of two
            events = await job_events(bus, "joining")
            return any(isinstance(e, ev.RoundCompleted) and e.world_size == 2 for e in events)

        await eventually(joined, timeout=180)
        assert not any(isinstance(e, ev.JobEnded) for e in await job_events(bus, "joining"))
    finally:
        for node in nodes:
            node.stop()
        master.stop()
    assert "by an earlier run" not in nodes[1].log(), nodes[1].log()[-3000:]
    assert re.search(r"found step \d+ committed in \S+ by the run going on", nodes[1].log())
    # n1's slots are in the machine's shared memory n2 shares: found, but not as left by
    # an earlier agent of n2's (there was none)
    assert "left by its earlier agent" not in nodes[1].log()


async def test_a_job_run_on_a_shared_nats_is_read_on_its_nodes_machine_without_nats(
    bus: Bus, tmp_path: Path
) -> None:
    """Its folder here kept only logs: `rove status --job J` asked for --nats, and `rove
    jobs` listed it as `elsewhere` with zeros."""
    script = tmp_path / "hello.py"
    script.write_text("import time\nprint('hello', flush=True)\ntime.sleep(120)\n")
    master = MasterProc(bus.url, "onshared", "m1", tmp_path)
    node = RunProc(
        tmp_path,
        "n1",
        *("--nats", bus.url, "--job", "onshared", "--node-id", "n1", "--nnodes", "1"),
        str(script),
    )
    try:
        await eventually(lambda: "hello" in node.log(), timeout=120)
        # stopped, as read, from this machine with no --nats
        stop = await asyncio.to_thread(rove_cli, "stop", "--job", "onshared", timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert await asyncio.to_thread(node.wait, 120) == 1, node.log()[-3000:]
    finally:
        node.stop()
        master.stop()
    status = await asyncio.to_thread(rove_cli, "status", "--job", "onshared", timeout=60)
    assert status.returncode == 0, status.stderr
    assert status.stdout.startswith("job onshared: stopped"), status.stdout
    jobs = await asyncio.to_thread(rove_cli, "jobs", timeout=60)
    (row,) = [line for line in jobs.stdout.splitlines() if line.startswith("onshared ")]
    assert row.split()[1] == "stopped", jobs.stdout
    # the URL kept holds no credentials a URL may carry
    stored.remember_shared("creds", "nats://alice:secret@h1:4222,nats://bob:pw@h2:4222")
    assert stored.shared_url("creds") == "nats://h1:4222,nats://h2:4222"
