"""A tiny GPT-2 trained by the HuggingFace Trainer with flash checkpoints (no downloads).

    python hf_train.py OUT --max-steps 10 [--crash-at 6] [--flash]

Writes OUT/final.pt (the final weights) and OUT/resumed.json (the step it
resumed from, or null). With --crash-at N the process dies (os._exit) right
after step N, as a kill would.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from rove.checkpoint.hf import FlashCheckpointCallback


class Count(TrainerCallback):
    """Counts the steps run, and whether `watch` (a folder) was there after the first."""

    def __init__(self) -> None:
        self.steps = 0
        self.watch: str | None = None
        self.there_after_first: bool | None = None

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.steps += 1
        if self.steps == 1 and self.watch is not None:
            self.there_after_first = Path(self.watch).exists()


class Crash(TrainerCallback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.at:
            os._exit(3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--crash-at", type=int, default=0)
    parser.add_argument("--flash", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.1
    )
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": ids, "labels": ids}
        for ids in torch.randint(0, 64, (48, 16), generator=g)  # 48 samples: 6 steps an epoch
    ]
    training = TrainingArguments(
        output_dir=str(args.out / "hf"),
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="no",
        report_to=[],
        logging_strategy="no",
        use_cpu=True,
        seed=42,
        disable_tqdm=True,
    )
    count = Count()
    callbacks: list[TrainerCallback] = [count]
    flash = FlashCheckpointCallback(every=1)
    if args.flash:
        callbacks.append(flash)
    if args.crash_at:
        callbacks.append(Crash(args.crash_at))
    trainer = Trainer(model, args=training, train_dataset=data, callbacks=callbacks)
    resume = flash.resume_from(trainer) if args.flash else None
    count.watch = resume
    resumed = None if resume is None else json.loads(Path(resume, "trainer_state.json").read_text())
    trainer.train(resume_from_checkpoint=resume)
    torch.save(model.state_dict(), args.out / "final.pt")
    (args.out / "resumed.json").write_text(
        json.dumps(
            {
                "step": resumed and resumed["global_step"],
                "dir": resume,
                "steps_run": count.steps,
                "dir_after_first_step": count.there_after_first,
                "source": flash.checkpointer.restored_from if args.flash else "",
            }
        )
    )


if __name__ == "__main__":
    main()
