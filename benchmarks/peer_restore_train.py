"""The trainer of `benchmarks/peer_restore.py`: a state of --size-mb per rank, ranks in
lockstep (an allreduce per step, as DDP), a checkpoint every --ckpt-every steps: rove's
flash checkpoint (`--checkpoint flash`), or `torch.save` by rank 0, loaded by every rank with
`torch.load` on a restart (`--checkpoint torch`, what a torchrun user has). One trace
line per rank and step: rank, step, pid, the step it restored and from where."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--checkpoint", choices=("flash", "torch"), default="flash")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--trace", type=Path, required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    began = time.monotonic()
    state: dict[str, Any] | None = None
    source, start = "none", 0
    flash = None
    path = a.ckpt_dir / "ckpt.pt"  # rank 0 saves, every rank loads it (replicated state)
    if a.checkpoint == "flash":
        from rove.checkpoint.api import FlashCheckpointer

        flash = FlashCheckpointer()
        restored = flash.load()
        if restored is not None:
            start, state = restored
            source = flash.restored_from or "memory"
    elif path.exists():
        state = torch.load(path)
        start, source = int(state["step"]), "file"
    if state is None:
        state = {"w": torch.zeros(a.size_mb << 18), "step": torch.tensor(0)}
    load_s = time.monotonic() - began
    w = state["w"]
    one = torch.ones(1)
    for step in range(start + 1, a.steps + 1):
        w[step % w.numel()] += 1.0  # the state changes every step
        dist.all_reduce(one)  # the ranks in lockstep, as DDP's gradients keep them
        time.sleep(a.step_s)
        state["step"] = torch.tensor(step)
        with open(a.trace, "a") as f:
            row = {"rank": rank, "step": step, "pid": os.getpid(), "from": start, "source": source}
            f.write(json.dumps({**row, "load_s": round(load_s, 3), "t": time.time()}) + "\n")
        if step % a.ckpt_every == 0:
            if flash is not None:
                flash.save(step, state)
            elif rank == 0:
                a.ckpt_dir.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save(state, tmp)
                tmp.replace(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
