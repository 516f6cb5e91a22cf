"""Decisions that grow with the cluster travel in bounded parts and are read whole:
the pure split and join, and a 30,000-member round through a real nats-server with
its default max_payload (1 MiB), read from the start and from the newest per subject."""

from __future__ import annotations

import msgspec
import pytest

from rove.control.bus.client import Bus
from rove.control.bus.records import Recorded
from rove.control.catalogue import events as ev
from rove.control.catalogue import parts, subjects
from tests.factories import JOB

#: A Kubernetes-like node name: longer than a host name, as users deploy.
LONG = "gke-training-pool-a100-highmem-8-{:05d}-7f9c2b1d-x4kq.europe-west4-a.internal"


def big_round(rnd: int, nodes: int, *, epoch: int = 1) -> ev.RoundCompleted:
    members = tuple(
        ev.RoundMember(
            node=LONG.format(i),
            incarnation=f"inc-{i:08x}-{rnd}",
            addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
            nproc=8,
            first_rank=8 * i,
        )
        for i in range(nodes)
    )
    return ev.RoundCompleted(
        job=JOB,
        id=ev.make_id(JOB, epoch, "round", rnd),
        producer="master:m1",
        ts=100.0 + rnd,
        epoch=epoch,
        round=rnd,
        members=members,
        world_size=8 * nodes,
        master_addr="10.0.0.1",
        master_port=29500,
    )


def test_a_small_decision_is_published_as_it_is() -> None:
    small = big_round(1, 3)
    assert parts.split(small) == [small]


def test_a_large_round_is_cut_into_bounded_parts_and_joined_back_exactly() -> None:
    whole = big_round(4, 3000)
    assert len(ev.encode(whole)) > 3 * parts.PART_BYTES
    pieces = parts.split(whole)
    *body, header = pieces
    assert len(body) >= 3 and all(isinstance(p, ev.EventPart) for p in body)
    assert isinstance(header, ev.RoundCompleted)
    assert header.members == () and header.parts == len(body) and header.id == whole.id
    assert max(len(ev.encode(p)) for p in pieces) < 256 * 1024
    assert len({p.id for p in pieces}) == len(pieces), "every part is deduplicated by its id"
    joiner = parts.Joiner()
    handed = [joiner.take(ev.decode(ev.encode(p))) for p in pieces]
    assert handed[:-1] == [None] * len(body)
    assert handed[-1] == whole and not joiner.pending


def test_a_header_without_all_its_parts_is_not_handed_on() -> None:
    *body, header = parts.split(big_round(2, 3000))
    joiner = parts.Joiner()
    for p in body[1:]:
        joiner.take(p)
    with pytest.raises(parts.Incomplete, match=f"{len(body) - 1} of its {len(body)} parts"):
        joiner.take(header)


def test_parts_of_an_unfinished_whole_are_dropped_by_the_next_ones() -> None:
    *old_body, _ = parts.split(big_round(2, 3000))
    new = big_round(3, 2000)
    joiner = parts.Joiner()
    for p in old_body[:3]:  # its master was deposed before it wrote the rest
        joiner.take(p)
    for p in parts.split(new):
        last = joiner.take(p)
    assert last == new


def test_network_check_groups_are_split_too() -> None:
    groups = tuple(
        ev.CheckGroup(
            nodes=(LONG.format(i), LONG.format(i + 1)),
            incarnations=("a" * 16, "b" * 16),
            master_addr="10.0.0.1",
            master_port=29500 + i % 1000,
        )
        for i in range(0, 8000, 2)
    )
    check = ev.NetworkCheckAssigned(
        job=JOB, id="nc", producer="m", ts=1.0, epoch=1, check_round=0, groups=groups, timeout_s=5
    )
    pieces = parts.split(check)
    assert len(pieces) > 2
    joiner = parts.Joiner()
    assert [joiner.take(p) for p in pieces][-1] == check


def test_a_scale_plan_splits_each_growing_field_and_joins_back_exactly() -> None:
    """Starting a managed job of 20,000 nodes is one plan that launches them all."""
    launch = tuple(
        ev.NodeLaunch(node=ev.node_name(i, 1), slot=i, attempt=1, resources=ev.Resources(cpu=8))
        for i in range(20_000)
    )
    remove = tuple(LONG.format(i) for i in range(8_000))
    plan = ev.ScalePlan(
        job=JOB,
        id="plan-3",
        producer="master:m1",
        ts=1.0,
        epoch=2,
        plan=3,
        rule=ev.ScaleRule.INITIAL,
        reason="start",
        cause="submitted",
        launch=launch,
        remove=remove,
        target=20_000,
    )
    *body, header = parts.split(plan)
    assert all(len(ev.encode(p)) < 256 * 1024 for p in [*body, header])
    assert {p.field for p in body if isinstance(p, ev.EventPart)} == {"", "remove"}
    assert isinstance(header, ev.ScalePlan) and header.launch == () and header.remove == ()
    assert all(subjects.subject_for(p).startswith(subjects.master(JOB)) for p in body)
    joiner = parts.Joiner()
    assert [joiner.take(p) for p in [*body, header]][-1] == plan


def test_the_scalers_large_facts_are_split_on_its_own_subjects() -> None:
    created = tuple(LONG.format(i) for i in range(5_000))
    failed = ev.PlanFailed(
        job=JOB,
        id="failed-3",
        producer="scaler:s1",
        ts=1.0,
        plan=3,
        scaler="s1",
        backend="kubernetes",
        error="quota",
        removed=created,
    )
    *body, header = parts.split(failed)
    assert body and all(
        subjects.subject_for(p).startswith(subjects.scaler(JOB) + ".plan_failed.part.")
        for p in body
    )
    assert {p.field for p in body if isinstance(p, ev.EventPart)} == {"removed"}
    joiner = parts.Joiner()
    assert [joiner.take(p) for p in [*body, header]][-1] == failed


async def test_a_30000_member_round_crosses_a_default_server_and_is_read_whole(bus: Bus) -> None:
    """Whole, it is about 4 MB: four times the server's default max_payload."""
    earlier, newest = big_round(1, 30_000), big_round(2, 12_000)
    assert len(ev.encode(earlier)) > 4 * 1024 * 1024
    for r in (earlier, newest):
        await bus.publish(r)
    assert await bus.publish(newest) > 0, "a round published again is deduplicated"

    seen: list[ev.Event] = []

    def keep(rec: Recorded) -> None:
        seen.append(rec.event)

    await bus.read(subjects.EVENTS_STREAM, subjects.job_events(JOB), keep)
    assert seen == [earlier, newest]

    # an agent joining now reads the newest message of each subject: the newest
    # round's parts, stale parts of the bigger round before it, then the header
    latest: list[ev.Event] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM,
        subjects.master(JOB, ">"),
        lambda rec: latest.append(rec.event),
        lambda rej: None,
        last_per_subject=True,
    )
    try:
        await feed.caught_up.wait()
    finally:
        await feed.stop()
    assert latest == [newest]


def test_the_wire_form_is_msgpack_with_raw_items() -> None:
    *body, _ = parts.split(big_round(1, 3000))
    first = body[0]
    assert isinstance(first, ev.EventPart)
    items = msgspec.msgpack.decode(first.items, type=tuple[ev.RoundMember, ...])
    assert items[0].node == LONG.format(0) and items[0].first_rank == 0
