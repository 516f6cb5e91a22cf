"""`FlashCheckpointer`: flash checkpoints for plain and DDP training.

    from rove.checkpoint.api import FlashCheckpointer

    ckpt = FlashCheckpointer()                       # rank and job from the environment
    restored = ckpt.load()                           # None on a fresh start
    if restored:
        step, state = restored
        model.load_state_dict(state["model"]); opt.load_state_dict(state["optim"])
    for step in ...:
        ...
        ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})

Every rank saves its own state (for DDP that is the replicated full state; a
rank-0-only save works too, with the other ranks loading rank 0's copy via
`source_rank=0`). Under `rove run` the agent tells each worker which step to
restore (`ROVE_RESTORE_STEP`, `ROVE_RESTORE_SOURCE`): the newest step every
rank holds in memory, else the committed step on storage (`ROVE_CKPT_DIR`),
so every rank loads the same step. Elsewhere, `load()` takes the newest step
in this machine's memory, else the committed step of `checkpoint_dir`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rove.checkpoint.engine import CheckpointError, FlashEngine, SaveStats
from rove.checkpoint.storage import FileStorage


class FlashCheckpointer:
    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
        source_rank: int | None = None,
    ) -> None:
        env = os.environ
        self.job = job or env.get("ROVE_JOB") or env.get("TORCHELASTIC_RUN_ID") or "local"
        self.rank = int(env.get("RANK", "0")) if rank is None else rank
        self.engine = FlashEngine(self.job, self.rank)
        directory = checkpoint_dir or env.get("ROVE_CKPT_DIR")
        self.storage = FileStorage(Path(directory)) if directory else None
        self.source_rank = source_rank
        self.restored_from = ""

    def save(self, step: int, state: Any) -> SaveStats:
        """Copy `state` into shared memory (blocks only for the copy)."""
        return self.engine.save(step, state)

    def load(self) -> tuple[int, Any] | None:
        """(step, state) to resume from, or None for a fresh start.

        Raises:
            CheckpointError: the step the agent asked for is neither in memory
                nor on storage (the message says what was tried).
        """
        step_text = os.environ.get("ROVE_RESTORE_STEP", "")
        source = os.environ.get("ROVE_RESTORE_SOURCE", "")
        if step_text:
            return self._load_step(int(step_text), source)
        if "ROVE_RESTORE_STEP" in os.environ:
            return None  # the agent says: a fresh start
        engine = self._reader()
        if engine.newest() is not None:
            self.restored_from = "memory"
            return engine.load()
        if self.storage is not None and (committed := self.storage.committed()) is not None:
            self.restored_from = "storage"
            return committed, self.storage.load(committed, self._read_rank())
        return None

    def _read_rank(self) -> int:
        return self.rank if self.source_rank is None else self.source_rank

    def _reader(self) -> FlashEngine:
        if self.source_rank is None or self.source_rank == self.rank:
            return self.engine
        return FlashEngine(self.job, self.source_rank)

    def _load_step(self, step: int, source: str) -> tuple[int, Any]:
        tried = []
        if source == "memory":
            try:
                loaded = self._reader().load(step=step)
                self.restored_from = "memory"
                return loaded
            except CheckpointError as exc:
                tried.append(str(exc))
        if self.storage is not None:
            try:
                state = self.storage.load(step, self._read_rank())
                self.restored_from = "storage"
                return step, state
            except CheckpointError as exc:
                tried.append(str(exc))
        else:
            tried.append("no checkpoint directory (ROVE_CKPT_DIR) to fall back on")
        raise CheckpointError(f"cannot restore step {step}: {'; '.join(tried)}")
