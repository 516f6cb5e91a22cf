"""Snapshots: a new master loads the newest one and replays only the tail."""

from __future__ import annotations

import asyncio
import contextlib
import random

import immutables
import msgspec
import nats.js.errors
import pytest
import structlog.testing

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import LostEventsError
from rove.control.master import snapshots
from rove.control.master.replica import Replica
from rove.control.master.runner import MasterRunner
from rove.control.master.state import JobState, NodeRecord, NodeStatus, encode_state, initial
from tests import factories
from tests.support import eventually, fold_records, stored_events


async def loaded_state(bus: Bus) -> JobState | None:
    loaded = await snapshots.load(bus, "j1")
    return loaded.state if loaded is not None else None


async def test_a_new_replica_loads_the_snapshot_and_replays_only_the_tail(bus: Bus) -> None:
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(300)])
    recs = await stored_events(bus)
    await snapshots.save(bus, fold_records(recs, upto=200), master="t", now=1.0)
    replayed: list[int] = []
    replica = Replica(bus, "j1", on_applied=lambda r: replayed.append(r.seq))
    await replica.start()
    await replica.stop()
    assert replica.snapshot_seq == 200
    assert replayed == list(range(201, 301))
    assert replica.state == fold_records(recs)


def large_state(nodes: int, applied_seq: int) -> JobState:
    """A state of `nodes` active nodes with long fields that do not compress: well over
    the inline limit."""
    records = {
        f"node-{i}": NodeRecord(
            node=f"node-{i}",
            host=random.Random(i).randbytes(100).hex(),
            pid=i,
            incarnation="x" * 40,
            status=NodeStatus.ACTIVE,
            joined_ts=float(i),
        )
        for i in range(nodes)
    }
    return msgspec.structs.replace(
        initial("j1"), nodes=immutables.Map(records), applied_seq=applied_seq
    )


async def test_a_large_snapshot_goes_to_the_object_store_and_loads_back(bus: Bus) -> None:
    state = large_state(4000, 7)
    snap = await snapshots.save(bus, state, master="t", now=1.0)
    assert snap.object_name is not None and snap.state is None
    assert snap.size > snapshots.INLINE_LIMIT
    assert await loaded_state(bus) == state


async def test_snapshots_are_compressed_and_one_written_before_that_still_loads(
    bus: Bus,
) -> None:
    state = msgspec.structs.replace(large_state(10, 4), nodes=immutables.Map({
        f"node-{i}": NodeRecord(
            node=f"node-{i}", host="gke-pool-a100-8-node.internal", pid=i, incarnation="x" * 40,
            status=NodeStatus.ACTIVE, joined_ts=1.0,
        )
        for i in range(5000)
    }))  # fmt: skip
    snap = await snapshots.save(bus, state, master="t", now=1.0)
    assert snap.compression == "zlib" and snap.state is not None, "1 MB of state, inline"
    assert snap.size > 5 * snapshots.INLINE_LIMIT > 5 * len(snap.state)
    assert await loaded_state(bus) == state
    # one written as it was encoded (rove before compression) is read as it is
    older = snapshots.Snapshot(
        job="j1", applied_seq=4, epoch=0, master="t", ts=1.0, size=0,
        state=encode_state(large_state(10, 4)),
    )  # fmt: skip
    await bus.publish_raw(subjects.snapshot("j1"), msgspec.msgpack.encode(older))
    assert await loaded_state(bus) == large_state(10, 4)


async def test_a_snapshot_of_another_job_on_the_subject_is_ignored(bus: Bus) -> None:
    other = msgspec.structs.replace(initial("j2"), applied_seq=3)
    await snapshots.save(bus, other, master="t", now=1.0)
    raw = await bus.js.get_last_msg(subjects.SNAPSHOT_STREAM, subjects.snapshot("j2"))
    await bus.publish_raw(subjects.snapshot("j1"), raw.data or b"")
    assert await snapshots.load(bus, "j1") is None


async def test_a_leader_that_cannot_write_its_snapshot_leads_on_and_writes_it_later(
    bus: Bus,
) -> None:
    """A snapshot only shortens a replay. Every server of a 3-node cluster restarted at
    once: the snapshot stream had no leader yet, reading the newest snapshot had "no
    responders", and the leader died of it. Here the stream is gone (the same answer)."""
    with structlog.testing.capture_logs() as logs:
        runner = MasterRunner(
            bus, "j1", "m1", ev.JobSpec(node_timeout_s=60), tick_s=0.05, snapshot_every_events=1
        )
        task = asyncio.create_task(runner.run())
        try:
            await eventually(lambda: runner.role == "leader")
            await bus.js.delete_stream(subjects.SNAPSHOT_STREAM)
            await bus.publish(factories.joined("n1"))
            await eventually(
                lambda: any("could not write a snapshot" in e["event"] for e in logs), timeout=30
            )
            assert not task.done() and runner.role == "leader"
            await bus.ensure_streams()  # the stream answers again: the snapshot is written
            await eventually(lambda: loaded_state(bus), timeout=30)
        finally:
            runner.stop()
            await task


async def test_the_leader_snapshots_every_n_events(bus: Bus) -> None:
    runner = MasterRunner(
        bus,
        "j1",
        "m1",
        ev.JobSpec(node_timeout_s=60),
        tick_s=0.05,
        snapshot_every_events=100,
        snapshot_every_s=3600,
    )
    task = asyncio.create_task(runner.run())
    try:
        await eventually(lambda: runner.role == "leader")
        await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(250)])
        stored = (await stored_events(bus))[-1].seq

        async def snapshot_at_least(seq: int) -> bool:
            snap = await loaded_state(bus)
            return snap is not None and snap.applied_seq >= seq

        # A leader is never 100 events behind its last snapshot once it has folded them
        # all, however many it folded between two ticks (a busy machine folds dozens):
        # the snapshot it ends on is at most 99 behind, past the one it took when elected.
        await eventually(lambda: snapshot_at_least(stored - 99))
    finally:
        runner.stop()
        await task
    final = await loaded_state(bus)
    assert final is not None
    assert final == fold_records(await stored_events(bus), upto=final.applied_seq)
    assert final.applied_seq == (await stored_events(bus))[-1].seq, "final snapshot on stop"


@pytest.mark.parametrize("garbage", [b"\xc1", msgspec.msgpack.encode({"format": 1})])
async def test_an_unreadable_snapshot_means_a_full_replay(bus: Bus, garbage: bytes) -> None:
    await bus.publish(factories.joined("n1"))
    await bus.publish_raw(subjects.snapshot("j1"), garbage)
    assert await snapshots.load(bus, "j1") is None
    replica = Replica(bus, "j1")
    await replica.start()
    await replica.stop()
    assert "n1" in replica.state.nodes


async def test_a_stream_that_lost_what_the_snapshot_folded_fails_the_rebuild_loudly(
    bus: Bus,
) -> None:
    """What lost acknowledged writes look like: the snapshot (its own stream and object
    store) is at sequence 40, the event stream was recreated and holds less. A master
    must not rebuild on it as if nothing happened."""
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(40)])
    await snapshots.save(bus, fold_records(await stored_events(bus)), master="t", now=1.0)
    await bus.js.delete_stream(subjects.EVENTS_STREAM)
    await bus.ensure_streams()
    await bus.publish_many([factories.joined(f"m{i}", n=i) for i in range(5)])
    with pytest.raises(LostEventsError, match="ends at sequence 5, but the job's snapshot"):
        await Replica(bus, "j1").start()


async def test_events_purged_after_the_snapshot_fail_the_rebuild_loudly(bus: Bus) -> None:
    await bus.publish_many([factories.joined(f"n{i}", n=i) for i in range(30)])
    await snapshots.save(bus, fold_records(await stored_events(bus), upto=10), master="t", now=1.0)
    await bus.js.purge_stream(subjects.EVENTS_STREAM, keep=5)  # 1..25 gone
    with pytest.raises(LostEventsError, match=r"events 11\.\.25 were purged or expired"):
        await Replica(bus, "j1").start()


def test_a_large_job_is_snapshotted_every_fifth_as_many_events_as_it_has_nodes() -> None:
    def due(behind: int, nodes: int, since_s: float = 1.0) -> bool:
        return snapshots.due(behind, nodes, since_s, every_events=1000, every_s=30.0)

    assert not due(999, 10) and due(1000, 10)
    assert not due(4_999, 25_000) and due(5_000, 25_000)
    assert due(1, 25_000, since_s=30.0), "and at least every --snapshot-interval"
    assert not due(0, 25_000, since_s=300.0), "nothing new: nothing to write"


def test_continuity_is_judged_from_the_snapshot_and_the_streams_bounds() -> None:
    from rove.control.master.continuity import problem

    assert problem(40, 1, 50) is None
    assert problem(40, 41, 50) is None, "the tail starts right after the snapshot"
    assert problem(0, 1, 0) is None, "an empty stream and no snapshot"
    assert "ends at sequence 30" in (problem(40, 1, 30) or "")
    assert "events 41..44" in (problem(40, 45, 60) or "")


async def test_each_large_snapshot_deletes_the_one_before_and_no_message_is_large(
    bus: Bus,
) -> None:
    names = []
    for seq in (10, 20, 30):
        snap = await snapshots.save(bus, large_state(3000, seq), master="t", now=1.0)
        assert snap.object_name is not None
        names.append(snap.object_name)
    obs = await bus.js.object_store(subjects.SNAPSHOT_OBJECTS)
    kept = [o.name for o in await obs.list() if not o.deleted]
    assert kept == [names[-1]], "the older snapshots' objects are deleted"
    assert await loaded_state(bus) == large_state(3000, 30)
    info = await bus.js.stream_info(f"OBJ_{subjects.SNAPSHOT_OBJECTS}")
    # every stored chunk, and the pointer, is well under 256 KiB
    largest = 0
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            largest = max(largest, len((await bus.js.get_msg(info.config.name, seq)).data or b""))
    assert 0 < largest <= snapshots.INLINE_LIMIT
    pointer = await bus.js.get_last_msg(subjects.SNAPSHOT_STREAM, subjects.snapshot("j1"))
    assert len(pointer.data or b"") < 1024


async def test_an_event_the_fold_fails_on_is_said_and_skipped_and_the_replica_goes_on(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in a pure fold (it once raised KeyError on a late acknowledgement) must not
    stop a master's replica: the event is named in an error, skipped, and the events
    after it are folded."""
    from rove.control.master import replica as replica_module

    real = replica_module.evolve

    def failing(state: JobState, event: ev.Event, seq: int) -> JobState:
        if isinstance(event, ev.NodeJoined) and event.node == "n1":
            raise KeyError(4)
        return real(state, event, seq)

    monkeypatch.setattr(replica_module, "evolve", failing)
    for node in ("n0", "n1", "n2"):
        await bus.publish(factories.joined(node))
    replica = Replica(bus, "j1", use_snapshot=False)
    with structlog.testing.capture_logs() as logged:
        await replica.start()
        await replica.stop()
    assert set(replica.state.nodes) == {"n0", "n2"}
    assert replica.seen_seq == 3
    (said,) = [e for e in logged if "the fold failed on an event" in e["event"]]
    assert said["kind"] == "node_joined" and said["seq"] == 2 and said["log_level"] == "error"


async def test_the_goodput_ledger_comes_back_with_the_state_inline_or_from_the_object_store(
    bus: Bus,
) -> None:
    from rove.control.domain import goodput as gp
    from tests.test_goodput import many_nodes, one_failure

    for state, ledger in (
        (large_state(10, 4), gp.of_events(one_failure())),
        (large_state(4000, 7), gp.of_events(many_nodes(300, 600))),  # the object store's
    ):
        snap = await snapshots.save(bus, state, master="t", now=1.0, goodput=ledger)
        assert snap.goodput_size > 0
        loaded = await snapshots.load(bus, "j1")
        assert loaded is not None and loaded.state == state and loaded.goodput == ledger
    # one written before the ledger was kept: the state, and no ledger
    await snapshots.save(bus, large_state(10, 9), master="t", now=1.0)
    assert await snapshots.load(bus, "j1") == snapshots.Loaded(large_state(10, 9), None)


async def test_a_ledger_that_cannot_be_read_is_said_and_the_state_still_loads(bus: Bus) -> None:
    import zlib

    state = large_state(10, 4)
    data = encode_state(state)
    snap = snapshots.Snapshot(
        job="j1", applied_seq=4, epoch=0, master="t", ts=1.0, size=len(data),
        state=zlib.compress(data + b"\xc1not a ledger"), compression="zlib", goodput_size=13,
    )  # fmt: skip
    await bus.publish_raw(subjects.snapshot("j1"), msgspec.msgpack.encode(snap))
    with structlog.testing.capture_logs() as logged:
        loaded = await snapshots.load(bus, "j1")
    assert loaded == snapshots.Loaded(state, None)
    assert any("goodput ledger cannot be read" in e["event"] for e in logged)


async def test_a_master_restarted_from_its_snapshot_keeps_the_jobs_whole_goodput(
    bus: Bus,
) -> None:
    """The first master folds a round of a job and writes its snapshot as it stops; a
    second one starts from that snapshot and folds what came after. Its goodput ledger
    (`rove_goodput_ratio`) is the whole job's, as a replay of every event gives it, not
    the part since the snapshot."""
    from rove.control.domain import goodput as gp
    from tests.test_goodput import one_failure

    events = one_failure()
    half = next(i for i, e in enumerate(events) if isinstance(e, ev.WorkerExited))

    def runner(name: str) -> MasterRunner:
        return MasterRunner(bus, "j1", name, ev.JobSpec(node_timeout_s=600), tick_s=0.05)

    async def lead_then_stop(r: MasterRunner) -> None:
        task = asyncio.create_task(r.run())
        try:
            await eventually(lambda: r.role == "leader")
        finally:
            r.stop()
            await task

    await bus.publish_many(events[:half])
    first = runner("m1")
    await lead_then_stop(first)
    assert first.metrics.ledger.rounds, "the first master folded round 1"
    await bus.publish_many(events[half:])
    second = runner("m2")
    await lead_then_stop(second)
    assert second.replica.snapshot_seq > half, "the second master started from the snapshot"
    replayed = gp.of_events(
        [r.event for r in await stored_events(bus) if not isinstance(r.event, ev.Heartbeat)]
    )
    now = 500.0
    assert second.metrics.ledger.first_ts == replayed.first_ts == 0.0
    assert gp.report(second.metrics.ledger, now) == gp.report(replayed, now)


async def test_a_master_starting_again_from_a_snapshot_never_counts_goodput_twice(
    bus: Bus,
) -> None:
    """A catch-up that failed half-way starts again from the snapshot: the ledger is the
    snapshot's (or a new one for a snapshot without a ledger), never the events folded
    before plus the same events again."""
    from rove.control.domain import goodput as gp
    from tests.test_goodput import one_failure

    runner = MasterRunner(bus, "j1", "m1", ev.JobSpec(node_timeout_s=60))
    for e in one_failure():
        runner.metrics.ledger.add(e)
    kept = gp.of_events(one_failure()[:3])
    runner.on_snapshot(snapshots.Loaded(large_state(10, 3), kept))
    assert runner.metrics.ledger is kept
    runner.on_snapshot(snapshots.Loaded(large_state(10, 3), None))
    assert runner.metrics.ledger == gp.Ledger()
    runner.metrics.close()
