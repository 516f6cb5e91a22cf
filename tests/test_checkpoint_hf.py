"""The HuggingFace Trainer callback: a killed run resumes from shared memory, bitwise.

A tiny GPT-2 (built from a config, dropout on) trains 10 steps three ways in
separate processes: straight through; with flash saves, killed right after
step 8 (in the middle of the second epoch); resumed. The resumed run restores
step 8 from memory, trains only the 2 remaining steps, and ends with exactly
the weights of the straight run: model, optimizer, scheduler, RNG and the
data position all came back, though the checkpoint written out for the Trainer was
removed as its first step began.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "hf_train.py"


def train(out: Path, env: dict[str, str], *args: str) -> int:
    out.mkdir(exist_ok=True)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), "--max-steps", "10", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode not in (0, 3):
        raise AssertionError(proc.stdout + proc.stderr)
    return proc.returncode


def test_a_killed_trainer_resumes_from_memory_bitwise(tmp_path: Path) -> None:
    env = {**os.environ, "ROVE_SHM_DIR": str(tmp_path / "shm"), "ROVE_JOB": "hf"}
    env.pop("ROVE_RESTORE_STEP", None)
    assert train(tmp_path / "straight", env) == 0
    assert train(tmp_path / "run", env, "--flash", "--crash-at", "8") == 3
    assert not (tmp_path / "run" / "final.pt").exists()
    assert train(tmp_path / "run", env, "--flash") == 0

    resumed = json.loads((tmp_path / "run" / "resumed.json").read_text())
    assert resumed["step"] == 8 and resumed["source"] == "memory"
    assert resumed["steps_run"] == 2, "only the steps after the checkpoint are trained again"
    assert not Path(resumed["dir"]).exists(), "the materialized checkpoint is removed"
    # ... as soon as the first step began (a whole copy of the state, in memory): the
    # bitwise match below says the Trainer had read all of it by then
    assert resumed["dir_after_first_step"] is False
    straight = torch.load(tmp_path / "straight" / "final.pt")
    after = torch.load(tmp_path / "run" / "final.pt")
    assert straight.keys() == after.keys()
    for name in straight:
        assert torch.equal(straight[name], after[name]), name


def test_the_callback_refuses_a_bad_interval() -> None:
    from rove.checkpoint.hf import FlashCheckpointCallback

    with pytest.raises(ValueError, match="every must be 1 or more"):
        FlashCheckpointCallback(every=0)
