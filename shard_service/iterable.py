"""Leased shards as an `IterableDataset`: each DataLoader worker leases its own shards.

    from rove.shard_service.iterable import ShardedIterable

    data = ShardedIterable("train", ds, shard_size=256, epochs=2)   # ds: any map-style dataset
    loader = data.loader(batch_size=32, num_workers=4)              # a torch DataLoader underneath
    if restored:
        data.load_state_dict(state["data"])
    for batch in loader:                                            # all epochs in one pass
        ...
        ckpt.save(step, {"model": ..., "data": data.state_dict()})

Where `ShardSampler` draws indices in the main process, here the reading
happens in the loader's worker processes: each worker is a data client of its
own (`<name>-w<worker>`), leases shards, and yields their samples tagged with
the shard and the position in it. The loader strips the tags in the main
process, where it sees what actually reached the training loop: it
acknowledges a shard (on behalf of the worker that holds it) once every
sample of it was delivered, and keeps the data position for `state_dict()`.
Everything else (rollback to the position, lockstep, leases, requeues)
works as with `ShardSampler` (docs/data.md).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator
from typing import Any, Unpack

from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.control.process import logs
from rove.shard_service.client import DataClient, Placement, client_name
from rove.shard_service.keeper import MAX_AHEAD, LeaseKeeper
from rove.shard_service.options import Pace, Sharding, sharded
from rove.shard_service.sampler import _distributed, deliveries, position_state, read_position

log = logs.get("rove.data")

Tagged = tuple[Any, int, int, int, str]  # sample, shard key, position in it, index, worker


class LeasedIterable(IterableDataset[Any]):
    """What every leased `IterableDataset` shares: its workers' lease keepers, and the
    main process's record of what reached the training loop (the data position),
    acknowledged on behalf of the worker that holds each lease."""

    def __init__(
        self,
        name: str,
        spec: ev.DatasetSpec,
        where: Placement,
        pace: Pace,
    ) -> None:
        self.name = name
        self.spec = spec
        self.where = where
        self.pace = pace
        self.base_client = client_name(where.node, where.rank)
        self.restore: ev.DataPosition | None = None
        self.iterated = False
        # main process: what reached the training loop
        self.done: set[int] = set()  # since the restore, or the last save
        self.base: shards.Ranges = ()  # done in the lineage at the restore, or the last save
        self.partial: dict[int, int] = {}  # key -> next position in the shard
        self._acks: DataClient | None = None
        self.shards_done = 0

    def _keeper(self, c: DataClient) -> LeaseKeeper:
        """A worker's lease keeper, its dataset registered, restoring the loaded position."""
        c.register(self.spec)
        keeper = LeaseKeeper(c, self.spec, self.pace)
        keeper.restore = self.restore
        return keeper

    def _advance(self, key: int, pos: int) -> None:
        """The sample at `pos` of shard `key` reached the training loop."""
        self.partial[key] = max(self.partial.get(key, 0), pos + 1)

    def _finish(self, key: int, owner: str) -> None:
        """Every sample of shard `key` reached the loop: acknowledge it for `owner`."""
        self.partial.pop(key, None)
        self.done.add(key)
        self.shards_done += 1
        # acknowledged on behalf of the worker that holds the lease
        self._ack_client().done(ev.ShardRef(key, 0), owner)

    def _ack_client(self) -> DataClient:
        """The main process's data client (acknowledgements and reports)."""
        if self._acks is None:
            self._acks = DataClient.at(self.where, self.name, f"{self.base_client}-main")
        return self._acks

    def position(self) -> ev.DataPosition:
        partial = {k: o for k, o in self.partial.items() if k not in self.done}
        return ev.DataPosition(
            done=shards.union(self.base, shards.to_ranges(self.done)),
            partial=tuple(ev.ShardRef(k, o) for k, o in sorted(partial.items())),
        )

    def state_dict(self) -> dict[str, Any]:
        """The data position of the lineage (collective when a process group is up).

        What the ranks have done is then the lineage's: it becomes the base, so the
        keys held one by one are only those done since (a stream's done shards, which
        never end, stay a few ranges)."""
        state = position_state(self.name, self.spec, self.position())
        self.base = shards.union(self.base, state["position"]["done"])
        self.done = {k for k in self.done if not shards.contains(self.base, k)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.iterated:
            raise RuntimeError("load_state_dict() must be called before the loader is iterated")
        position = read_position(state, self.name, self.spec)
        self.restore = position
        self.base = shards.union(position.done)
        self.partial = {r.key: r.offset for r in position.partial}
        self.done = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_acks"] = None  # a connection does not travel to the loader's workers
        return state

    def close(self) -> None:
        if self._acks is not None:
            self._acks.close()
            self._acks = None


class ShardedIterable(LeasedIterable):
    def __init__(
        self,
        name: str,
        dataset: Dataset[Any],
        **options: Unpack[Sharding],
    ) -> None:
        """The indexed `dataset`, leased in shards under the name `name`; `options`:
        how it is cut, leased and where this process runs (`rove.shard_service.options`)."""
        self.dataset = dataset
        size = len(dataset)  # type: ignore[arg-type]
        o = sharded("sharded dataset", name, size, options)
        super().__init__(name, o.spec, o.where, o.pace)

    # ------------------------------------------------------------------ worker side

    def __iter__(self) -> Iterator[Tagged]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        client = DataClient.at(self.where, self.name, f"{self.base_client}-w{worker}")
        try:
            yield from self._samples(client)
        finally:
            client.close()

    def _samples(self, c: DataClient) -> Iterator[Tagged]:
        keeper = self._keeper(c)
        held: list[ev.ShardRef] = []
        # shards handed to the loader, maybe not yet acknowledged by the main process:
        # their leases are renewed too (the loader holds a bounded number of batches)
        recent: deque[int] = deque(maxlen=4 * MAX_AHEAD)
        while True:
            keeper.top_up(len(held), [*(r.key for r in held), *recent])
            held.extend(keeper.poll(wait=not held and keeper.waiting))
            if not held:
                if not keeper.waiting:
                    return
                continue
            ref = held.pop(0)
            recent.append(ref.key)
            for pos, index in enumerate(shards.indices(self.spec, ref), start=ref.offset):
                yield self.dataset[index], ref.key, pos, index, c.client
            keeper.measure(shards.shard_len(self.spec, ref.key) - ref.offset)

    # ------------------------------------------------------------------ main process

    def loader(self, *, lockstep: bool | None = None, **kwargs: Any) -> IterableLoader:
        """A DataLoader over this dataset (any `num_workers`) that tracks deliveries."""
        return IterableLoader(self, lockstep=lockstep, **kwargs)

    def _delivered(self, keys: list[int], positions: list[int], owners: list[str]) -> None:
        for key, pos, owner in zip(keys, positions, owners, strict=True):
            self._advance(key, pos)
            if self.partial[key] == shards.shard_len(self.spec, key):
                self._finish(key, owner)


def _collate(items: list[Tagged]) -> tuple[Any, list[int], list[int], list[int], list[str]]:
    batch = default_collate([t[0] for t in items])  # type: ignore[no-untyped-call]
    return (
        batch,
        [t[1] for t in items],
        [t[2] for t in items],
        [t[3] for t in items],
        [t[4] for t in items],
    )


class IterableLoader:
    """Batches of a `ShardedIterable`, with its tags stripped and its deliveries recorded."""

    def __init__(self, data: ShardedIterable, *, lockstep: bool | None, **kwargs: Any) -> None:
        self.data = data
        self.loader = DataLoader(data, collate_fn=_collate, **kwargs)
        self.lockstep = _distributed() if lockstep is None else lockstep
        self.last_delivered: list[tuple[int, int]] = []

    def __iter__(self) -> Iterator[Any]:
        self.data.iterated = True

        def delivered(item: tuple[Any, list[int], list[int], list[int], list[str]]) -> Any:
            batch, keys, positions, indices, owners = item
            self.data._delivered(keys, positions, owners)
            epoch = functools.partial(shards.epoch_of, self.data.spec)
            self.last_delivered = [(epoch(k), i) for k, i in zip(keys, indices, strict=True)]
            return batch

        yield from deliveries(iter(self.loader), delivered, lockstep=self.lockstep)
