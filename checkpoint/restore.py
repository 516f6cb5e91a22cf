"""Which step the ranks of a world restore, agreed by all of them.

Under `rove run` the agent says which step to restore (`ROVE_RESTORE_STEP`,
`ROVE_RESTORE_SOURCE`), chosen by the master from the checkpoint events of the
whole world. Elsewhere the ranks agree among themselves when a process group
is up: the newest step every rank holds in memory, else the committed step on
storage.

When the chosen step cannot be read on some rank (a corrupted or truncated
file, a lost node's memory), every rank moves to the next older step on
storage *together* (`agree`), so no two ranks ever resume from different
steps. Without a process group there is no one to agree with, and each rank
falls back on its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rove.checkpoint.engine import FlashEngine
from rove.checkpoint.storage import Storage
from rove.checkpoint.stores import open_storage


def _group_size(group: Any) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return int(dist.get_world_size(group))


def _gather(value: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * _group_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(ok: bool, group: Any = None) -> bool:
    """True when `ok` holds on every rank of the group (collective)."""
    if _group_size(group) == 1:
        return ok
    return all(_gather(ok, group))


def _from_coordinator(value: Any, group: Any) -> Any:
    if _group_size(group) == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return box[0]


def restore_target(
    engine: FlashEngine, storage: Storage | None, group: Any = None
) -> tuple[int, str] | None:
    """(step, "memory" | "storage") to restore, or None for a fresh start (collective)."""
    if "ROVE_RESTORE_STEP" in os.environ:
        text = os.environ["ROVE_RESTORE_STEP"]
        if not text:
            return None  # the agent says: a fresh start
        return int(text), os.environ.get("ROVE_RESTORE_SOURCE", "storage")
    in_memory = {s.step for s in engine.slots()}
    if _group_size(group) > 1:
        in_memory = set.intersection(*(set(s) for s in _gather(sorted(in_memory), group)))
    if in_memory:
        return max(in_memory), "memory"
    committed = storage.committed() if storage is not None else None
    committed = _from_coordinator(committed, group)
    return (committed, "storage") if committed is not None else None


def storage_fallbacks(storage: Storage | None, step: int, group: Any = None) -> list[int]:
    """Steps older than `step` on storage, newest first, the same on every rank."""
    older = [s for s in storage.steps() if s < step] if storage is not None else []
    return list(_from_coordinator(sorted(older, reverse=True), group))


def candidates(
    engine: FlashEngine, storage: Storage | None, group: Any = None
) -> list[tuple[int, str]]:
    """(step, source) to try in order: the target, then older steps on storage.

    Empty for a fresh start. Collective: every rank gets the same list.
    """
    target = restore_target(engine, storage, group)
    if target is None:
        return []
    step, _ = target
    return [target, *((s, "storage") for s in storage_fallbacks(storage, step, group))]


def job_and_storage(
    job: str | None, checkpoint_dir: str | Path | None
) -> tuple[str, Storage | None]:
    """The job (argument, else `ROVE_JOB`, else torchrun's run id, else "local") and
    the storage (argument, else `ROVE_CKPT_DIR`, else none) of a checkpointer: a
    directory, or an object store's URL (`s3://bucket/prefix`, ...)."""
    env = os.environ
    job = job or env.get("ROVE_JOB") or env.get("TORCHELASTIC_RUN_ID") or "local"
    location = checkpoint_dir or env.get("ROVE_CKPT_DIR")
    return job, open_storage(location) if location else None


def begin_lineage(engine: FlashEngine, storage: Storage | None, step: int) -> None:
    """Training goes on from `step`: drop this rank's newer slots and the newer steps on
    storage, which belong to an abandoned lineage (the new one reuses their numbers).

    Under `rove run` the agent has already done so for the step its round restores;
    this covers a rank that had to fall back to an older step, and jobs run without
    an agent.
    """
    engine.discard_newer(step)
    if storage is not None:
        storage.discard_newer(step)
