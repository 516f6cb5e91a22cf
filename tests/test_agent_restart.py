"""An agent killed and started again on its node finds the step its earlier agent left
in shared memory, and the round restores it from there: the pure rule, and a real
`rove run --standalone` killed with SIGKILL and run again."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest

from rove.control.catalogue import events as ev
from rove.control.master import checkpoints as ckpt
from tests import factories
from tests.support import patience, rove_cli

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _recovered(node: str, step: int, ranks: tuple[int, ...], inc: str) -> ev.CkptInMemory:
    return msgspec.structs.replace(
        factories.in_memory(node, step, ranks, inc=inc, rnd=0), recovered=True
    )


def test_a_new_agent_inherits_the_memory_its_node_was_known_to_hold_and_nothing_else() -> None:
    c = ckpt.CkptState()
    for e in (factories.in_memory("na", 20, (0, 1)), factories.in_memory("na", 25, (0, 1))):
        c = ckpt.on_in_memory(c, e)
    members = [("na", (0, 1))]
    # the agent i1 was killed; i2 runs the node now: what i1 reported is not counted
    assert ckpt.restore_point(c, members, {"na": "i2"}).source is ev.RestoreSource.NONE
    took = ckpt.on_in_memory(c, _recovered("na", 25, (0, 1), "i2"))
    got = ckpt.restore_point(took, members, {"na": "i2"})
    assert (got.step, got.source) == (25, ev.RestoreSource.MEMORY)
    # the agent says every step it holds, newest first: a newer one the master never
    # heard of (saved as i1 was killed) is passed over, the one it knew is taken
    both = took = c
    for step in (30, 25, 20):
        both = ckpt.on_in_memory(both, _recovered("na", step, (0, 1), "i2"))
    assert both.memory["na"] == (25, (0, 1)) and both.previous["na"] == 20
    assert ckpt.restore_point(both, members, {"na": "i2"}).step == 25
    # the older slot only (the newest was lost mid-save): that step
    older = ckpt.on_in_memory(c, _recovered("na", 20, (0, 1), "i2"))
    assert ckpt.restore_point(older, members, {"na": "i2"}).step == 20
    # a step the master never knew the node held, or not all of its ranks: ignored
    for odd in (_recovered("na", 30, (0, 1), "i2"), _recovered("na", 25, (0,), "i2")):
        assert ckpt.on_in_memory(c, odd) == c
    # more ranks (another node's slots in the same memory): its own are among them
    shared = ckpt.on_in_memory(c, _recovered("na", 25, (0, 1, 2, 3), "i2"))
    assert shared.reporter["na"] == "i2" and shared.memory["na"] == (25, (0, 1))
    # a round since went on from step 10 (a new lineage): step 25 of the old one is never
    # taken back
    cut = ckpt.on_round(
        c, msgspec.structs.replace(factories.round_completed(2, 1, "nb"), restore_step=10)
    )
    assert ckpt.on_in_memory(cut, _recovered("na", 25, (0, 1), "i2")) == cut


@pytest.mark.slow
def test_rove_run_killed_and_run_again_goes_on_from_the_step_in_memory(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`rove run --standalone` killed with SIGKILL (the launcher, its agent and master;
    the workers follow), then the same command again, with more steps (so more epochs
    of its data): its agent finds the step the killed one left in shared memory, and
    the job goes on from it, not from step 0. The temporary folders the killed one
    could not remove, the second removes."""
    # (short: multiprocessing's sockets are made in it, and a path under pytest's
    # tmp_path is too long for one named for its process)
    tmp = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = {
        **os.environ,
        "ROVE_HOME": str(tmp_path / "home"),
        "ROVE_SHM_DIR": str(tmp_path / "shm"),
        "TMPDIR": str(tmp),
    }
    cmd = [
        *(sys.executable, "-m", "rove.control.cli.main", "run", "--standalone"),
        *("--job", "again", "--nproc-per-node", "2", str(TRAIN)),
        *("--ckpt-every", "5", "--step-sleep", "0.05", "--log-every", "5"),
        *("--samples", "1280"),  # 5 shards an epoch: 4 epochs for 60 steps, 5 for 80
    ]
    first = subprocess.Popen(
        [*cmd, "--steps", "60"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    follower = None
    try:
        assert first.stdout is not None
        deadline = time.monotonic() + patience(180)
        while time.monotonic() < deadline:
            line = first.stdout.readline()
            seen.append(line)
            if re.match(r"step (1[5-9]|[2-9]\d)/60", line):
                break
        else:
            raise AssertionError("".join(seen)[-3000:])
        follower = subprocess.Popen(
            [sys.executable, "-m", "rove.control.cli.main", "events", "--job", "again", "-f"],
            # (a temporary folder of its own: once the server is gone it reads the stored
            # stream from a copy, whose making sweeps the folders of the killed run, which
            # the rerun must find and remove)
            env={**env, "TMPDIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert follower.stdout is not None
        assert follower.stdout.readline(), "it reads the job's server"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    killed_at = time.time()
    assert follower is not None
    try:  # a follow ends with the job's server, saying the job did not end
        _, unsaid = follower.communicate(timeout=patience(30))
    finally:
        follower.kill()
    cut = "was cut off (its rove run stopped without recording an end: killed"
    assert follower.returncode == 0 and cut in unsaid, unsaid
    assert "NATS" not in unsaid, unsaid
    home = {"ROVE_HOME": env["ROVE_HOME"]}
    later = rove_cli("events", "--job", "again", "-f", env=home)
    assert "was cut off" in later.stderr, "its stored events say so too"
    # the stored job reads as cut off, not as running for ever
    status = rove_cli("status", "--job", "again", env=home, check=True).stdout
    assert status.startswith("job again: cut off while running (its rove run stopped"), status
    assert "no master runs: nothing keeps the job's server" in status, status
    assert " active as the job was cut off: not heard from since\n" in status, status
    (row,) = [json.loads(x) for x in rove_cli("jobs", "--json", env=home).stdout.splitlines()]
    assert row["state"] == "cut off", row
    # (`seconds` is rounded to a tenth: the end it says may be 0.05 s past the true one)
    ended = row["start"] + row["seconds"] - 0.05
    assert ended <= killed_at, "its time ends with its last event"
    report = json.loads(rove_cli("goodput", "--job", "again", "--json", env=home).stdout)
    assert report["cut_off"] is True and report["until"] <= killed_at, report
    left = sorted(p.name for p in tmp.glob("rove-*"))
    assert any(n.startswith("rove-warm-quick-") for n in left), left  # (its warm server's)
    again = subprocess.run(  # (the same run goes on: its data registered anew, longer)
        [*cmd, "--steps", "80"], env=env, capture_output=True, text=True, timeout=patience(300)
    )
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert sorted(p.name for p in tmp.glob("rove-*")) == [], "the killed run's are gone too"
    assert sorted(p.name for p in tmp.glob("pymp-*")) == [], "multiprocessing's too"
    found = re.search(
        r"found steps? ([\d, ]+) of ranks \[0, 1\] in this machine's shared memory, "
        "saved in the run going on",
        out,
    )
    assert found, out[-3000:]
    held = [int(s) for s in found[1].split(", ")]
    restored = re.search(r"they restore step (\d+) from memory", out)
    assert restored and int(restored[1]) in held and int(restored[1]) >= 5, out[-3000:]
    assert f"training from step {restored[1]} to 80" in out, out[-3000:]
    (row,) = [json.loads(x) for x in rove_cli("jobs", "--json", env=home).stdout.splitlines()]
    assert row["state"] == "finished", "the rerun went on with the run cut off, and ended it"


def test_a_job_name_run_again_while_it_runs_is_refused_and_the_first_goes_on(
    tmp_path: Path,
) -> None:
    """The same `rove run --standalone --job J` twice at once on one machine: the second
    is refused with the reason (it used to start a second nats-server on the first's
    store and take the first's shared memory for its own), and the first finishes."""
    env = {
        **os.environ,
        "ROVE_HOME": str(tmp_path / "home"),
        "ROVE_SHM_DIR": str(tmp_path / "shm"),
    }
    cmd = [
        *(sys.executable, "-m", "rove.control.cli.main", "run", "--standalone"),
        *("--job", "twice", "--nproc-per-node", "1", str(TRAIN)),
        *("--steps", "40", "--ckpt-every", "5", "--log-every", "5"),
    ]
    first = subprocess.Popen(
        [*cmd, "--step-sleep", "0.2"],  # 8 s of training: the second comes in it
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    try:
        assert first.stdout is not None
        for line in first.stdout:
            seen.append(line)
            if line.startswith("step "):
                break
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=patience(120))
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"job twice is already running on this machine (rove pid {first.pid})" in (
            second.stderr
        ), second.stderr
        rest, _ = first.communicate(timeout=patience(180))
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(30)
    out = "".join(seen) + rest
    assert first.returncode == 0, out[-3000:]
    assert "training from step 0 to 40" in out and "job twice finished" in out, out[-3000:]
    # one worker a node is common (a GPU a node): the console counts it as one
    assert "round 1: started 1 worker as rank 0 of 1 (1 of 1 node joined)" in out, out[-3000:]
