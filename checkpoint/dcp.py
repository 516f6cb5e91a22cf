"""FSDP and other sharded state through `torch.distributed.checkpoint`, in shared memory.

    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from rove.checkpoint.dcp import DistributedCheckpointer

    ckpt = DistributedCheckpointer()                 # job, rank, storage from the environment
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "extra": {"epoch": 3}}
    step = ckpt.load(state)                          # in place; None on a fresh start
    if step is not None:
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    ...
    ckpt.save(step, {"model": ..., "optim": ...})    # collective: every rank calls it

`FlashStorageWriter` and `FlashStorageReader` implement DCP's storage
interfaces on the flash engine: each rank's save is one copy of *its own*
shards into its shared-memory slot, in the same slot format as
`FlashCheckpointer`, so the agent's saver persists, commits and reports it like
any other checkpoint. The coordinator's slot also carries DCP's global metadata
(which rank holds which chunk). On load, each chunk is read from the slot of
the rank that wrote it: from this machine's shared memory when that rank ran
here, else from the persisted checkpoint (`ROVE_CKPT_DIR`). Because DCP
reshards on load, a checkpoint saved by N ranks loads into any world size when
it is on storage.

The metadata is pickled, as DCP's own file system writer does: only load
checkpoints this job wrote.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from rove.agent import progress
from rove.checkpoint.engine import CheckpointError, FlashEngine, SaveStats, namespace
from rove.checkpoint.restore import begin_lineage, candidates, job_and_storage
from rove.checkpoint.storage import Storage

#: the key of a rank's DCP items in its slot, and of the metadata in the coordinator's
ITEMS = "dcp_items"
METADATA = "dcp_metadata"


def _done(value: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class FlashStorageWriter(StorageWriter):
    """Writes this rank's DCP items into its flash slot as one step."""

    def __init__(self, engine: FlashEngine, step: int, rank: int) -> None:
        super().__init__()
        self.engine = engine
        self.step = step
        self.rank = rank
        self.is_coordinator = False
        self.items: list[Any] = []
        self.stats: SaveStats | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.items = []
        self.stats = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items: list[Any] = []
        results = []
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                value: Any = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                size = len(value)
            else:
                assert isinstance(data, torch.Tensor)
                value = data.detach()
                size = value.numel() * value.element_size()
            results.append(WriteResult(item.index, size, (self.rank, len(items))))
            items.append(value)
        self.items = items
        if not self.is_coordinator:  # the coordinator saves in finish(), with the metadata
            self.stats = self.engine.save(self.step, {ITEMS: items})
        return _done(results)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        self.stats = self.engine.save(
            self.step, {ITEMS: self.items, METADATA: pickle.dumps(metadata)}
        )


class FlashStorageReader(StorageReader):
    """Reads a step written by `FlashStorageWriter`: memory first, then storage."""

    def __init__(
        self,
        job: str,
        step: int,
        storage: Storage | None,
        *,
        memory: bool = True,
        coordinator_rank: int = 0,
    ) -> None:
        super().__init__()
        self.job = job
        self.step = step
        self.storage = storage
        self.memory = memory
        self.coordinator_rank = coordinator_rank
        self.locations: dict[MetadataIndex, Any] = {}
        self._states: dict[int, Any] = {}
        self._engines: list[FlashEngine] = []  # keep the mappings alive while views are used
        self.sources: set[str] = set()

    def _state_of(self, rank: int) -> Any:
        if rank in self._states:
            return self._states[rank]
        tried = []
        if self.memory:
            engine = FlashEngine(namespace(self.job), rank)
            try:
                _, state = engine.load(step=self.step, copy=False)
                self._engines.append(engine)
                self._states[rank] = state
                self.sources.add("memory")
                return state
            except CheckpointError as exc:
                engine.close()
                tried.append(str(exc))
        if self.storage is not None:
            try:
                state = self.storage.load(self.step, rank)
                self._states[rank] = state
                self.sources.add("storage")
                return state
            except CheckpointError as exc:
                tried.append(str(exc))
        else:
            tried.append("no checkpoint directory (ROVE_CKPT_DIR) to read other ranks from")
        raise CheckpointError(
            f"cannot read rank {rank}'s part of step {self.step}: {'; '.join(tried)}"
        )

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.close()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        state = self._state_of(self.coordinator_rank)
        if not isinstance(state, dict) or METADATA not in state:
            raise CheckpointError(
                f"step {self.step} of rank {self.coordinator_rank} was not saved through "
                "torch.distributed.checkpoint (no DCP metadata); load it with FlashCheckpointer"
            )
        metadata = pickle.loads(state[METADATA])
        assert isinstance(metadata, Metadata)
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a: Any) -> None:
        self.locations = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for item in plan.items:
            rank, index = self.locations[item.storage_index]
            value = self._state_of(rank)[ITEMS][index]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(value))
                continue
            source = value
            for dim, (start, length) in enumerate(
                zip(item.storage_offsets, item.lengths, strict=True)
            ):
                source = source.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            if target.size() != source.size():
                raise CheckpointError(
                    f"{item.storage_index.fqn}: the checkpoint holds {tuple(source.size())}, "
                    f"the model expects {tuple(target.size())}"
                )
            target.copy_(source)
            planner.commit_tensor(item, target)
        return _done(None)

    def close(self) -> None:
        self._states.clear()
        for engine in self._engines:
            engine.close()
        self._engines.clear()


class DistributedCheckpointer:
    """Flash checkpoints of sharded state (FSDP, DTensor) through DCP."""

    def __init__(
        self,
        checkpoint_dir: str | Path | None = None,
        *,
        job: str | None = None,
        rank: int | None = None,
    ) -> None:
        self.job, self.storage = job_and_storage(job, checkpoint_dir)
        if rank is None:
            rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        self.rank = rank
        self.engine = FlashEngine(namespace(self.job), rank)
        self.restored_from = ""

    def save(self, step: int, state_dict: dict[str, Any], process_group: Any = None) -> SaveStats:
        """Copy this rank's shards of `state_dict` into shared memory (collective)."""
        began = time.monotonic()
        writer = FlashStorageWriter(self.engine, step, self.rank)
        dcp_save(state_dict, storage_writer=writer, process_group=process_group)
        assert writer.stats is not None
        progress.checkpoint_blocked(time.monotonic() - began)
        return writer.stats

    def load(self, state_dict: dict[str, Any], process_group: Any = None) -> int | None:
        """Load the step to resume from into `state_dict` in place (collective).

        The step is the one the agent chose (`ROVE_RESTORE_STEP`), else the
        newest step in this machine's memory, else the committed step on
        storage. When it cannot be read on some rank, every rank moves together
        to the next older step on storage. Returns the step, or None for a
        fresh start.

        Raises:
            CheckpointError: no step could be loaded (the message says what was tried).
        """
        began = time.monotonic()
        errors = []
        steps = candidates(self.engine, self.storage, process_group)
        for candidate, source in steps:
            memory = source == "memory"
            reader = FlashStorageReader(self.job, candidate, self.storage, memory=memory)
            try:
                dcp_load(state_dict, storage_reader=reader, process_group=process_group)
            except (CheckpointException, CheckpointError) as exc:  # the same on every rank
                errors.append(f"step {candidate}: {exc}")
                continue
            finally:
                reader.close()
            self.restored_from = "memory" if reader.sources == {"memory"} else "storage"
            begin_lineage(self.engine, self.storage, candidate)
            progress.restored(time.monotonic() - began, candidate)
            return candidate
        if not steps:
            return None
        raise CheckpointError("cannot restore any step: " + " | ".join(errors))
