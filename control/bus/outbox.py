"""Facts published in order, kept while the bus is unreachable: never dropped.

An agent and a data client each send their facts through one `Outbox`. A fact
that cannot be published within its deadline is retried by rove's retry policy
(`rove.control.bus.retry`: backoff with jitter, up to `wait_max_s` between tries),
for as long as it takes. The same event with the same id is re-sent, so a
publish that did land is stored once. Heartbeats do not go through here: only
the newest matters, so a heartbeat that cannot be sent is simply skipped.
"""

from __future__ import annotations

import asyncio
import functools

from rove.control.bus import retry
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import TemporaryError
from rove.control.process import aio, logs

log = logs.get("rove.outbox")


class Outbox:
    """Publishes `put` events in order from its own task, until `stop()`."""

    def __init__(
        self, bus: Bus, *, deadline_s: float = 10.0, wait_max_s: float = 10.0, what: str = "facts"
    ) -> None:
        self.bus = bus
        self.deadline_s = deadline_s
        self.wait_max_s = wait_max_s
        self.what = what
        self._queue: asyncio.Queue[ev.Event] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: why the outbox stopped sending (None while it works): its owner acts on it
        self.failure: BaseException | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox")

    def put(self, event: ev.Event) -> None:
        self._idle.clear()
        self._queue.put_nowait(event)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The task that publishes (for its owner to supervise)."""
        return self._task

    @property
    def pending(self) -> int:
        return self._queue.qsize() + (0 if self._idle.is_set() else 1)

    async def _run(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await retry.call(
                    functools.partial(self._publish, event),
                    what=f"{ev.kind(event)} {event.id}",
                    deadline_s=None,
                    wait_initial=0.5,
                    wait_max=self.wait_max_s,
                )
            except Exception as exc:
                # not worth retrying (a role that may not write it, a payload too large):
                # said with the fact it failed on; the owner learns it from `failure`
                log.error(
                    f"cannot publish {self.what}; nothing more is sent",
                    kind=ev.kind(event),
                    id=event.id,
                    exc_info=exc,
                )
                self.failure = exc
                raise
            if self._queue.empty():
                self._idle.set()

    async def _publish(self, event: ev.Event, _attempt_s: float) -> None:
        try:
            await self.bus.publish(event, deadline_s=self.deadline_s)
        except TemporaryError as exc:
            log.warning(
                f"bus unavailable; {self.what} are buffered and will be sent later",
                buffered=self._queue.qsize() + 1,
                error=str(exc),
            )
            raise

    async def flush(self, timeout_s: float | None) -> bool:
        """Wait until every fact is published; False if `timeout_s` ran out first, or
        at once if the outbox failed (what is left cannot be sent)."""
        if self.failure is not None:
            return self._idle.is_set()
        idle = asyncio.ensure_future(self._idle.wait())
        waits = [idle] if self._task is None else [idle, self._task]
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
        return self._idle.is_set()

    async def stop(self) -> None:
        if self._task is not None:
            await aio.cancel_and_wait([self._task])
