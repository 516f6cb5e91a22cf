"""The leader lease of one job, held in the JetStream KV lease bucket.

Candidates `create` the job's key; the winner's revision is its epoch. The
holder renews with compare-and-set at a third of the bucket TTL; a failed
renewal means the lease is gone (expired while the holder was paused, or
taken) and the holder must stop writing at once. Fencing of the writes
themselves is done by the server (see `rove.control.bus.Fence`), so a holder
that has not yet noticed is still stopped.
"""

from __future__ import annotations

from typing import NamedTuple

import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from rove.control import subjects

log = structlog.get_logger("rove.election")

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
)


class Holder(NamedTuple):
    master: str
    revision: int


class Lease:
    """One candidate's view of the job's leader key."""

    def __init__(self, kv: KeyValue, job: str, master: str, ttl_s: float) -> None:
        self.kv = kv
        self.key = subjects.lease_key(job)
        self.master = master
        self.ttl_s = ttl_s
        self.revision: int | None = None
        self.epoch: int | None = None

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    async def try_acquire(self) -> int | None:
        """Take the lease if nobody holds it. Returns the epoch, or None.

        Transient bus errors count as "not acquired"; the caller tries again.
        """
        try:
            rev = await self.kv.create(self.key, self.master.encode())
        except (
            nats.js.errors.KeyWrongLastSequenceError,
            # nats-py re-reads the key after a failed create to look for a delete
            # marker; if the holder's key expired in between, that read fails too.
            nats.js.errors.KeyNotFoundError,
            nats.js.errors.KeyDeletedError,
        ):
            return None
        except _TRANSIENT as exc:
            log.debug("lease acquire attempt failed", error=type(exc).__name__)
            return None
        self.revision = self.epoch = int(rev)
        return self.epoch

    async def renew(self) -> bool:
        """Extend the lease. False means it is lost: stop writing now."""
        if self.revision is None:
            return False
        try:
            self.revision = int(
                await self.kv.update(self.key, self.master.encode(), last=self.revision)
            )
            return True
        except nats.js.errors.KeyWrongLastSequenceError:
            log.warning("leader lease was lost", master=self.master, epoch=self.epoch)
            self.revision = None
            return False
        except _TRANSIENT as exc:
            # Could not reach the bucket; the lease may still be ours. The caller
            # keeps trying until the TTL runs out, then treats it as lost.
            log.warning("could not renew the leader lease", error=type(exc).__name__)
            return True

    async def release(self) -> None:
        """Give the lease up now so a standby takes over without waiting for the TTL."""
        if self.revision is None:
            return
        try:
            await self.kv.delete(self.key, last=self.revision)
        except (nats.js.errors.KeyWrongLastSequenceError, *_TRANSIENT):
            pass
        self.revision = None

    async def holder(self) -> Holder | None:
        return await current_holder(self.kv, self.key)


async def current_holder(kv: KeyValue, key: str) -> Holder | None:
    try:
        entry = await kv.get(key)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    if entry.value is None:
        return None
    return Holder(entry.value.decode(errors="replace"), int(entry.revision or 0))
