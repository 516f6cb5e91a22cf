"""Dynamic data sharding, client side: leased shards as a torch sampler or
iterable dataset, a tf.data source, and streaming (Kafka) shards.

Shards are requested, leased, acknowledged and requeued as events folded by
the master (`rove.control`).
"""

from typing import Any

__all__ = ["DataError", "LeaseKeeper", "ShardSampler", "ShardedIterable", "ShardedLoader"]


def __getattr__(name: str) -> Any:
    # torch is imported only when a torch data source is used
    if name in ("DataError", "LeaseKeeper"):  # torch-free
        from rove.shard_service import keeper

        return getattr(keeper, name)
    if name == "ShardedIterable":
        from rove.shard_service import iterable

        return iterable.ShardedIterable
    if name in __all__:
        from rove.shard_service import sampler

        return getattr(sampler, name)
    raise AttributeError(name)
