"""DDP training over leased data shards with flash checkpoints: every sample exactly once.

    rove run --standalone --nproc-per-node 2 --max-restarts 3 \\
        examples/train_sharded.py --samples 2000 --epochs 2

The dataset is generated (sample i is a deterministic feature vector and
target), so nothing is downloaded. Each rank draws batches from shards the
master leases (`rove.shard_service.ShardSampler`); the data position is saved
in the flash checkpoint with the model every `--ckpt-every` steps, so after a
restart the ranks resume exactly where the restored model stood.

`--trace FILE` appends one JSON line per rank and step with the (epoch, index)
of every sample trained in it: the tests rebuild the final model's lineage from
it and check that each index was trained exactly once per epoch.

Each step reports its busy time (the forward pass and the step's own work, not
the gradient allreduce that waits for the slowest rank) to rove's agent, which
is how rove's optimiser tells a straggler. Two options make this job misbehave
on purpose, to watch rove's scaler handle it (docs/scaling.md):

    --needs-memory 2.5G   allocate that much at step 5: with `--node-memory 2G`
                          the worker runs out of memory, and rove relaunches
                          the node with twice the memory
    --slow-nodes n1-a0 --slow-s 0.2   the workers of node n1-a0 take 0.2 s more
                          per step: rove replaces the straggler
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from rove.agent.progress import report
from rove.checkpoint.api import FlashCheckpointer
from rove.shard_service import ShardSampler

FEATURES = 8


class Generated(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: features from a generator seeded with i, target a fixed linear map of them."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.w = torch.linspace(-1, 1, FEATURES)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(FEATURES, generator=torch.Generator().manual_seed(i))
        return x, (x * self.w).sum(0, keepdim=True)


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--shard-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader-workers", type=int, default=1)
    p.add_argument("--ckpt-every", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--trace", default="")
    p.add_argument("--needs-memory", default="", help="allocate this much (e.g. 2.5G) at step 5")
    p.add_argument("--slow-nodes", default="", help="comma-separated rove nodes that are slow")
    p.add_argument("--slow-s", type=float, default=0.2, help="extra seconds per step there")
    args = p.parse_args()
    slow = os.environ.get("ROVE_NODE", "") in args.slow_nodes.split(",")

    dist.init_process_group("gloo", timeout=dt.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ShardSampler(
        "generated",
        args.samples,
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        epochs=args.epochs,
        seed=args.seed,
    )
    flash = FlashCheckpointer(os.environ.get("ROVE_CKPT_DIR"))
    step = 0
    restored = flash.load()
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sampler.load_state_dict(state["data"])
    ddp = DistributedDataParallel(model)
    round_ = int(os.environ.get("ROVE_ROUND", "0"))
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115 - kept open all run

    def log(row: dict[str, object]) -> None:
        if trace is not None:
            trace.write(
                json.dumps({"round": round_, "rank": rank, "pid": os.getpid(), **row}) + "\n"
            )
            trace.flush()

    log({"restored": step, "world": world, "source": flash.restored_from or "none"})
    if rank == 0:
        plural = "" if world == 1 else "s"
        print(
            f"training {args.epochs} epochs of {args.samples} samples on {world} worker{plural} "
            f"from step {step} ({flash.restored_from or 'fresh start'})",
            flush=True,
        )
    loss_fn = nn.MSELoss()
    began, trained = time.time(), 0
    for batch in sampler.loader(Generated(args.samples), num_workers=args.loader_workers):
        step += 1
        if batch is None:  # this rank ran out; others still train: a zero-size step
            x, y = torch.zeros(0, FEATURES), torch.zeros(0, 1)
        else:
            x, y = batch
        opt.zero_grad()
        work_began = time.perf_counter()
        out = ddp(x)
        if slow:
            time.sleep(args.slow_s)
        if step == 5 and args.needs_memory:
            need = torch.empty(_bytes(args.needs_memory), dtype=torch.uint8)  # MemoryError if short
            del need
        busy = time.perf_counter() - work_began
        loss = loss_fn(out, y) if len(x) else out.sum() * 0.0
        loss.backward()
        opt.step()
        trained += len(x)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        report(step, samples=len(x), busy_s=busy)
        samples = sampler.last_delivered if batch is not None else []
        log({"step": step, "t": time.time(), "samples": samples})
        if step % args.ckpt_every == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            flash.save(step, {**state, "data": sampler.state_dict()})
        if rank == 0 and step % 20 == 0:
            rate = trained * world / max(1e-9, time.time() - began)
            print(f"step {step}  loss {loss.item():.4f}  ~{rate:.0f} samples/s", flush=True)
    if rank == 0:
        print(f"done at step {step}", flush=True)
    sampler.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
