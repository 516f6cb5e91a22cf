"""Bulk catch-up: a large backlog arrives exactly once, in order, then the live tail follows."""

from __future__ import annotations

import asyncio

from rove.control import catchup, subjects
from rove.control.bus import Bus
from rove.control.natsclient import RoveNatsClient
from tests import factories
from tests.support import eventually


async def test_a_large_backlog_then_live_events_arrive_exactly_once_in_order(bus: Bus) -> None:
    n = catchup.MIN_BACKLOG * 3
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(n)])
    seqs: list[int] = []

    async def publish_during_catch_up() -> None:
        await asyncio.sleep(0.01)
        await bus.publish_many([factories.joined(f"late{i}", n=n + i) for i in range(300)])

    live = asyncio.create_task(publish_during_catch_up())
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.job_events("j1"),
        lambda r: seqs.append(r.seq),
        lambda r: seqs.append(r.seq),
    )
    await feed.caught_up.wait()
    await live
    await eventually(lambda: len(seqs) >= n + 300)
    await asyncio.sleep(0.2)
    assert seqs == list(range(1, n + 301))
    await feed.stop()


async def test_catch_up_stops_at_its_target_and_the_rest_is_not_lost(bus: Bus) -> None:
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(3000)])
    assert isinstance(bus.nc, RoveNatsClient)
    got: list[int] = []
    last = await catchup.catch_up(
        bus.nc,
        bus.js,
        subjects.EVENTS_STREAM,
        "rove.ev.j1.>",
        1,
        1000,
        lambda seq, subject, data: got.append(seq),
    )
    assert last >= 1000
    assert got == list(range(1, last + 1)), "no gap and no repeat up to what it reports"
    assert not bus.nc.raw_deliveries, "its raw subscription is gone"


async def test_garbage_in_the_backlog_is_rejected_not_fatal(bus: Bus) -> None:
    events = [factories.joined(f"n{i}", n=i) for i in range(2500)]
    await bus.publish_many(events[:1000])
    await bus.publish_raw("rove.ev.j1.node.n1", b"\xc1garbage")
    await bus.publish_many(events[1000:])
    good: list[int] = []
    bad: list[int] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.job_events("j1"),
        lambda r: good.append(r.seq),
        lambda r: bad.append(r.seq),
    )
    await feed.caught_up.wait()
    await feed.stop()
    assert bad == [1001]
    assert good == [s for s in range(1, 2502) if s != 1001]
