"""The worker of `benchmarks/warm_imports.py`: a tiny GPT-2 trained by the HuggingFace
`Trainer` (DDP over gloo, no downloads), as a torchrun user's script is, with rove's
step reports. Each step appends {rank, restart, step, t, pid, imports_s} to TRACE;
`imports_s` is what its imports took in this process (torch's and the HF stack's).

    python warm_imports_script.py TRACE [--steps 100000] [--step-sleep 0.05]
"""

from __future__ import annotations

import time

_began = time.monotonic()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from rove.agent.progress import report  # noqa: E402 (a no-op under torchrun)

IMPORTS_S = time.monotonic() - _began


class Trace(TrainerCallback):  # type: ignore[misc]  # (transformers: not followed)
    def __init__(self, path: str, sleep: float) -> None:
        self.path = path
        self.sleep = sleep
        self.rank = int(os.environ.get("RANK", "0"))
        self.restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        time.sleep(self.sleep)
        report(state.global_step)
        row = {
            "rank": self.rank,
            "restart": self.restart,
            "step": state.global_step,
            "t": time.time(),
            "pid": os.getpid(),
            "imports_s": round(IMPORTS_S, 3),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("trace")
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    a = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (256, 16), generator=g)
    ]
    training = TrainingArguments(
        output_dir=str(Path(a.trace).parent / "hf"),
        max_steps=a.steps,
        per_device_train_batch_size=4,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
    )
    Trainer(
        model=GPT2LMHeadModel(config),
        args=training,
        train_dataset=data,
        callbacks=[Trace(a.trace, a.step_sleep)],
    ).train()


if __name__ == "__main__":
    main()
