"""The base of every long-running part that follows one job on the bus.

A `JobService` keeps a live folded copy of its job (`Replica`: the newest
snapshot, the tail of the event stream, every node's newest heartbeat), hands
each folded event to `on_event`, and runs `serve()` until `stop()`. Facts it
reports go out through an `Outbox` (`emit`: in order, kept while the bus is
down). Between its steps it sleeps with `doze`, which a folded event that
someone waits on can cut short (`wake`).

The master (`rove.control.master.runner.MasterRunner`) is one: it follows the
job and leads through a lease. The scaler and the Kafka bridge follow a job
the same way: they act on decisions and publish their facts.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Callable

import structlog

from rove.control.bus import records, retry
from rove.control.bus.client import Bus
from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import RoveError
from rove.control.master import snapshots
from rove.control.master.replica import Replica
from rove.control.master.state import JobState
from rove.control.process import aio

log = structlog.get_logger("rove.service")


class JobService(abc.ABC):
    """Follows `job` on `bus` until `stop()`; subclasses implement `serve()`."""

    #: Whether the replica follows heartbeats from the start (a master reads them only
    #: while it leads).
    follows_heartbeats = True

    def __init__(
        self,
        bus: Bus,
        job: str,
        *,
        name: str,
        clock: Callable[[], float] = time.time,
        tick_s: float = 0.25,
    ) -> None:
        self.bus = bus
        self.job = subjects.check_name("job", job)
        self.name = name
        self.clock = clock
        self.tick_s = tick_s
        self.replica = Replica(
            bus,
            job,
            heartbeats=self.follows_heartbeats,
            clock=clock,
            on_applied=self.on_event,
            on_rejected=self.on_rejected,
            on_snapshot=self.on_snapshot,
        )
        self._outbox: Outbox | None = None
        self._stopping = asyncio.Event()
        self._wake = asyncio.Event()

    @property
    def state(self) -> JobState:
        """The job as folded so far."""
        return self.replica.state

    @property
    def liveness(self) -> dict[str, ev.Heartbeat]:
        """The newest heartbeat of every node."""
        return self.replica.liveness

    # ------------------------------------------------------------------ to override

    @abc.abstractmethod
    async def serve(self) -> None:
        """The service's work, once the replica has caught up; return when stopping."""

    def on_event(self, rec: records.Recorded) -> None:  # noqa: B027 - an optional hook
        """Called for each event folded into the replica, in stream order."""

    def on_rejected(self, rej: records.Rejection) -> None:  # noqa: B027 - an optional hook
        """Called for each stored message that is not a valid event."""

    def on_snapshot(self, loaded: snapshots.Loaded) -> None:  # noqa: B027 - an optional hook
        """Called with the snapshot the replica starts from, before the events after it."""

    # ------------------------------------------------------------------ running

    async def run(self) -> None:
        """Catch up with the job (waiting for the bus as long as it takes: a daemon
        started while JetStream has no quorum goes on once it has, or ends there if
        `stop()` comes first), then `serve()`; stops following on the way out."""
        try:
            await aio.unless(
                self._stopping,
                retry.wait_out(self._follow, what=f"{self.name} following job {self.job}"),
            )
        except aio.Stopped:
            return
        try:
            await self.serve()
        finally:
            if self._outbox is not None:
                if not await self._outbox.flush(10.0):
                    log.warning("could not send every fact before stopping", service=self.name)
                await self._outbox.stop()
            await self.replica.stop()

    async def _follow(self) -> None:
        try:
            await self.replica.start()
        except BaseException:
            await self.replica.stop()  # a half-started replica, to start again afresh
            raise

    def stop(self) -> None:
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def emit(self, event: ev.Event) -> None:
        """Publish a fact through this service's outbox (started on first use).

        Raises:
            RoveError: the outbox failed on a fact it may never send (said in the log
                with that fact): the service ends with the reason instead of living on
                with its facts unsent.
        """
        if self._outbox is not None and self._outbox.failure is not None:
            raise RoveError(
                f"{self.name} cannot publish its facts: {self._outbox.failure!r}"
            ) from self._outbox.failure
        if self._outbox is None:
            self._outbox = Outbox(self.bus, what=f"facts of {self.name}")
            self._outbox.start()
        self._outbox.put(event)

    def wake(self) -> None:
        """Cut the current `doze` short: something worth acting on at once was folded."""
        self._wake.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds`, or less if the service is stopped."""
        try:
            await asyncio.wait_for(self._stopping.wait(), seconds)
        except TimeoutError:
            pass

    async def doze(self, seconds: float | None = None) -> None:
        """Sleep until the next tick, a `wake()`, or `stop()`."""
        wake = asyncio.ensure_future(self._wake.wait())
        stop = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait(
                (wake, stop),
                timeout=self.tick_s if seconds is None else seconds,
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            wake.cancel()
            stop.cancel()
        self._wake.clear()
