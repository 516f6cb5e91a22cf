"""FlashCheckpointer with DDP on 2 processes over gloo: bitwise round trips."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.support import flip_byte, free_port, leave_process_group

pytestmark = pytest.mark.slow


def _worker(rank: int, world: int, port: int, shm: str, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        ROVE_SHM_DIR=shm,
        ROVE_JOB="ddpjob",
    )
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from rove.checkpoint.api import FlashCheckpointer
    from tests.test_checkpoint_engine import assert_same

    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(32, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, 4):
        torch.manual_seed(step * 100 + rank)
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
    state = {
        "model": model.module.state_dict(),
        "optim": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "step": 3,
    }
    ckpt = FlashCheckpointer()
    ckpt.save(3, state)
    dist.barrier()

    # Every rank restores its own copy bitwise ...
    step, back = FlashCheckpointer().load()
    assert step == 3
    assert_same(state, back)
    # ... and a rank-0-only checkpoint is enough for every rank of the node.
    _, from_zero = FlashCheckpointer(source_rank=0).load()
    fresh = torch.nn.Linear(32, 8)
    fresh.load_state_dict(from_zero["model"])
    for a, b in zip(fresh.parameters(), model.module.parameters(), strict=True):
        assert torch.equal(a, b), "DDP replicas are identical, so rank 0's copy restores any rank"
    dist.barrier()

    # The agent asks for step 5 from storage; rank 1's file of it is corrupted:
    # both ranks move to step 4 together, never one rank on each.
    from rove.checkpoint.storage import FileStorage

    storage = FileStorage(Path(out) / "ckpt")
    for step in (4, 5):
        ckpt.save(step, {**state, "step": step})
        storage.persist(ckpt.engine, ckpt.engine.newest().slot, rank)  # type: ignore[union-attr]
    dist.barrier()
    if rank == 1:
        path = storage.root / "step-00000005" / "rank-00001.ckpt"
        flip_byte(path, path.stat().st_size // 2)
    dist.barrier()
    os.environ.update(ROVE_RESTORE_STEP="5", ROVE_RESTORE_SOURCE="storage")
    restorer = FlashCheckpointer(storage.root)
    step, back = restorer.load()
    assert step == 4 and back["step"] == 4 and restorer.restored_from == "storage"
    dist.barrier()
    Path(out, f"ok-{rank}").write_text("ok")
    leave_process_group()


def test_ddp_state_round_trips_bitwise_on_two_processes(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    mp.spawn(_worker, args=(2, free_port(), str(shm), str(tmp_path)), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("ok-*")) == ["ok-0", "ok-1"]
