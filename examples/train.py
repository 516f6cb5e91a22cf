"""A small real training job: a transformer learns to reverse digit sequences.

This is the script to copy. Under `rove run` it uses rove's two headline
features the way the docs recommend:

- **flash checkpoints** (`rove.checkpoint.api.FlashCheckpointer`): every
  `--ckpt-every` steps each rank saves its state to shared memory in
  milliseconds; rove persists it in the background, saves it when a worker
  fails, and after a restart the workers restore from memory (or a peer, or
  storage) and say from where and how fast;
- **leased data shards** (`rove.shard_service.ShardSampler`): the master
  leases small shards of the dataset to the ranks, the data position is saved
  with the model, so after a failure no sample is lost or trained twice, and
  faster ranks get more data.

Elsewhere (`torchrun`, plain python) it falls back to `torch.save` by rank 0
(write to a temporary file, then rename) and data generated per step and
rank. `--checkpoint` and `--data` choose explicitly:

    rove run --standalone --nproc-per-node 2 examples/train.py --steps 300
    torchrun --standalone --nproc-per-node 2 examples/train.py --steps 300

Data is generated (no downloads): sample i is a sequence of digits seeded by i.
DDP over gloo on CPU (NCCL when CUDA is there). Each step is reported to
rove's agent (`rove.agent.progress.report`), which feeds heartbeats,
throughput and hang detection; it is a no-op elsewhere.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

try:
    from rove.agent.progress import report
except ImportError:  # running without rove installed

    def report(step: int, samples: float = 0.0) -> None:
        pass


VOCAB, LENGTH = 12, 12  # digits 0-9, a separator and padding


class Reverser(nn.Module):
    def __init__(self, d_model: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(2 * LENGTH + 1, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True, dropout=0.0
        )
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.encoder(x))


UNDER_ROVE = "ROVE_JOB" in os.environ


def sequence(i: int) -> torch.Tensor:
    """Sample i of the dataset: digits seeded by i, a separator, the digits reversed."""
    digits = torch.randint(0, 10, (LENGTH,), generator=torch.Generator().manual_seed(i))
    return torch.cat([digits, torch.tensor([10]), digits.flip(0)])


class Sequences(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return sequence(i)


def generated(start: int, rank: int, size: int) -> Iterator[torch.Tensor]:
    """Without rove: batches generated per (step, rank), the same step always the same data."""
    step = start
    while True:
        step += 1
        base = (step * 10_007 + rank) * size
        yield torch.stack([sequence(base + j) for j in range(size)])


def save(path: Path, state: dict[str, Any], step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({**state, "step": step}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="over all ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--checkpoint",
        choices=("flash", "torch"),
        default="flash" if UNDER_ROVE else "torch",
        help="flash: rove.checkpoint, in memory and persisted by rove (the default under "
        "rove run); torch: torch.save by rank 0 to --ckpt-dir (the default elsewhere)",
    )
    p.add_argument(
        "--data",
        choices=("shards", "generated"),
        default="shards" if UNDER_ROVE else "generated",
        help="shards: leased from rove's master, every sample exactly once (the default "
        "under rove run); generated: per step and rank, no coordination (elsewhere)",
    )
    p.add_argument("--samples", type=int, default=50_000, help="dataset size (--data shards)")
    p.add_argument("--shard-size", type=int, default=256, help="samples per leased shard")
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("TRAIN_CKPT_DIR"),
        help="where torch.save checkpoints go (default: checkpoints/<job>, the job being "
        "TORCHELASTIC_RUN_ID: a restarted worker resumes, a new job starts afresh); "
        "flash checkpoints persist to rove run's --checkpoint-dir",
    )
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--trace",
        default=os.environ.get("TRAIN_TRACE"),
        help="append one JSON line per rank and step to this file (for tests)",
    )
    args = p.parse_args()
    if args.data == "shards" and not UNDER_ROVE:
        p.error("--data shards needs rove run (its master leases the shards)")

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if backend == "nccl" else "cpu")
    torch.manual_seed(0)
    model = Reverser().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    per_rank = max(1, args.batch_size // world)
    sampler = None
    if args.data == "shards":
        from rove.shard_service import ShardSampler

        sampler = ShardSampler(
            "reversals",
            args.samples,
            batch_size=per_rank,
            shard_size=args.shard_size,
            # enough passes for --steps at any world size: the spec stays the same
            epochs=-(-args.steps * args.batch_size // args.samples) + 1,
        )
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt = Path(args.ckpt_dir or Path("checkpoints") / job) / "ckpt.pt"
    start, source, load_s = 0, "none", 0.0
    state: dict[str, Any] | None = None
    flash = None
    loading = time.monotonic()
    if args.checkpoint == "flash":
        from rove.checkpoint.api import FlashCheckpointer

        flash = FlashCheckpointer()  # job, rank and --checkpoint-dir come from rove run
        restored = flash.load()
        if restored is not None:
            start, state = restored
            source = flash.restored_from or "memory"
    elif ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        start, source = state["step"], "file"
    load_s = time.monotonic() - loading
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        if sampler is not None and "data" in state:
            sampler.load_state_dict(state["data"])
    ddp = DistributedDataParallel(model)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if rank == 0:
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        if start >= args.steps:
            print(
                f"already trained to step {start} of {args.steps} (restored from {source}, "
                f"{ckpt.parent if source == 'file' else 'flash checkpoint'}): nothing to do; "
                "give another --job (or --ckpt-dir) to train afresh",
                flush=True,
            )
        else:
            restored_from = (
                f"restored step {start} from {source} in {load_s:.3f}s"
                if start
                else "a fresh start"
            )
            plural = "" if world == 1 else "s"
            print(
                f"training from step {start} to {args.steps} on {world} worker{plural} "
                f"(restart {restart}, {restored_from}; {args.checkpoint} checkpoints, "
                f"{args.data} data)",
                flush=True,
            )
    if sampler is not None:
        batches: Iterator[torch.Tensor | None] = iter(sampler.loader(Sequences(args.samples)))
    else:
        batches = generated(start, rank, per_rank)
    loss_fn = nn.CrossEntropyLoss()
    began = time.time()
    for step in range(start + 1, args.steps + 1):
        tokens = next(batches, None)
        if tokens is None:  # this rank's shards ran out while others train: a zero-size step
            tokens = torch.zeros(0, 2 * LENGTH + 1, dtype=torch.long)
        inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        logits = ddp(inputs)
        loss = loss_fn(logits[:, LENGTH:].reshape(-1, VOCAB), targets[:, LENGTH:].reshape(-1))
        opt.zero_grad()
        (loss if len(tokens) else logits.sum() * 0.0).backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        report(step, samples=len(tokens))
        if args.trace:
            row = {
                "rank": rank,
                "step": step,
                "world": world,
                "pid": os.getpid(),
                "restart": int(restart),
                "source": source,
                "t": time.time(),
            }
            if sampler is not None:
                row["samples"] = sampler.last_delivered
            with open(args.trace, "a") as f:
                f.write(json.dumps(row) + "\n")
        if step % args.ckpt_every == 0 or (flash is None and step == args.steps):
            state = {"model": model.state_dict(), "opt": opt.state_dict()}
            if sampler is not None:  # collective: every rank takes part
                state["data"] = sampler.state_dict()
            if flash is not None:
                flash.save(step, state)
            elif rank == 0:
                save(ckpt, state, step)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = (step - start) * per_rank * world / max(1e-9, time.time() - began)
            print(
                f"step {step}/{args.steps}  loss {loss.item():.3f}  "
                f"{rate:.0f} samples/s  world {world}",
                flush=True,
            )
    if sampler is not None:
        sampler.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
