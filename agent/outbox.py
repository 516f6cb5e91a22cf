"""An agent's facts, published in order, buffered while the bus is unreachable.

Facts are never dropped while the agent lives: a fact that cannot be published
within its deadline is retried with backoff (same event, same id, so a publish
that did land is not stored twice). Heartbeats do not go through here: only the
newest matters, so a heartbeat that cannot be sent is simply skipped.
"""

from __future__ import annotations

import asyncio

import structlog

from rove.control import aio
from rove.control import events as ev
from rove.control.bus import Bus
from rove.control.errors import PublishDeadlineError

log = structlog.get_logger("rove.outbox")


class Outbox:
    def __init__(self, bus: Bus, *, deadline_s: float = 10.0) -> None:
        self.bus = bus
        self.deadline_s = deadline_s
        self._queue: asyncio.Queue[ev.Event] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox")

    def put(self, event: ev.Event) -> None:
        self._idle.clear()
        self._queue.put_nowait(event)

    @property
    def pending(self) -> int:
        return self._queue.qsize() + (0 if self._idle.is_set() else 1)

    async def _run(self) -> None:
        delay = 0.5
        while True:
            event = await self._queue.get()
            while True:
                try:
                    await self.bus.publish(event, deadline_s=self.deadline_s)
                    delay = 0.5
                    break
                except PublishDeadlineError as exc:
                    log.warning(
                        "bus unavailable; facts are buffered and will be sent later",
                        buffered=self._queue.qsize() + 1,
                        error=str(exc),
                    )
                    await asyncio.sleep(delay)
                    delay = min(10.0, delay * 2)
            if self._queue.empty():
                self._idle.set()

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every fact is published; False if `timeout_s` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        if self._task is not None:
            await aio.cancel_and_wait([self._task])
