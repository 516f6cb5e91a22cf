"""Leased shards as a torch batch sampler: exactly once in the lineage of the model.

    from rove.shard_service import ShardSampler

    sampler = ShardSampler("train", size=len(ds), batch_size=32, shard_size=256, epochs=2)
    loader = sampler.loader(ds, num_workers=2)        # a torch DataLoader underneath
    if restored:                                     # the flash checkpoint of the model
        sampler.load_state_dict(state["data"])
    for batch in loader:                             # every epoch, in one pass
        if batch is None:                            # others still train: step with zero loss
            ...
        ...
        ckpt.save(step, {"model": ..., "data": sampler.state_dict()})

The sampler asks the master for shards ahead of use: at least `prefetch`, and
enough to train `cover_s` seconds at the rate it has been consuming, so a
master failover (lease TTL, then catch-up) does not stall training. It hands
their indices out in batches, and
acknowledges a shard once every sample of it reached the training loop
(`loader` tells it; a DataLoader prefetches batches it has not delivered).
`state_dict()` is the data position of the lineage: save it with the model.
After a restore, `load_state_dict()` makes the first request carry it, and
the master rolls the dataset back to it: shards done by then stay done,
partly trained shards resume at their offset, everything else is trained
again. Faster ranks ask more often and so get more shards.

Under `rove run` the job, NATS URL, node, rank and round come from the
environment; elsewhere pass `nats=`, `job=`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, Unpack

import msgspec
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.control.process import logs
from rove.shard_service.client import DataClient
from rove.shard_service.keeper import LeaseKeeper
from rove.shard_service.options import Sharding, sharded
from rove.shard_service.position import read_position as read_position
from rove.shard_service.position import saved_position
from rove.shard_service.tracker import Tracker

log = logs.get("rove.data")


class ShardSampler(Sampler[list[int]]):
    def __init__(
        self,
        dataset: str,
        size: int,
        *,
        batch_size: int,
        drop_last: bool = False,
        **options: Unpack[Sharding],
    ) -> None:
        """Batches of `batch_size` indices of the dataset `dataset` of `size` samples;
        `options`: how it is cut, leased and where this process runs
        (`rove.shard_service.options`)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        o = sharded("shard sampler", dataset, size, options)
        self.spec, self.where, self.pace = o.spec, o.where, o.pace
        self.name = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.tracker = Tracker(self.spec)
        self._keeper: LeaseKeeper | None = None
        self._restore: ev.DataPosition | None = None
        self._taken: deque[tuple[list[int], list[tuple[int, int]]]] = deque()
        self._last: tuple[list[int], list[tuple[int, int]]] = ([], [])
        self.shards_done = 0

    # ------------------------------------------------------------------ bus

    @property
    def keeper(self) -> LeaseKeeper:
        """The lease keeper (connects and registers the dataset on first use)."""
        if self._keeper is None:
            client = DataClient.at(self.where, self.name)
            client.register(self.spec)
            self._keeper = LeaseKeeper(client, self.spec, self.pace)
            self._keeper.restore = self._restore
        return self._keeper

    @property
    def client(self) -> DataClient:
        return self.keeper.client

    def connect(self) -> None:
        """Connect and register now, instead of at the first batch."""
        _ = self.keeper

    def ahead(self) -> int:
        """How many untaken shards to hold: `prefetch`, or `cover_s` seconds' worth."""
        return self.keeper.ahead()

    def _poll(self, wait: bool) -> None:
        self.tracker.add(tuple(self.keeper.poll(wait)))

    def _top_up(self) -> None:
        t = self.tracker
        self.keeper.top_up(t.untaken_shards(), t.held, short_samples=self.batch_size - t.untaken())

    # ------------------------------------------------------------------ torch Sampler

    def __iter__(self) -> Iterator[list[int]]:
        keeper = self.keeper
        keeper.exhausted = False
        while True:
            self._poll(wait=False)
            self._top_up()
            enough = self.tracker.untaken() >= self.batch_size
            if not enough and keeper.waiting:
                self._poll(wait=True)
                continue
            batch = self.tracker.take(self.batch_size)
            if not batch:
                return
            if len(batch) < self.batch_size and self.drop_last:
                self.tracker.untrain()
                return
            self._taken.append((batch, self.tracker.inflight[-1]))
            yield batch

    def delivered(self) -> None:
        """The oldest batch handed out reached the training loop."""
        if not self._taken:
            return
        self._last = self._taken.popleft()
        keeper = self.keeper
        keeper.measure(len(self._last[0]))
        for ref in self.tracker.delivered():
            self.shards_done += 1
            keeper.client.done(ref)

    @property
    def last_delivered(self) -> list[tuple[int, int]]:
        """(epoch, index) of every sample of the last batch delivered."""
        indices, composition = self._last
        epochs = [shards.epoch_of(self.spec, key) for key, k in composition for _ in range(k)]
        return list(zip(epochs, indices, strict=True))

    def abandon(self) -> None:
        """Batches handed out but never delivered go back (the loader stopped early)."""
        self._taken.clear()
        self.tracker.untrain()

    def loader(
        self, dataset: Dataset[Any], *, lockstep: bool | None = None, **kwargs: Any
    ) -> ShardedLoader:
        """A DataLoader over `dataset` fed by this sampler, that reports deliveries."""
        return ShardedLoader(self, dataset, lockstep=lockstep, **kwargs)

    # ------------------------------------------------------------------ position

    def state_dict(self) -> dict[str, Any]:
        """The data position of the lineage (collective when a process group is up)."""
        return position_state(self.name, self.spec, self.tracker.position())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a saved position (before iterating)."""
        if self._keeper is not None and self._keeper.requested:
            raise RuntimeError("load_state_dict() must be called before the first batch is drawn")
        position = read_position(state, self.name, self.spec)
        self.tracker.restore(position)
        self._restore = position
        if self._keeper is not None:
            self._keeper.restore = position

    def close(self) -> None:
        if self._keeper is not None:
            self._keeper.client.close()
            self._keeper = None


class ShardedLoader:
    """A DataLoader over a `ShardSampler` that tells the sampler what was delivered.

    With `lockstep` (the default when a process group of several ranks is
    up), the ranks agree each step whether anyone still has data: a rank that
    ran out gets `None` batches (step with a zero loss so collectives stay in
    step) until every rank is done, so no rank leaves leased data untrained.
    """

    def __init__(
        self, sampler: ShardSampler, dataset: Dataset[Any], *, lockstep: bool | None, **kwargs: Any
    ) -> None:
        self.sampler = sampler
        self.loader = DataLoader(dataset, batch_sampler=sampler, **kwargs)
        self.lockstep = _distributed() if lockstep is None else lockstep

    def __iter__(self) -> Iterator[Any]:
        def delivered(batch: Any) -> Any:
            self.sampler.delivered()
            return batch

        try:
            yield from deliveries(iter(self.loader), delivered, lockstep=self.lockstep)
        finally:
            self.sampler.abandon()


def deliveries(
    items: Iterator[Any], deliver: Callable[[Any], Any], *, lockstep: bool
) -> Iterator[Any]:
    """`deliver(item)` for each item of a loader, until every rank is out of data.

    With `lockstep`, a rank that ran out yields None while any other still has
    data (one all-reduce a step); without, iteration ends with the loader.
    """
    while True:
        item = next(items, None)
        batch = None if item is None else deliver(item)
        if lockstep:
            if not _anyone(item is not None):
                return
        elif item is None:
            return
        yield batch


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def position_state(name: str, spec: ev.DatasetSpec, position: ev.DataPosition) -> dict[str, Any]:
    """A data position as saved in a checkpoint, merged over the ranks (collective)."""
    if _distributed():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, msgspec.msgpack.encode(position))
        decode = msgspec.msgpack.Decoder(ev.DataPosition).decode
        position = shards.merge(decode(g) for g in gathered)
    return saved_position(name, spec, position)


def _anyone(mine: bool) -> bool:
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if mine else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
