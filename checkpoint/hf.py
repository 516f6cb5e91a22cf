"""Flash checkpoints for the HuggingFace `transformers.Trainer`.

    from rove.checkpoint.hf import FlashCheckpointCallback

    flash = FlashCheckpointCallback(every=1)          # a flash save every optimizer step
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[flash])
    trainer.train(resume_from_checkpoint=flash.resume_from(trainer))

At the end of every `every`-th optimizer step the callback copies the model,
optimizer, scheduler, RNG and trainer state into shared memory (milliseconds;
no `torch.save`). Under `rove run` the agent persists and commits it like any
flash checkpoint. Keep the Trainer's own `save_strategy` for the occasional
full export, or set it to "no".

`resume_from(trainer)` returns None on a fresh start. After a restart it
loads the step to resume from (the one `rove run` chose, else the newest in
memory, else the committed one on storage) and lays it out as a regular
Trainer checkpoint directory in shared memory, so the Trainer resumes through
its own code path: model, optimizer, scheduler, RNG, and the batches of the
current epoch already trained are skipped. The directory is removed when
training ends.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from rove.checkpoint.api import FlashCheckpointer
from rove.checkpoint.engine import default_dir
from rove.control.process import tempdirs

#: file names of a Trainer checkpoint directory (transformers.trainer)
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
SCHEDULER = "scheduler.pt"


def rng_state() -> dict[str, Any]:
    """The generators the Trainer restores, in a form a flash slot stores."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, np.asarray(keys).astype(np.int64), pos, has_gauss, cached),
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def _trainer_rng(saved: dict[str, Any]) -> dict[str, Any]:
    """`rng_state()` as the Trainer's `rng_state.pth` holds it."""
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    out = {
        "python": saved["python"],
        "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached),
        "cpu": saved["cpu"],
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out


# (transformers' types are not followed by mypy, see pyproject.toml: its base is Any)
class FlashCheckpointCallback(TrainerCallback):  # type: ignore[misc]
    def __init__(self, every: int = 1, checkpoint_dir: str | Path | None = None) -> None:
        if every < 1:
            raise ValueError(
                f"every must be 1 or more (a save every N optimizer steps), not {every}"
            )
        self.every = every
        self.checkpoint_dir = checkpoint_dir
        self._ckpt: FlashCheckpointer | None = None
        self.materialized: Path | None = None
        self.last_save_s = 0.0

    @property
    def checkpointer(self) -> FlashCheckpointer:
        if self._ckpt is None:
            self._ckpt = FlashCheckpointer(self.checkpoint_dir)
        return self._ckpt

    def on_step_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        # By its first step the Trainer has read all it reads of the checkpoint
        # `resume_from` wrote out (the model and optimizer before training begins, the
        # RNG state as the resumed epoch starts or once its trained batches are
        # skipped): that copy of the whole state goes now, not when training ends.
        self.cleanup()

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if state.global_step % self.every:
            return
        snapshot = {
            "model": kwargs["model"].state_dict(),
            "optimizer": kwargs["optimizer"].state_dict(),
            "scheduler": kwargs["lr_scheduler"].state_dict(),
            "rng": rng_state(),
            "trainer_state": json.dumps(dataclasses.asdict(state), sort_keys=True),
        }
        self.last_save_s = self.checkpointer.save(state.global_step, snapshot).blocking_s

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        self.cleanup()

    def resume_from(self, trainer: Any) -> str | None:
        """A Trainer checkpoint directory to pass to `train()`, or None on a fresh start.

        Raises:
            CheckpointError: a step was chosen but no copy of it could be read.
        """
        loaded = self.checkpointer.load()
        if loaded is None:
            return None
        step, saved = loaded
        # (named for this worker: one killed before `cleanup` left it in memory, until
        # the next worker's resume removes it)
        directory = tempdirs.make(f"rove-hf-{step}", default_dir())
        self.materialized = directory
        atexit.register(self.cleanup)
        model = trainer.model
        model.load_state_dict(saved["model"])
        model.save_pretrained(directory)
        torch.save(saved["optimizer"], directory / OPTIMIZER)
        torch.save(saved["scheduler"], directory / SCHEDULER)
        world = trainer.args.world_size
        rng_name = f"rng_state_{trainer.args.process_index}.pth" if world > 1 else "rng_state.pth"
        torch.save(_trainer_rng(saved["rng"]), directory / rng_name)
        trainer_state = json.loads(saved["trainer_state"])
        (directory / TRAINER_STATE).write_text(json.dumps(trainer_state))
        return os.fspath(directory)

    def cleanup(self) -> None:
        if self.materialized is not None:
            shutil.rmtree(self.materialized, ignore_errors=True)
            self.materialized = None
