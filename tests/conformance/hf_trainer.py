"""The Hugging Face `Trainer` on a tiny model built from its config (no downloads), as
its DDP examples run it: the Trainer finds the launcher's environment and sets up the
process group itself (gloo on CPU). Each rank prints its loss at every step and the
model's final checksum.

    torchrun --standalone --nproc-per-node 2 hf_trainer.py STEPS
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Losses(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if logs and "loss" in logs:
            rank = os.environ["RANK"]  # (one write per line: the ranks share a pipe)
            sys.stdout.write(f"[{rank}] step {state.global_step} loss {logs['loss']}\n")
            sys.stdout.flush()


def main(steps: int, out: str) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    samples = torch.randint(0, 64, (64, 16), generator=g)
    data = [{"input_ids": ids, "labels": ids} for ids in samples]
    training = TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
    )
    trainer = Trainer(model, args=training, train_dataset=data, callbacks=[Losses()])
    trainer.train()
    total = sum(float(p.double().sum()) for p in model.parameters())
    sys.stdout.write(f"[{os.environ['RANK']}] world {training.world_size} checksum {total:.10f}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
