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
so every rank loads the same step. Elsewhere the ranks agree on the newest
step all of them hold in memory, else the committed step of `checkpoint_dir`.
When the chosen step cannot be read on some rank, every rank moves to the next
older step on storage together (see `rove.checkpoint.restore`).

The state is taken to be replicated (plain or DDP training): a rank with no
copy of its own of the step (the world grew since it was saved) loads the
lowest saved rank's copy. For FSDP and other sharded state, use
`rove.checkpoint.dcp`, which reshards.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rove.agent import progress
from rove.checkpoint.engine import CheckpointError, FlashEngine, SaveStats, namespace
from rove.checkpoint.restore import agree, begin_lineage, candidates, job_and_storage
from rove.control.process import logs

log = logs.get("rove.checkpoint")

#: Called with the step after every save in this process (weakly held).
_SAVED: list[weakref.WeakMethod[Callable[[int], None]]] = []


def on_save(listener: Callable[[int], None]) -> None:
    """Call the bound method `listener(step)` after each `FlashCheckpointer.save` here.

    A data source whose position rides in the checkpoint learns which step it went
    into (a Kafka stream reports its offset vector with the step, see
    `rove.shard_service.stream`). Held weakly: it goes with its object."""
    _SAVED[:] = [ref for ref in _SAVED if ref() is not None]
    _SAVED.append(weakref.WeakMethod(listener))


class FlashCheckpointer:
    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
        source_rank: int | None = None,
    ) -> None:
        self.job, self.storage = job_and_storage(job, checkpoint_dir)
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.engine = FlashEngine(namespace(self.job), self.rank)
        self.source_rank = source_rank
        self.restored_from = ""

    def save(self, step: int, state: Any) -> SaveStats:
        """Copy `state` into shared memory (blocks only for the copy)."""
        stats = self.engine.save(step, state)
        progress.checkpoint_blocked(stats.blocking_s)
        for ref in list(_SAVED):
            listener = ref()
            if listener is not None:
                listener(step)
        return stats

    def load(self, process_group: Any = None) -> tuple[int, Any] | None:
        """(step, state) to resume from, or None for a fresh start.

        Call it after `init_process_group` when there is one: the ranks then
        agree on the step, and if it cannot be read on some rank (corrupted,
        truncated, missing), they all move to the next older step on storage.

        Raises:
            CheckpointError: no step could be loaded (the message says what was tried).
        """
        began = time.monotonic()
        steps = candidates(self._reader(), self.storage, process_group)
        if not steps:
            return None
        step = steps[0][0]
        tried: list[str] = []
        for candidate, where in steps:
            loaded = self._try_step(candidate, where, tried)
            if agree(loaded is not None, process_group):
                assert loaded is not None
                if candidate != step:
                    log.warning(
                        "restored an older step", wanted=step, step=candidate, problems=tried
                    )
                begin_lineage(self.engine, self.storage, candidate)
                progress.restored(time.monotonic() - began, candidate)
                return candidate, loaded
            if loaded is not None:
                tried.append(f"step {candidate}: another rank could not read it")
        raise CheckpointError(f"cannot restore step {step} or any older one: {'; '.join(tried)}")

    def _read_rank(self) -> int:
        return self.rank if self.source_rank is None else self.source_rank

    def _reader(self) -> FlashEngine:
        if self.source_rank is None or self.source_rank == self.rank:
            return self.engine
        return FlashEngine(namespace(self.job), self.source_rank)

    def _try_step(self, step: int, source: str, tried: list[str]) -> Any | None:
        """The state of `step` (memory first when `source` says so), or None."""
        if source == "memory":
            try:
                _, state = self._reader().load(step=step)
                self.restored_from = "memory"
                return state
            except CheckpointError as exc:
                tried.append(str(exc))
        if self.storage is None:
            tried.append(f"step {step}: no checkpoint directory (ROVE_CKPT_DIR) to fall back on")
            return None
        rank = self._read_rank()
        persisted = self.storage.persisted_ranks(step)
        if rank not in persisted and persisted:
            # The world grew since this step was saved: this rank has no copy. The
            # state of a FlashCheckpointer is replicated (plain or DDP training), so
            # the lowest rank's copy is this rank's state too.
            log.warning(
                "this rank has no copy of the step; loading another rank's (replicated state)",
                step=step,
                rank=rank,
                copy_of=min(persisted),
            )
            rank = min(persisted)
        try:
            state = self.storage.load(step, rank)
        except CheckpointError as exc:
            tried.append(str(exc))
            return None
        self.restored_from = "storage"
        return state
