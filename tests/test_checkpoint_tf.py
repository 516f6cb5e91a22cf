"""Durable TensorFlow checkpoints (rove.checkpoint.tf), with real TensorFlow objects and
real files: the newest committed step restores; a torn step is detected by its checksums
and an older one restored instead; a crash in the middle of a save leaves the previous
step committed; a directory that cannot be written is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import tensorflow as tf

from rove.checkpoint import durable
from rove.checkpoint.durable import CheckpointError
from rove.checkpoint.tf import TfCheckpointer
from tests.support import flip_byte


def model_state(value: float) -> tuple[object, object]:
    var = tf.Variable([value, value + 1.0])
    return var, tf.train.Checkpoint(var=var)


def test_the_newest_committed_step_restores_with_its_extra(tmp_path: Path) -> None:
    var, ckpt = model_state(1.0)
    saver = TfCheckpointer(ckpt, tmp_path, keep=2)
    assert saver.restore() is None, "nothing saved: a fresh start"
    for step in (1, 2, 3):
        var.assign([float(step), float(step) * 10])
        saved = saver.save(step, extra={"data": {"done": [[0, step]]}})
        assert saved.path == durable.step_dir(tmp_path, step) and saved.seconds > 0
    assert saver.committed() == 3 and durable.steps(tmp_path) == [2, 3], "keep=2"
    var.assign([0.0, 0.0])
    restored = saver.restore()
    assert restored is not None and restored.step == 3
    assert restored.extra == {"data": {"done": [[0, 3]]}}
    assert var.numpy().tolist() == [3.0, 30.0]


def test_a_torn_step_is_detected_and_an_older_one_restored(tmp_path: Path) -> None:
    var, ckpt = model_state(1.0)
    saver = TfCheckpointer(ckpt, tmp_path, keep=3)
    saver.save(1)
    var.assign([7.0, 7.0])
    saver.save(2)
    data = next(p for p in durable.step_dir(tmp_path, 2).iterdir() if ".data-" in p.name)
    flip_byte(data, 4)
    var.assign([0.0, 0.0])
    restored = saver.restore()
    assert restored is not None and restored.step == 1, "step 2 fails its checksum"
    assert var.numpy().tolist() == [1.0, 2.0]
    flip_byte(next(durable.step_dir(tmp_path, 1).glob("*.index")), 0)
    with pytest.raises(CheckpointError, match=r"no committed TensorFlow checkpoint .* verifies"):
        saver.restore()


def test_a_save_that_dies_midway_leaves_the_last_committed_step_whole(tmp_path: Path) -> None:
    var, ckpt = model_state(1.0)
    saver = TfCheckpointer(ckpt, tmp_path)
    saver.save(5)
    # a save killed after TensorFlow wrote its files, before the rename and the commit
    stray = tmp_path / ".tmp-step-00000006-99999"
    stray.mkdir()
    ckpt.write(str(stray / "ckpt"))
    var.assign([0.0, 0.0])
    restored = saver.restore()
    assert restored is not None and restored.step == 5
    saver.save(7)
    assert not stray.exists(), "a later save clears what a crashed one left"


def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path: Path) -> None:
    _, ckpt = model_state(1.0)
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(CheckpointError, match="could not save TensorFlow checkpoint step 1"):
        TfCheckpointer(ckpt, blocked / "ck").save(1)


def test_without_a_directory_the_error_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ROVE_CKPT_DIR", raising=False)
    with pytest.raises(CheckpointError, match="--checkpoint-dir"):
        TfCheckpointer(object())


def test_an_object_store_for_rove_run_is_refused_with_what_to_give_instead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TensorFlow writes its own files (and rove its commit tracker) to a directory."""
    monkeypatch.setenv("ROVE_CKPT_DIR", "s3://bucket/job")
    with pytest.raises(CheckpointError, match=r"is an object store \(s3://bucket/job\)"):
        TfCheckpointer(object())
