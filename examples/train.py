"""A small real training job: a transformer learns to reverse digit sequences.

Data is generated (no downloads). DDP over gloo on CPU (NCCL when CUDA is
there). Rank 0 checkpoints every `--ckpt-every` steps (write to a temporary
file, then rename) and every rank resumes from the newest checkpoint, so a
restarted job continues where it stopped. Works under `rove run` and `torchrun`:

    rove run --standalone --nproc-per-node 2 examples/train.py --steps 300
    torchrun --standalone --nproc-per-node 2 examples/train.py --steps 300

Each step is reported to rove's agent (`rove.agent.progress.report`), which
feeds heartbeats, throughput and hang detection; it is a no-op elsewhere.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

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


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic per (step, rank): the same step always sees the same data."""
    g = torch.Generator().manual_seed(step * 10_007 + rank)
    digits = torch.randint(0, 10, (size, LENGTH), generator=g)
    sep = torch.full((size, 1), 10)
    tokens = torch.cat([digits, sep, digits.flip(1)], dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    tmp.replace(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--ckpt-dir",
        default=os.environ.get("TRAIN_CKPT_DIR"),
        help="where torch.save checkpoints go (default: checkpoints/<job>, the job being "
        "TORCHELASTIC_RUN_ID: a restarted worker resumes, a new job starts afresh)",
    )
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument(
        "--flash",
        action="store_true",
        help="flash checkpoints (rove.checkpoint) instead of torch.save",
    )
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument(
        "--trace",
        default=os.environ.get("TRAIN_TRACE"),
        help="append one JSON line per rank and step to this file (for tests)",
    )
    args = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if backend == "nccl" else "cpu")
    torch.manual_seed(0)
    model = Reverser().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    job = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt = Path(args.ckpt_dir or Path("checkpoints") / job) / "ckpt.pt"
    start = 0
    source = "none"
    load_s = 0.0
    flash = None
    if args.flash:
        from rove.checkpoint.api import FlashCheckpointer

        flash = FlashCheckpointer(os.environ.get("ROVE_CKPT_DIR"))
        loading = time.monotonic()
        restored = flash.load()
        load_s = time.monotonic() - loading
        if restored is not None:
            start, state = restored
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            source = flash.restored_from
    elif ckpt.exists():
        loading = time.monotonic()
        state = torch.load(ckpt, map_location=device)
        load_s = time.monotonic() - loading
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        source = "file"
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
            print(
                f"training from step {start} to {args.steps} on {world} workers "
                f"(restart {restart}, {restored_from})",
                flush=True,
            )
    per_rank = max(1, args.batch_size // world)
    loss_fn = nn.CrossEntropyLoss()
    began = time.time()
    for step in range(start + 1, args.steps + 1):
        inputs, targets = batch(step, rank, per_rank)
        logits = ddp(inputs.to(device))
        loss = loss_fn(
            logits[:, LENGTH:].reshape(-1, VOCAB), targets[:, LENGTH:].reshape(-1).to(device)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_sleep:
            time.sleep(args.step_sleep)
        report(step, samples=per_rank)
        if args.trace:
            with open(args.trace, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "rank": rank,
                            "step": step,
                            "world": world,
                            "pid": os.getpid(),
                            "restart": int(restart),
                            "source": source,
                            "t": time.time(),
                        }
                    )
                    + "\n"
                )
        if flash is not None and step % args.ckpt_every == 0:
            flash.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        elif rank == 0 and step % args.ckpt_every == 0:
            save(ckpt, model, opt, step)
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = (step - start) * per_rank * world / max(1e-9, time.time() - began)
            print(
                f"step {step}/{args.steps}  loss {loss.item():.3f}  "
                f"{rate:.0f} samples/s  world {world}",
                flush=True,
            )
    if rank == 0 and flash is None:
        save(ckpt, model, opt, args.steps)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
