"""The leader-lease bucket (the JetStream key-value bucket `rove_leases`): found, or
made by whichever component comes first, and the TTL it really has.

`open` is one try; `Bus.lease_bucket` retries it. On a cluster just formed, a bucket
just made or found may be "stream not found" for a moment by the server asked next:
that is a `TemporaryError`, tried again (a `rove master` started beside a job's first
nodes died of it, on a fresh 3-node cluster, while the nodes made the streams).
"""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from rove.control.bus.options import BusOptions
from rove.control.catalogue import subjects
from rove.control.errors import TemporaryError


async def open(
    js: JetStreamContext, options: BusOptions, kv: KeyValue | None = None
) -> tuple[KeyValue, float]:
    """The bucket (`kv` if already found) and its TTL in seconds."""
    if kv is None:
        kv = await _find_or_make(js, options)
    try:
        status = await kv.status()
    except nats.js.errors.NotFoundError as exc:
        raise TemporaryError(f"the lease bucket's stream: {exc.description}") from exc
    return kv, float(status.ttl or options.lease_ttl_s)


async def _find_or_make(js: JetStreamContext, options: BusOptions) -> KeyValue:
    try:
        return await js.key_value(subjects.LEASE_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(
            KeyValueConfig(
                bucket=subjects.LEASE_BUCKET,
                history=1,
                ttl=options.lease_ttl_s,
                replicas=options.replicas,
                storage=StorageType.FILE,
            )
        )
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # 10058: made at the same moment by another component
            raise
        return await js.key_value(subjects.LEASE_BUCKET)
