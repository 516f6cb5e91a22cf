"""Persisting checkpoints to files: atomic writes, manifests, commits, retention, bad disks."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rove.checkpoint import durable
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.storage import FileStorage, StorageError
from tests.support import flip_byte


def saved(tmp_path: Path, step: int, rank: int = 0, n: int = 1000) -> tuple[FlashEngine, int]:
    engine = FlashEngine("j1", rank, directory=tmp_path / "shm")
    stats = engine.save(step, {"w": torch.full((n,), float(step)), "step": step, "t": (1, 2)})
    return engine, stats.slot


def test_a_persisted_step_loads_back_bitwise(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "ckpt")
    engine, slot = saved(tmp_path, 7, rank=3)
    manifest = storage.persist(engine, slot, rank=3)
    assert (manifest.step, manifest.rank) == (7, 3)
    assert storage.persisted_ranks(7) == {3}
    state = storage.load(7, 3)
    assert state["step"] == 7 and state["t"] == (1, 2)
    assert torch.equal(state["w"], torch.full((1000,), 7.0))
    assert not list((tmp_path / "ckpt").rglob(".*tmp*")), "no temporary files left"


def test_commit_marks_the_step_and_keeps_the_last_k(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path / "ckpt")
    assert storage.committed() is None
    for step in (1, 2, 3, 4):
        engine, slot = saved(tmp_path, step)
        storage.persist(engine, slot, rank=0)
        storage.commit(step, keep=2)
    assert storage.committed() == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == [
        "step-00000003",
        "step-00000004",
    ]


def test_the_tracker_names_the_job_that_committed_and_an_older_one_reads_as_none(
    tmp_path: Path,
) -> None:
    storage = FileStorage(tmp_path / "ckpt")
    engine, slot = saved(tmp_path, 5)
    storage.persist(engine, slot, rank=0)
    storage.commit(5, keep=2, job="sweep-lr1")
    assert storage.tracker() == durable.Tracker(5, "sweep-lr1") and storage.committed() == 5
    (tmp_path / "ckpt" / "committed").write_text('{"step": 5}')  # rove before 2026-12-07
    assert storage.tracker() == durable.Tracker(5, None)
    (tmp_path / "ckpt" / "committed").write_text("[5]")  # no tracker rove wrote
    assert storage.tracker() is None and storage.committed() is None


def test_a_step_never_persisted_cannot_be_committed(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="never persisted"):
        FileStorage(tmp_path / "ckpt").commit(5, keep=2)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_file_is_refused(tmp_path: Path, damage: str) -> None:
    storage = FileStorage(tmp_path / "ckpt")
    engine, slot = saved(tmp_path, 2)
    storage.persist(engine, slot, rank=0)
    path = tmp_path / "ckpt" / "step-00000002" / "rank-00000.ckpt"
    if damage == "flip":
        flip_byte(path, -10)
    else:
        path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="checksum" if damage == "flip" else "truncated"):
        storage.load(2, 0)


def test_an_unwritable_path_is_a_clear_error_and_nothing_is_committed(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    storage = FileStorage(blocker / "ckpt")
    engine, slot = saved(tmp_path, 1)
    with pytest.raises(StorageError, match="could not persist step 1"):
        storage.persist(engine, slot, rank=0)
    assert storage.committed() is None


DISK_FULL = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    from rove.checkpoint.engine import FlashEngine
    from rove.checkpoint.storage import FileStorage, StorageError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a failed write, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))
    engine = FlashEngine("j1", 0, directory=Path(sys.argv[1]))
    try:
        FileStorage(Path(sys.argv[2])).persist(engine, engine.newest().slot, rank=0)
    except StorageError as exc:
        print("STORAGE-ERROR", exc)
""")


def test_a_full_disk_leaves_no_half_written_file_and_training_state_intact(tmp_path: Path) -> None:
    engine, _ = saved(tmp_path, 9, n=2_000_000)  # 8 MB, over the 1 MB file-size limit
    out = subprocess.run(
        [sys.executable, "-c", DISK_FULL, str(tmp_path / "shm"), str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "STORAGE-ERROR" in out.stdout and "too large" in out.stdout
    assert "training goes on with in-memory checkpoints" in out.stdout
    storage = FileStorage(tmp_path / "ckpt")
    assert storage.persisted_ranks(9) == set()
    assert not [p for p in (tmp_path / "ckpt").rglob("*") if p.is_file()], "nothing left"
    assert engine.load()[0] == 9, "the in-memory checkpoint is untouched"


def test_a_corrupted_committed_step_falls_back_to_the_older_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rove.checkpoint.api import FlashCheckpointer

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "other-shm"))
    storage = FileStorage(tmp_path / "ckpt")
    for step in (3, 4):
        engine, slot = saved(tmp_path, step)
        storage.persist(engine, slot, rank=0)
        storage.commit(step, keep=3)
    path = tmp_path / "ckpt" / "step-00000004" / "rank-00000.ckpt"
    path.write_bytes(path.read_bytes()[:-10])  # truncated
    monkeypatch.setenv("ROVE_RESTORE_STEP", "4")
    monkeypatch.setenv("ROVE_RESTORE_SOURCE", "storage")
    ckpt = FlashCheckpointer(tmp_path / "ckpt", job="j1", rank=0)
    step, state = ckpt.load()  # type: ignore[misc]
    assert step == 3 and state["step"] == 3 and ckpt.restored_from == "storage"
    assert storage.steps() == [3], "training goes on from 3: the broken step 4 is dropped"

    (tmp_path / "ckpt" / "step-00000003" / "rank-00000.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"step 4 or any older one.*manifest of step 3"):
        FlashCheckpointer(tmp_path / "ckpt", job="j1", rank=0).load()


def test_a_rank_the_step_was_not_saved_by_loads_the_lowest_ranks_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The world grew from 2 to 4 ranks: ranks 2 and 3 have no copy of step 5."""
    from rove.checkpoint.api import FlashCheckpointer

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "other-shm"))
    storage = FileStorage(tmp_path / "ckpt")
    for rank in (0, 1):
        engine, slot = saved(tmp_path, 5, rank=rank)
        storage.persist(engine, slot, rank=rank)
    monkeypatch.setenv("ROVE_RESTORE_STEP", "5")
    monkeypatch.setenv("ROVE_RESTORE_SOURCE", "storage")
    step, state = FlashCheckpointer(tmp_path / "ckpt", job="j1", rank=3).load()  # type: ignore[misc]
    assert step == 5 and torch.equal(state["w"], torch.full((1000,), 5.0))


def test_steps_of_an_abandoned_lineage_are_discarded_from_memory_and_storage(
    tmp_path: Path,
) -> None:
    import torch

    from rove.checkpoint.engine import FlashEngine
    from rove.checkpoint.storage import FileStorage

    engine = FlashEngine("lineage", 0, directory=tmp_path / "shm")
    storage = FileStorage(tmp_path / "ckpt")
    for step in (93, 94):
        stats = engine.save(step, {"w": torch.full((4,), float(step))})
        storage.persist(engine, stats.slot, 0)
    assert engine.discard_newer(93) == [94]
    assert [s.step for s in engine.slots()] == [93]
    assert storage.discard_newer(93) == [94] and storage.steps() == [93]
    stats = engine.save(94, {"w": torch.full((4,), -94.0)})  # the new lineage's step 94
    assert engine.load(step=94)[1]["w"][0].item() == -94.0
    assert engine.load(step=93)[1]["w"][0].item() == 93.0
