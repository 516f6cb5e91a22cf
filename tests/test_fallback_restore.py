"""A committed step that cannot be read: the ranks fall back together to an older one,
and the master learns it (a real `rove run --standalone` killed, one rank's file of its
committed step corrupted, then run again)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rove.checkpoint import durable
from tests.support import patience

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"
ROVE = [sys.executable, "-m", "rove.control.cli.main"]


def rove_json(command: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`rove COMMAND --job fallback --json`, run to its end."""
    return subprocess.run(
        [*ROVE, command, "--job", "fallback", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=patience(60),
    )


@pytest.mark.slow
def test_ranks_that_cannot_read_the_committed_step_fall_back_and_the_master_follows(
    tmp_path: Path,
) -> None:
    """The job's next run names the committed step C (its memory is gone); rank 1's file
    of it fails its checksum, so both ranks load the newest older step on storage. Their
    agent says so, and the master takes it: `rove status` names that step as restored,
    it is committed again (storage still named C) before any newer step, and the
    dataset's restore names it too."""
    env = {
        **os.environ,
        "ROVE_HOME": str(tmp_path / "home"),
        "ROVE_SHM_DIR": str(tmp_path / "shm"),
    }
    store = tmp_path / "ckpt"
    cmd = [
        *ROVE,
        *("run", "--standalone", "--job", "fallback", "--nproc-per-node", "2"),
        *("--checkpoint-dir", str(store), str(TRAIN)),
        *("--steps", "60", "--ckpt-every", "5", "--step-sleep", "0.05", "--log-every", "5"),
    ]
    first = subprocess.Popen(
        cmd,
        env=env,
        stdout=(tmp_path / "first.log").open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )

    def older_steps() -> list[int]:
        """Steps on storage older than the committed one, of both ranks."""
        committed = durable.committed(store)
        return [
            s
            for s in durable.steps(store)
            if committed is not None
            and s < committed
            and all(
                (durable.step_dir(store, s) / f"rank-{r:05d}.{x}").exists()
                for r in (0, 1)
                for x in ("ckpt", "json")
            )
        ]

    try:
        deadline = time.monotonic() + patience(180)
        while not older_steps() and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.1)
        assert older_steps(), (tmp_path / "first.log").read_text()[-3000:]
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the node lost: launcher, agent, workers
        first.wait(30)
    shutil.rmtree(tmp_path / "shm", ignore_errors=True)  # and its memory with it
    named = durable.committed(store)
    assert named is not None
    fallback = max(older_steps())
    victim = durable.step_dir(store, named) / "rank-00001.ckpt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=patience(300))
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"found step {named} committed" in out, out[-3000:]
    assert f"training from step {fallback} to 60" in out, out[-3000:]
    status = rove_json("status", env)
    assert status.returncode == 0, status.stdout + status.stderr
    view = json.loads(status.stdout)
    ck = view["checkpoints"]
    assert ck["restored"] is not None and ck["restored"]["step"] == fallback, ck
    # the data position came with that step: the dataset says so too
    assert [d["restored_step"] for d in view["datasets"]] == [fallback], view["datasets"]
    events = rove_json("events", env)
    assert events.returncode == 0, events.stdout + events.stderr
    rows = [json.loads(x) for x in events.stdout.splitlines() if x.strip()]
    # the second run's round (the job's round 2: its first was the killed run's)
    started = max(i for i, r in enumerate(rows) if r.get("type") == "round_completed")
    assert rows[started]["restore_step"] == named, rows[started]
    commits = [r["step"] for r in rows[started:] if r.get("type") == "ckpt_committed"]
    assert commits and commits[0] == fallback, commits
    said = [r for r in rows[started:] if r.get("type") == "training_progress"]
    assert any(r.get("restored_step") == fallback for r in said), said[:3]
    assert re.search(rf"restored an older step.*step={fallback}", out), out[-3000:]
