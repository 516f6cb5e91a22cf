"""Dynamic data sharding, client side: leased shards as a torch sampler or
iterable dataset, a tf.data source, and streaming (Kafka) shards.

Shards are requested, leased, acknowledged and requeued as events folded by
the master (`rove.control`).
"""
