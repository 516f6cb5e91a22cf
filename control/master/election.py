"""The leader lease of one job, held in the JetStream KV lease bucket.

Candidates `create` the job's key; the winner's revision is its epoch. The
holder renews with compare-and-set at a third of the bucket TTL; a failed
renewal means the lease is gone (expired while the holder was paused, or
taken) and the holder must stop writing at once. Fencing of the writes
themselves is done by the server (see `rove.control.bus.client.Fence`), so a holder
that has not yet noticed is still stopped.
"""

from __future__ import annotations

import asyncio
import re
from typing import NamedTuple

import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from rove.control.bus import retry
from rove.control.catalogue import subjects
from rove.control.errors import plain

log = structlog.get_logger("rove.election")

_TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.ConnectionReconnectingError,
)


#: How often a renewal a clustered stream answered "busy" is sent again, and the
#: first pause between tries (doubled each time): a proposal takes milliseconds.
BUSY_TRIES = 5
BUSY_PAUSE_S = 0.02

_STORED_SEQ = re.compile(r"wrong last sequence: \d+")


def busy(exc: Exception) -> bool:
    """Whether a refused write to the lease key means "not now" rather than "not yours".

    On a clustered (R3) bucket a compare-and-set that arrives while another write to the
    key is being proposed (a standby's `create`, say) is refused with 10164, "wrong
    last sequence" and no sequence number; nats-py turns both that and a real mismatch
    (10071, "wrong last sequence: N") into `KeyWrongLastSequenceError`, keeping only the
    description, which tells them apart."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return not _STORED_SEQ.search(exc.description or "")
    return isinstance(exc, nats.js.errors.APIError) and exc.err_code in retry.BUSY_CODES


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
        except (*_TRANSIENT, nats.js.errors.APIError) as exc:
            # unreachable, or refused as busy on a cluster: not acquired, tried again
            log.debug("lease acquire attempt failed", error=f"{type(exc).__name__}: {exc}")
            return None
        self.revision = self.epoch = int(rev)
        return self.epoch

    async def renew(self) -> bool:
        """Extend the lease. False means it is lost: stop writing now."""
        pause = BUSY_PAUSE_S
        for _ in range(BUSY_TRIES):
            if self.revision is None:
                return False
            try:
                self.revision = int(
                    await self.kv.update(self.key, self.master.encode(), last=self.revision)
                )
                return True
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
                if busy(exc):  # another write to the key is being proposed: again, soon
                    await asyncio.sleep(pause)
                    pause *= 2
                    continue
                if not isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
                    raise
                log.warning("leader lease was lost", master=self.master, epoch=self.epoch)
                self.revision = None
                return False
            except _TRANSIENT as exc:
                # Could not reach the bucket; the lease may still be ours. Its writes
                # stay fenced by the server meanwhile; the next renewal tells.
                log.warning("could not renew the leader lease", error=plain(exc))
                return True
        log.warning(
            "the leader lease's bucket stayed busy; renewing at the next turn",
            master=self.master,
            epoch=self.epoch,
            tries=BUSY_TRIES,
        )
        return True

    async def _still_ours(self) -> int | None:
        """The key's revision now if this master holds it (None: another does, or none)."""
        holder = await current_holder(self.kv, self.key)
        return holder.revision if holder is not None and holder.master == self.master else None

    async def release(self) -> None:
        """Give the lease up now so a standby takes over without waiting for the TTL."""
        if self.revision is None:
            return
        try:
            try:
                await self.kv.delete(self.key, last=self.revision)
            except nats.js.errors.APIError as exc:
                if exc.err_code != 10071 or (revision := await self._still_ours()) is None:
                    raise
                # a renewal cancelled in flight (the master stopping) was applied, its
                # new revision never read: the lease is still ours, under that revision
                await self.kv.delete(self.key, last=revision)
        except nats.errors.Error as exc:
            # Best effort by contract: taken meanwhile (10071), busy on a cluster (10164),
            # or the bus is away. The lease then ends with its TTL.
            log.info(
                "could not release the leader lease; it expires with its TTL",
                master=self.master,
                epoch=self.epoch,
                error=plain(exc),
            )
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
