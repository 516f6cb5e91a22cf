"""Bulk catch-up: a large backlog arrives exactly once, in order, then the live tail follows."""

from __future__ import annotations

import asyncio

import pytest

from rove.control.bus import catchup
from rove.control.bus.client import Bus
from rove.control.bus.natsclient import RoveNatsClient
from rove.control.catalogue import subjects
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


@pytest.mark.parametrize("unfiltered", [True, False])
async def test_a_stream_shared_with_another_job_gives_only_this_jobs_messages(
    bus: Bus, unfiltered: bool
) -> None:
    ours = [factories.joined(f"n{i}", n=i) for i in range(2500)]
    theirs = [factories.joined(f"n{i}", n=10_000 + i, job="other") for i in range(2500)]
    for i in range(0, 2500, 500):  # interleaved in blocks
        await bus.publish_many(ours[i : i + 500])
        await bus.publish_many(theirs[i : i + 500])
    assert isinstance(bus.nc, RoveNatsClient)
    got: list[tuple[int, str]] = []
    last = await catchup.catch_up(
        bus.nc,
        bus.js,
        subjects.EVENTS_STREAM,
        subjects.job_events("j1"),
        1,
        4500,
        lambda seq, subject, data: got.append((seq, subject)),
        unfiltered=unfiltered,
    )
    assert last == 4500
    ours_seqs = [s for s in range(1, 5001) if (s - 1) // 500 % 2 == 0]
    assert [seq for seq, _ in got] == ours_seqs
    assert all(subject.startswith("rove.ev.j1.") for _, subject in got)


async def test_the_stream_counts_choose_unfiltered_only_when_it_pays(bus: Bus) -> None:
    # One job alone, over 600 node subjects: the filtered read is the slow one.
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(600)])
    assert await catchup._unfiltered_pays(bus.js, subjects.EVENTS_STREAM, "rove.ev.j1.>")
    # As many messages of another job: dropping them costs more than filtering.
    await bus.publish_many(
        [factories.joined(f"n{i}", n=10_000 + i, job="other") for i in range(600)]
    )
    assert not await catchup._unfiltered_pays(bus.js, subjects.EVENTS_STREAM, "rove.ev.j1.>")


def test_read_unfiltered_weighs_subjects_against_other_jobs_messages() -> None:
    assert catchup.read_unfiltered(100_000, 100_000, 512)  # alone, many subjects
    assert not catchup.read_unfiltered(100_000, 100_000, 8)  # alone, few subjects
    assert not catchup.read_unfiltered(100_000, 200_000, 512)  # half the stream
    assert catchup.read_unfiltered(100_000, 110_000, 1000)  # most of it, very many subjects
    assert not catchup.read_unfiltered(0, 10, 10)
    assert not catchup.read_unfiltered(10, 0, 10)


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("rove.ev.j1.>", "rove.ev.j1.node.n1", True),
        ("rove.ev.j1.>", "rove.ev.j1", False),
        ("rove.ev.j1.>", "rove.ev.j10.node.n1", False),
        ("rove.ev.*.node.n1", "rove.ev.j1.node.n1", True),
        ("rove.ev.*.node.n1", "rove.ev.j1.node.n2", False),
        ("rove.ev.*.node.>", "rove.ev.j1.node.n1", True),
        ("rove.ev.*.node.>", "rove.ev.j1.node", False),
        ("rove.ev.j1.node.n1", "rove.ev.j1.node.n1", True),
        ("rove.ev.j1.node.n1", "rove.ev.j1.node.n1.x", False),
    ],
)
def test_subject_matcher_follows_nats_wildcards(pattern: str, subject: str, expected: bool) -> None:
    assert catchup.subject_matcher(pattern)(subject.encode()) is expected
