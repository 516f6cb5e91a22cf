"""The agent's watch on its job's leadership: nobody leading is said, not kept quiet.

Workers train on without a master, on the shard leases they hold (docs/operations.md:
what survives what), but while no master leads nothing can be decided: no failure
is handled, no round forms, no checkpoint is committed. Every `every_s` the watch
reads who holds the job's leader lease; once nobody has held it for `after_s` (60 s
by default) it logs one line naming the job and how long, then one every
`repeat_s`, and one when a master leads again. The node's
`rove_job_leaderless_seconds` gauge says the same to Prometheus. A lease that cannot
be read at all (NATS away, or JetStream without a quorum) is said the same way, as the
bus not answering: the job waits for it and does not fail.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.errors
import structlog

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.errors import RoveError, plain
from rove.control.master.election import current_holder
from rove.control.process import metrics

log = structlog.get_logger("rove.agent")

#: Seconds without a leading master before an agent says so.
LEADERLESS_AFTER_S = 60.0


class LeaderWatch:
    def __init__(
        self,
        bus: Bus,
        job: str,
        *,
        after_s: float = LEADERLESS_AFTER_S,
        every_s: float = 5.0,
        repeat_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.job = job
        self.after_s = after_s
        self.every_s = every_s
        self.repeat_s = repeat_s
        self.clock = clock
        self.log = log.bind(job=job)
        self._since: float | None = None  # when the lease was first seen free
        self._said = 0.0
        self._silent_since: float | None = None  # when the lease was first unreadable
        self._silent_said = 0.0

    async def run(self) -> None:
        kv = None
        while True:
            try:
                if kv is None:
                    kv, _ttl = await self.bus.lease_bucket()
                holder = await current_holder(kv, subjects.lease_key(self.job))
            except (RoveError, nats.errors.Error, OSError, TimeoutError) as exc:
                # the bus is away, or JetStream has no quorum: look again next time
                self.log.debug("could not read the leader lease", error=plain(exc))
                self.unanswered(plain(exc))
            else:
                self.answered()
                self.saw(None if holder is None else holder.master)
            await asyncio.sleep(self.every_s)

    def unanswered(self, error: str) -> None:
        """The lease could not be read: the bus is away or JetStream has no quorum. Said
        once it has lasted `after_s`, and again every `repeat_s`; the job waits for the
        bus (it does not fail), and `answered` says when it is back."""
        now = self.clock()
        if self._silent_since is None:
            self._silent_since = now
        silent = now - self._silent_since
        if silent >= self.after_s and (
            not self._silent_said or now - self._silent_said >= self.repeat_s
        ):
            self._silent_said = now
            self.log.warning(
                f"the bus has not answered job {self.job} for {silent:.0f}s ({error}): NATS "
                "is away or JetStream has lost its quorum, so nothing can be decided or "
                "stored; the workers train on their leased shards, and the job goes on "
                "when it answers"
            )

    def answered(self) -> None:
        if self._silent_since is not None and self._silent_said:
            self.log.info(
                f"the bus answers job {self.job} again, after "
                f"{self.clock() - self._silent_since:.0f}s"
            )
        self._silent_since, self._silent_said = None, 0.0

    def saw(self, leader: str | None) -> None:
        """What the lease says now: `leader` holds it, or nobody (None)."""
        now = self.clock()
        if leader is not None:
            if self._since is not None and self._said:
                self.log.info(
                    f"master {leader} leads job {self.job} again, after "
                    f"{now - self._since:.0f}s without one"
                )
            self._since, self._said = None, 0.0
            metrics.LEADERLESS.labels(self.job).set(0)
            return
        if self._since is None:
            self._since = now
        without = now - self._since
        metrics.LEADERLESS.labels(self.job).set(without)
        if without >= self.after_s and (not self._said or now - self._said >= self.repeat_s):
            self._said = now
            self.log.warning(
                f"no master has led job {self.job} for {without:.0f}s: the workers train on "
                "their leased shards, but no failure is handled and nothing is committed; "
                f"start one (rove master --job {self.job})"
            )
