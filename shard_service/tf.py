"""Leased shards for a TensorFlow parameter-server coordinator (no torch).

With `ParameterServerStrategy`, the coordinator schedules closures that run on
the workers; a dataset the workers build from a Python generator cannot run
there. So the coordinator leases shards and hands each closure a shard's
sample indices, from which the closure builds its `tf.data` pipeline:

    from rove.shard_service.tf import ShardFeed

    feed = ShardFeed("train", size=100_000, shard_size=512, epochs=2)
    restored = ckpt.restore()                # rove.checkpoint.tf.TfCheckpointer
    if restored is not None:
        feed.load_state_dict(restored.extra["data"])
    while (shard := feed.next()) is not None:
        result = coordinator.schedule(train_shard, args=(tf.constant(shard.indices),))
        ...                                  # once result.fetch() succeeded:
        feed.trained(shard)
        ...                                  # now and then, after coordinator.join():
        ckpt.save(step, extra={"data": feed.state_dict()})
        feed.committed()

Closures are *at least once*: TensorFlow runs a closure again on another
worker when its worker dies. So a shard is acknowledged to the master only
when a committed checkpoint covers it (`committed()`), never when its closure
returns: after a failure the round restores that checkpoint, the master
leases again every shard trained after it, and the lineage of the final
model has trained each shard exactly once. The leases of shards trained but
not yet committed are renewed meanwhile.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Unpack

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.shard_service.client import DataClient
from rove.shard_service.keeper import LeaseKeeper
from rove.shard_service.options import Sharding, sharded
from rove.shard_service.position import read_position, saved_position


class Shard(NamedTuple):
    """A leased shard: its key, its epoch and the sample indices left to train in it."""

    key: int
    epoch: int
    indices: list[int]


class ShardFeed:
    def __init__(
        self,
        name: str,
        *,
        size: int,
        **options: Unpack[Sharding],
    ) -> None:
        """The dataset `name` of `size` indexed samples, leased in shards; `options`:
        how it is cut, leased and where this process runs (`rove.shard_service.options`)."""
        self.name = name
        o = sharded("shard feed", name, size, options)
        self.spec, self.where, self.pace = o.spec, o.where, o.pace
        self._client: DataClient | None = None
        self._keeper: LeaseKeeper | None = None
        self._restore: ev.DataPosition | None = None
        self._held: list[ev.ShardRef] = []
        #: done in the lineage of the restored or last committed checkpoint
        self._base: shards.Ranges = ()
        #: trained since (their closures returned), not yet covered by a commit
        self._trained: set[int] = set()
        #: what the last `state_dict()` saw trained (`committed()` acknowledges it)
        self._saved: set[int] = set()

    def _keep(self) -> LeaseKeeper:
        if self._keeper is None:
            self._client = DataClient.at(self.where, self.name)
            self._client.register(self.spec)
            self._keeper = LeaseKeeper(self._client, self.spec, self.pace)
            self._keeper.restore = self._restore
        return self._keeper

    def next(self) -> Shard | None:
        """The next leased shard (waiting for a lease), or None once every shard of every
        epoch is leased and nothing comes back.

        Raises:
            DataError: the master refused a request (its reason says why).
        """
        keeper = self._keep()
        while True:
            keeper.top_up(len(self._held), [*(r.key for r in self._held), *self._trained])
            if self._held:
                ref = self._held.pop(0)
                indices = shards.indices(self.spec, ref)
                keeper.measure(len(indices))
                return Shard(ref.key, shards.epoch_of(self.spec, ref.key), indices)
            if not keeper.waiting:
                return None
            self._held.extend(keeper.poll(wait=True))

    def trained(self, shard: Shard | int) -> None:
        """The closure of `shard` returned: it is part of the next checkpoint's position."""
        self._trained.add(shard if isinstance(shard, int) else shard.key)

    def position(self) -> ev.DataPosition:
        return ev.DataPosition(done=shards.union(self._base, shards.to_ranges(self._trained)))

    def state_dict(self) -> dict[str, Any]:
        """The data position for the checkpoint being saved: every shard trained so far."""
        self._saved = set(self._trained)
        return saved_position(self.name, self.spec, self.position())

    def committed(self) -> int:
        """The checkpoint saved with the last `state_dict()` is committed: acknowledge the
        shards it covers to the master. Returns how many were acknowledged."""
        if self._client is None:
            return 0
        for key in sorted(self._saved):
            self._client.done(ev.ShardRef(key, 0))
        self._base = shards.union(self._base, shards.to_ranges(self._saved))
        self._trained -= self._saved
        acked, self._saved = len(self._saved), set()
        return acked

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a checkpoint's position (before the first `next()`)."""
        if self._keeper is not None:
            raise RuntimeError("load_state_dict() must be called before the first next()")
        position = read_position(state, self.name, self.spec)
        self._restore = position
        self._base = shards.union(position.done)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
