"""The agent's saver and the run namespace of shared-memory slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rove.agent.saver import Saver
from rove.checkpoint.engine import FlashEngine, namespace


def test_slots_of_an_earlier_run_of_the_job_are_neither_seen_nor_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path))
    old = FlashEngine(namespace("j1", "aaaa"), 0)
    old.save(70, {"w": torch.ones(4)})  # a killed earlier run left step 70 behind
    other_job = FlashEngine(namespace("j10", "cccc"), 0)
    other_job.save(5, {"w": torch.ones(4)})
    saver = Saver("j1", None)
    saver.ranks((0,), "bbbb")
    assert saver.common_step() is None, "the new run does not see the old run's step"
    assert not list(tmp_path.glob("rove-ckpt-j1.aaaa-*")), "and the old slots are removed"
    assert list(tmp_path.glob("rove-ckpt-j10.cccc-*")), "another job's slots are left alone"
    FlashEngine(namespace("j1", "bbbb"), 0).save(3, {"w": torch.ones(4)})
    assert saver.new_in_memory() == 3


def test_workers_name_their_slots_by_the_run_the_agent_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROVE_JOB_RUN", "bbbb")
    assert namespace("j1") == "j1.bbbb"
    monkeypatch.delenv("ROVE_JOB_RUN")
    assert namespace("j1") == "j1", "outside rove run: the job name alone"
