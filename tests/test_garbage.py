"""Garbage on every subject: dead-lettered, logged with its sequence, and the master keeps going."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.master import snapshots
from tests import factories
from tests.support import MasterProc, eventually, fold_records, stored_events

pytestmark = pytest.mark.slow

EVENT_SUBJECTS = [
    "rove.ev.j1.node.n1",
    "rove.ev.j1.master",
    "rove.ev.j1.master.elected",
    "rove.ev.j1.master.node_lost",
    "rove.ev.j1.data.ds1",
    "rove.ev.j1.plan",
    "rove.ev.j1.scaler",
    "rove.ev.j1.cmd",
]
PAYLOADS = {
    "garbage": b"\xc1\xff\x00 not msgpack at all",
    "wrong-schema": msgspec.msgpack.encode({"type": "node_joined", "job": "j1", "pid": "x"}),
    "unknown-type": msgspec.msgpack.encode({"type": "node_teleported", "job": "j1"}),
    "huge": b"\xc1" * 200_000,
}


async def test_garbage_on_every_subject_is_dead_lettered_and_the_master_keeps_deciding(
    bus: Bus, tmp_path: Path
) -> None:
    master = MasterProc(bus.url, "j1", "mg", tmp_path, "--node-timeout", "30")
    try:
        await eventually(lambda: "elected leader" in master.log())
        await bus.publish(factories.joined("n1"))
        bad: dict[int, str] = {}  # stream sequence -> subject
        # Paused while the bursts are stored, the master meets each one whole (how many
        # arrive between two ticks of a running master is the machine's timing).
        master.pause()
        for subject in EVENT_SUBJECTS:
            for payload in PAYLOADS.values():
                bad[await bus.publish_raw(subject, payload)] = subject
        bad_seqs = sorted(bad)
        for payload in PAYLOADS.values():
            await bus.publish_raw(subjects.heartbeat("j1", "n1"), payload)
            await bus.publish_raw(subjects.snapshot("j1"), payload)
        master.resume()

        async def dead_letters() -> list[ev.EventRejected]:
            return [
                r.event for r in await stored_events(bus) if isinstance(r.event, ev.EventRejected)
            ]

        await eventually(
            lambda: _count(
                dead_letters(), lambda d: d.stream == subjects.EVENTS_STREAM, len(bad_seqs)
            ),
            timeout=30,
        )
        letters = await dead_letters()
        on_events = [d for d in letters if d.stream == subjects.EVENTS_STREAM]
        covered = sorted(
            seq
            for d in on_events
            for seq, subject in bad.items()
            if subject == d.subject and d.stream_seq <= seq <= d.upto
        )
        assert covered == bad_seqs, "each exactly once"
        assert sum(d.count for d in on_events) == len(bad_seqs)
        assert len(on_events) < len(bad_seqs), "a burst from one sender is batched"
        assert {d.subject for d in on_events} == set(EVENT_SUBJECTS)
        assert all(len(d.payload_head) <= ev.PAYLOAD_HEAD_BYTES for d in letters), "bounded"
        assert any(d.stream == subjects.HEARTBEAT_STREAM for d in letters)

        # The master is still the leader and still decides.
        await bus.publish(factories.stop())
        await eventually(lambda: _has_ended(bus), timeout=20)
        log = master.log()
        lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
        logged = [x for x in lines if x.get("event", "").startswith("rejected a stored message")]
        firsts = {min(seq for seq, s in bad.items() if s == subject) for subject in EVENT_SUBJECTS}
        assert firsts <= {x.get("seq") for x in logged}, "each sender's first, with its sequence"
        assert len(logged) < len(bad_seqs), "a burst in a few lines, not a line each"
        assert await asyncio.to_thread(master.proc.wait, 30) == 0, "the job ended: it stops"
    finally:
        master.stop()

    # A garbage snapshot is ignored on restart: the state comes from a full replay.
    await bus.publish_raw(subjects.snapshot("j1"), PAYLOADS["garbage"])
    assert await snapshots.load(bus, "j1") is None
    restarted = MasterProc(bus.url, "j1", "mg2", tmp_path)
    try:
        await eventually(lambda: "elected leader" in restarted.log())
        state = fold_records(await stored_events(bus))
        assert state.leader == "mg2" and state.phase is ev.JobPhase.STOPPED
        assert restarted.proc.poll() is None, "a master of an ended job waits for its next run"
    finally:
        restarted.stop()


async def _count(coro: object, pred: object, n: int) -> bool:
    """Whether the dead letters matching `pred` cover at least `n` messages."""
    items = await coro  # type: ignore[misc]
    return sum(x.count for x in items if pred(x)) >= n  # type: ignore[operator]


async def _has_ended(bus: Bus) -> bool:
    return any(isinstance(r.event, ev.JobEnded) for r in await stored_events(bus))


async def test_consumers_survive_a_flood_of_garbage(bus: Bus) -> None:
    await asyncio.gather(*(bus.publish_raw("rove.ev.j1.node.n1", b"\xc1") for _ in range(300)))
    await bus.publish(factories.joined("n1"))
    recs = await stored_events(bus)
    assert [ev.kind(r.event) for r in recs] == ["node_joined"]
