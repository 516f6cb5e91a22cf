"""Persisting checkpoints to an object store (S3 protocol, against moto's S3 server in a
process of its own): the same guarantees as on files, and what a user sees when the
store is wrong or away."""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

from rove.checkpoint import durable, object_store
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.object_store import ObjectStorage
from rove.checkpoint.storage import FileStorage, SlotOverwritten, StorageError
from rove.checkpoint.stores import open_storage
from tests.s3server import S3Server
from tests.support import TRAIN, RunProc, free_port, shm_root, trace_rows


def saved(tmp_path: Path, step: int, rank: int = 0, n: int = 1000) -> tuple[FlashEngine, int]:
    engine = FlashEngine("j1", rank, directory=tmp_path / "shm")
    stats = engine.save(step, {"w": torch.full((n,), float(step)), "step": step, "t": (1, 2)})
    return engine, stats.slot


def objects(storage: ObjectStorage) -> list[str]:
    import obstore

    return sorted(o["path"] for batch in obstore.list(storage.store) for o in batch)


def put(storage: ObjectStorage, path: str, data: bytes) -> None:
    import obstore

    obstore.put(storage.store, path, data)


def get(storage: ObjectStorage, path: str) -> bytes:
    import obstore

    return bytes(obstore.get(storage.store, path).bytes())


def test_a_location_picks_its_storage(tmp_path: Path) -> None:
    assert isinstance(open_storage("s3://bucket/prefix"), ObjectStorage)
    assert isinstance(open_storage("gs://bucket/prefix"), ObjectStorage)
    assert isinstance(open_storage(tmp_path / "ckpt"), FileStorage)
    local = open_storage(f"file://{tmp_path}/ckpt")
    assert isinstance(local, FileStorage) and local.root == tmp_path / "ckpt"
    with pytest.raises(StorageError, match="cannot use ftp://host/x for checkpoints"):
        open_storage("ftp://host/x")


@pytest.mark.parametrize("n", [1000, 5_000_000], ids=["one put", "multipart"])
def test_a_persisted_step_loads_back_bitwise(tmp_path: Path, s3_url: str, n: int) -> None:
    """20 MB is uploaded in parts (each but the last at least the store's minimum)."""
    storage = open_storage(s3_url)
    assert isinstance(storage, ObjectStorage) and storage.location == s3_url
    engine, slot = saved(tmp_path, 7, rank=3, n=n)
    manifest = storage.persist(engine, slot, rank=3)
    assert (manifest.step, manifest.rank) == (7, 3)
    assert storage.persisted_ranks(7) == {3} and storage.steps() == [7]
    assert objects(storage) == ["step-00000007/rank-00003.ckpt", "step-00000007/rank-00003.json"]
    state = storage.load(7, 3)
    assert state["step"] == 7 and state["t"] == (1, 2)
    assert torch.equal(state["w"], torch.full((n,), 7.0))
    state["w"] += 1  # tensors view a writable buffer


def test_commit_marks_the_step_and_keeps_the_last_k(tmp_path: Path, s3_url: str) -> None:
    storage = open_storage(s3_url)
    assert storage.committed() is None
    for step in (1, 2, 3, 4):
        engine, slot = saved(tmp_path, step)
        storage.persist(engine, slot, rank=0)
        storage.commit(step, keep=2)
    assert storage.committed() == 4
    assert storage.steps() == [3, 4]
    with pytest.raises(CheckpointError, match="never persisted"):
        storage.commit(5, keep=2)
    assert storage.committed() == 4
    storage.commit(4, keep=2, job="sweep-lr1")
    assert storage.tracker() == durable.Tracker(4, "sweep-lr1"), "the job that committed"


def test_a_rank_counts_as_persisted_only_with_its_data_and_its_manifest(
    tmp_path: Path, s3_url: str
) -> None:
    storage = open_storage(s3_url)
    assert isinstance(storage, ObjectStorage)
    engine, slot = saved(tmp_path, 3)
    storage.persist(engine, slot, rank=0)
    put(storage, "step-00000003/rank-00001.ckpt", b"an upload whose manifest never came")
    put(storage, "step-00000003/rank-00002.json", b"{}")  # and a manifest without data
    put(storage, "step-00000003/rank-x.json", b"{}")
    assert storage.persisted_ranks(3) == {0}
    with pytest.raises(CheckpointError, match="step 3 of rank 1 is not in s3://"):
        storage.load(3, 1)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_object_is_refused(tmp_path: Path, s3_url: str, damage: str) -> None:
    storage = open_storage(s3_url)
    assert isinstance(storage, ObjectStorage)
    engine, slot = saved(tmp_path, 2)
    storage.persist(engine, slot, rank=0)
    data = "step-00000002/rank-00000.ckpt"
    raw = bytearray(get(storage, data))
    if damage == "flip":
        raw[-10] ^= 0xFF
        put(storage, data, bytes(raw))
    elif damage == "truncate":
        put(storage, data, bytes(raw[:-100]))
    else:
        put(storage, "step-00000002/rank-00000.json", b"{not json")
    match = {"flip": "checksum", "truncate": "truncated", "manifest": "manifest of step 2"}
    with pytest.raises(CheckpointError, match=match[damage]):
        storage.load(2, 0)


def test_a_slot_overwritten_during_its_upload_leaves_nothing_behind(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workers saved faster than the store took it: the upload may mix two steps,
    so no manifest names it and it is removed."""
    storage = open_storage(s3_url)
    assert isinstance(storage, ObjectStorage)
    engine, slot = saved(tmp_path, 5)
    upload = ObjectStorage._put

    def racing(self: ObjectStorage, path: str, chunks: list[Any]) -> None:
        upload(self, path, chunks)
        if path.endswith(".ckpt"):
            for step in (6, 7):  # every slot saved again, the persisted one included
                engine.save(step, {"w": torch.full((1000,), float(step)), "step": step})

    monkeypatch.setattr(ObjectStorage, "_put", racing)
    with pytest.raises(SlotOverwritten):
        storage.persist(engine, slot, rank=0)
    assert objects(storage) == [] and storage.persisted_ranks(5) == set()


def test_steps_of_an_abandoned_lineage_are_discarded(tmp_path: Path, s3_url: str) -> None:
    storage = open_storage(s3_url)
    for step in (93, 94, 95):
        engine, slot = saved(tmp_path, step)
        storage.persist(engine, slot, rank=0)
    assert storage.discard_newer(93) == [94, 95]
    assert storage.steps() == [93] and storage.persisted_ranks(94) == set()


def test_a_corrupted_committed_step_falls_back_to_the_older_one(
    tmp_path: Path, s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpointer a training script uses, restoring from the store."""
    from rove.checkpoint.api import FlashCheckpointer

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "other-shm"))
    storage = open_storage(s3_url)
    assert isinstance(storage, ObjectStorage)
    for step in (3, 4):
        engine, slot = saved(tmp_path, step)
        storage.persist(engine, slot, rank=0)
        storage.commit(step, keep=3)
    data = "step-00000004/rank-00000.ckpt"
    put(storage, data, get(storage, data)[:-10])
    monkeypatch.setenv("ROVE_RESTORE_STEP", "4")
    monkeypatch.setenv("ROVE_RESTORE_SOURCE", "storage")
    ckpt = FlashCheckpointer(s3_url, job="j1", rank=0)
    step, state = ckpt.load()  # type: ignore[misc]
    assert step == 3 and state["step"] == 3 and ckpt.restored_from == "storage"
    assert storage.steps() == [3], "training goes on from 3: the broken step 4 is dropped"


def test_a_missing_bucket_is_a_clear_error(
    tmp_path: Path, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    storage = open_storage("s3://no-such-bucket/ckpt")
    engine, slot = saved(tmp_path, 1)
    with pytest.raises(StorageError) as caught:
        storage.persist(engine, slot, rank=0)
    said = str(caught.value)
    assert said.startswith("could not persist step 1 of rank 0 in s3://no-such-bucket/ckpt")
    assert "check the bucket, the endpoint and the credentials" in said
    assert "\n" not in said, "one line, not the HTTP client's dump"
    assert engine.load()[0] == 1, "the in-memory checkpoint is untouched"


def test_an_unreachable_store_fails_within_its_retry_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setattr(object_store, "RETRY_TIMEOUT_S", 1.0)
    storage = open_storage("s3://bucket/ckpt")
    engine, slot = saved(tmp_path, 1)
    with pytest.raises(StorageError, match="could not persist step 1 of rank 0"):
        storage.persist(engine, slot, rank=0)
    with pytest.raises(StorageError, match="could not read the committed step"):
        storage.committed()


def test_the_server_is_a_real_s3_endpoint(s3_server: S3Server) -> None:
    """What the tests above run against: an HTTP server answering S3's REST calls."""
    with urllib.request.urlopen(f"{s3_server.endpoint}/", timeout=10) as answer:
        assert b"ListAllMyBucketsResult" in answer.read()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["s3", "directory"])
def test_a_job_persists_to_the_store_and_a_later_run_resumes_from_it(
    tmp_path: Path, request: pytest.FixtureRequest, where: str
) -> None:
    """`rove run --checkpoint-dir s3://...` (or a directory): the job's last step is
    committed before it ends, and a new run of the job, on a machine whose memory holds
    nothing of it, goes on from that step (it used to start afresh and drop it)."""
    location = request.getfixturevalue("s3_url") if where == "s3" else str(tmp_path / "ckpt")
    # (a name of each case's own: the two may run at once, and /dev/shm is the machine's)
    mine = f"s3job-{where}"

    def run(name: str, steps: int, job: str = mine) -> RunProc:
        node = RunProc(
            tmp_path,
            name,
            *("--standalone", "--job", job, "--nproc-per-node", "2"),
            *("--checkpoint-dir", location, "--persist-every", "5"),
            *(str(TRAIN), "--ckpt-every", "1", "--steps", str(steps)),
            *("--trace", str(tmp_path / f"{name}.jsonl")),
            env={"ROVE_HOME": str(tmp_path / f"home-{name}")},
        )
        assert node.wait(240) == 0, node.log()[-4000:]
        return node

    first = run("first", 12)
    assert "its last checkpoint, step 12, is committed" in first.log(), first.log()[-3000:]
    storage = open_storage(location)
    assert storage.committed() == 12 and storage.persisted_ranks(12) == {0, 1}
    assert not list(shm_root().glob(f"rove-ckpt-{mine}.*")), "nothing left in memory"

    second = run("second", 16)
    assert f"found step 12 committed in {location} by an earlier run" in second.log()
    steps = sorted({r["step"] for r in trace_rows(tmp_path / "second.jsonl")})
    assert steps == [13, 14, 15, 16], f"resumed after step 12, from storage: {steps}"
    assert storage.committed() == 16
    if where == "s3":
        return  # (the store's tracker names its job: test_commit_marks_the_step_...)
    # another job given the same location goes on from it, and is told whose it is
    other = run("other", 18, job=f"{mine}-b")
    said = f"found step 16 committed in {location} by another job, {mine}: this job goes on"
    assert said in other.log(), other.log()[-3000:]
    assert storage.tracker() == durable.Tracker(18, f"{mine}-b")
