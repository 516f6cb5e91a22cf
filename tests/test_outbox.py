"""An outbox never dies silently: a fact it may never send is said, and its owner told."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from rove.control.bus import records
from rove.control.bus.client import Bus
from rove.control.bus.feed import Feed, StreamMark
from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev
from rove.control.errors import RoveError
from rove.control.master.service import JobService
from tests import factories
from tests.support import eventually, patience, stored_events


def _huge() -> ev.EventRejected:
    """A fact over the server's 1 MiB payload limit."""
    return ev.EventRejected(
        **ev.decision_envelope("j1", 1, "m1", 1.0, "huge"),
        stream="ROVE_EVENTS",
        stream_seq=1,
        subject="rove.ev.j1.node.n1",
        error="x",
        payload_size=2 << 20,
        payload_head=b"x" * (2 << 20),
    )


async def test_a_fact_that_can_never_be_sent_stops_the_outbox_loudly(bus: Bus) -> None:
    """A payload over the server's 1 MiB limit is no bus outage: no retry can send it."""
    outbox = Outbox(bus, what="facts of n1")
    outbox.start()
    outbox.put(factories.joined("n1"))
    outbox.put(_huge())
    outbox.put(factories.joined("n2"))
    await eventually(lambda: outbox.failure is not None, timeout=20)
    assert isinstance(outbox.failure, nats.errors.MaxPayloadError)
    assert outbox.task is not None and outbox.task.done()
    assert isinstance(outbox.task.exception(), nats.errors.MaxPayloadError), "for a supervisor"
    await asyncio.sleep(0.2)
    nodes = [r.event.node for r in await stored_events(bus) if isinstance(r.event, ev.NodeJoined)]
    assert nodes == ["n1"], "in order: nothing after the fact it failed on"
    await outbox.stop()


class Emitter(JobService):
    """A service that publishes what it is given, one fact per tick."""

    def __init__(self, bus: Bus, facts: list[ev.Event]) -> None:
        super().__init__(bus, "j1", name="emitter", tick_s=0.05)
        self.facts = facts

    def on_event(self, rec: records.Recorded) -> None:
        pass

    async def serve(self) -> None:
        while not self.stopping:
            if self.facts:
                self.emit(self.facts.pop(0))
            await self.doze()


async def test_a_service_whose_outbox_failed_ends_with_the_reason(bus: Bus) -> None:
    service = Emitter(bus, [_huge(), factories.joined("n2"), factories.joined("n3")])
    with pytest.raises(RoveError, match="emitter cannot publish its facts: MaxPayloadError"):
        await asyncio.wait_for(service.run(), patience(30))


async def test_a_feed_watchdog_that_fails_once_keeps_watching() -> None:
    """An unexpected error in one stall check is logged, and the next checks go on: a
    watchdog that died would leave its feed frozen and silent."""
    feed = Feed(sub=None, target_seq=5, last_seq=3)
    asked: list[int] = []

    async def newest() -> int:
        if not asked:
            asked.append(0)
            raise OSError("a socket error no one expected")
        return 5

    async def resubscribe(seq: int) -> object:
        asked.append(seq)
        return object()

    async def created() -> StreamMark:
        return StreamMark("the same stream", 5)

    watch = asyncio.create_task(feed.watch(newest, resubscribe, created, what="test", every_s=0.01))
    try:
        await eventually(lambda: feed.resubscribed >= 1, timeout=10)
    finally:
        watch.cancel()
    assert asked[1] == 4, "resubscribed from the next sequence after the failed check"
