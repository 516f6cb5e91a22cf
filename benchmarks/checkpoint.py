"""Flash checkpoint vs torch.save vs a bare memcpy of the same bytes, in one run.

For a state of --size-mb (a few large float32 tensors, like model + optimizer):
  - flash_save_s: blocking time of a steady-state flash save (segments already
    allocated; the first save, which allocates and pre-touches, is reported apart);
  - torch_save_s: torch.save to a local file (page cache, no fsync);
  - memcpy_s: copying the same bytes into an already-touched buffer (the limit);
  - flash_load_s / torch_load_s: restoring them into existing tensors (what
    `model.load_state_dict` does): views into shared memory copied in, versus
    torch.load then copied in.
And step_overhead_ratio: the time of a training step of an MLP of --model-mb
with a flash save after every step, over the same step without checkpoints.
Each timing is the median of --repeats. Prints one JSON line.

    python benchmarks/checkpoint.py --size-mb 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rove.checkpoint.engine import FlashEngine


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def state_of(size_mb: int) -> dict[str, torch.Tensor]:
    n = size_mb * 2**20 // 4
    parts = 8
    return {f"t{i}": torch.randn(n // parts) for i in range(parts)}


def step_overhead(model_mb: int, repeats: int, shm: Path) -> tuple[float, float]:
    width = int((model_mb * 2**20 / 4 / 4) ** 0.5)  # 4 square layers
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(4)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x = torch.randn(256, width)
    engine = FlashEngine("bench-step", 0, directory=shm)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    def step_and_save() -> None:
        step()
        engine.save(0, {"model": model.state_dict()})

    step_and_save()  # allocate segments
    step_and_save()
    plain = timed(step, repeats)
    with_save = timed(step_and_save, repeats)
    engine.unlink()
    return plain, with_save / plain


def main() -> dict[str, object]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--model-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    state = state_of(a.size_mb)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        engine = FlashEngine("bench", 0, directory=Path(shm))
        t = time.perf_counter()
        engine.save(0, state)
        first_save = time.perf_counter() - t
        engine.save(1, state)  # both slots allocated
        flash_save = timed(lambda: engine.save(2, state), a.repeats)
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        for k in state:
            dst[k].copy_(state[k])  # touch: these stand for the model's own tensors

        def restore(loaded: dict[str, torch.Tensor]) -> None:
            for k, v in loaded.items():
                dst[k].copy_(v)

        flash_load = timed(lambda: restore(engine.load(copy=False)[1]), a.repeats)

        path = Path(tmp) / "ckpt.pt"
        torch_save = timed(lambda: torch.save(state, path), a.repeats)
        torch_load = timed(lambda: restore(torch.load(path)), a.repeats)

        def memcpy() -> None:
            for k, v in state.items():
                dst[k].copy_(v)

        copy = timed(memcpy, a.repeats)
        engine.unlink()
        step_s, overhead = step_overhead(a.model_mb, a.repeats, Path(shm))
    return {
        "benchmark": "checkpoint",
        "size_mb": a.size_mb,
        "flash_save_s": round(flash_save, 4),
        "flash_first_save_s": round(first_save, 4),
        "torch_save_s": round(torch_save, 4),
        "memcpy_s": round(copy, 4),
        "flash_load_s": round(flash_load, 4),
        "torch_load_s": round(torch_load, 4),
        "ratio_flash_memcpy": round(flash_save / copy, 3),
        "speedup_save": round(torch_save / flash_save, 2),
        "speedup_load": round(torch_load / flash_load, 2),
        "model_mb": a.model_mb,
        "step_s": round(step_s, 4),
        "step_overhead_ratio": round(overhead, 4),
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
