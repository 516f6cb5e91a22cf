"""FSDP (fully_shard) through torch.distributed.checkpoint on flash slots, 2 gloo processes.

Round trip bitwise from memory; the saver's persisted files load into a
different world size (DCP reshards); a corrupted newest step on storage makes
every rank fall back to the older one together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import flip_byte, free_port, leave_process_group

pytestmark = pytest.mark.slow

JOB = "fsdpjob"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 6))


def _local(value: Any) -> Any:
    """Deep copy of a state tree with every DTensor replaced by its local shard."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_local(v) for v in value)
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return local.detach().clone()
    return value


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> None:
    for step in steps:
        torch.manual_seed(1000 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()


def _worker(rank: int, world: int, port: int, shm: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        ROVE_SHM_DIR=shm,
        ROVE_JOB=JOB,
    )
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rove.checkpoint.dcp import DistributedCheckpointer
    from rove.checkpoint.storage import FileStorage
    from tests.test_checkpoint_engine import assert_same

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = DistributedCheckpointer()
    storage = FileStorage(Path(out) / "ckpt")

    def state() -> dict[str, Any]:
        msd, osd = get_state_dict(model, opt)
        # DCP treats plain tensors as replicated: per-rank values need per-rank keys
        extra = {"epoch": 7, f"rng-{rank}": torch.get_rng_state()}
        return {"model": msd, "optim": osd, "extra": extra}

    saved = {}
    for step in (2, 3):
        _train(model, opt, range(step, step + 1), rank)
        stats = ckpt.save(step, state())
        assert stats.step == step and stats.bytes > 0
        saved[step] = _local(state())
        # what the agent's saver does with a complete slot
        slot = next(s.slot for s in ckpt.engine.slots() if s.step == step)
        storage.persist(ckpt.engine, slot, rank)
    torch.save(saved[3]["model"], Path(out) / f"shard-{rank}.pt")

    _train(model, opt, range(4, 7), rank)  # move away from the checkpoint
    assert not torch.equal(_local(state())["model"]["0.weight"], saved[3]["model"]["0.weight"])

    # 1. restore from memory, bitwise, in place
    target = state()
    assert ckpt.load(target) == 3 and ckpt.restored_from == "memory"
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert_same(_local(state())["model"], saved[3]["model"])
    assert_same(_local(state())["optim"], saved[3]["optim"])
    assert target["extra"]["epoch"] == 7
    assert torch.equal(target["extra"][f"rng-{rank}"], saved[3]["extra"][f"rng-{rank}"])

    # 2. the agent asks for step 3 from storage, where rank 1's file is corrupted:
    #    both ranks move to step 2 together.
    dist.barrier()
    if rank == 1:
        flip_byte(Path(out) / "ckpt" / "step-00000003" / "rank-00001.ckpt", -3)
    dist.barrier()
    os.environ.update(ROVE_RESTORE_STEP="3", ROVE_RESTORE_SOURCE="storage")
    restored = DistributedCheckpointer(Path(out) / "ckpt")
    target = state()
    assert restored.load(target) == 2 and restored.restored_from == "storage"
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    assert_same(_local(state())["model"], saved[2]["model"])
    dist.barrier()
    Path(out, f"ok-{rank}").write_text("ok")
    leave_process_group()


def test_fsdp_round_trip_reshard_and_fallback(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    mp.spawn(_worker, args=(2, free_port(), str(shm), str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]

    # 3. the persisted step 2 (saved by 2 ranks) loads into a world of 1, unsharded,
    #    with nothing in memory: DCP reshards, each chunk read from its rank's file.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    from rove.checkpoint.dcp import FlashStorageReader
    from rove.checkpoint.storage import FileStorage

    os.environ["ROVE_SHM_DIR"] = str(tmp_path / "empty")
    whole = {"model": _model().state_dict()}
    # training went on from step 2: the corrupted step 3 was dropped with its lineage
    assert FileStorage(tmp_path / "ckpt").steps() == [2]
    reader = FlashStorageReader(JOB, 3, FileStorage(tmp_path / "ckpt"), memory=False)
    with pytest.raises(CheckpointException) as refused:
        load(whole, storage_reader=reader)
    assert "step 3 of rank 0 is not in" in str(refused.value.failures[0])
    load(whole, storage_reader=FlashStorageReader(JOB, 2, FileStorage(tmp_path / "ckpt")))
    shards = [torch.load(tmp_path / f"shard-{r}.pt") for r in (0, 1)]  # step 3's shards
    for name, tensor in whole["model"].items():
        step3 = torch.cat([s[name] for s in shards])
        assert tensor.shape == step3.shape  # 2 shards of dim 0 become one tensor
    # step 2's unsharded weights differ from step 3's (one optimizer step apart)
    assert not torch.equal(whole["model"]["0.weight"], torch.cat([s["0.weight"] for s in shards]))
