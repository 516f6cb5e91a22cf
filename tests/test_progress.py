"""Step progress from a worker to its heartbeat: step, throughput and busy time per step."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rove.agent import heartbeat, progress
from rove.agent.facts import NodeFacts
from rove.agent.heartbeat import Heartbeat
from rove.agent.runtime import WorkerRuntime, WorkersEnded
from rove.control.process import aio
from tests.support import eventually


def test_report_accumulates_samples_and_busy_time_in_the_shared_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "p"
    progress.create(path)
    monkeypatch.setenv(progress.ENV, str(path))
    monkeypatch.setattr(progress, "_writer", None)
    monkeypatch.setattr(progress, "_checked", False)
    progress.report(1, samples=8, busy_s=0.25)
    progress.report(2, samples=8, busy_s=0.5)
    p = progress.read(path)
    assert p is not None
    assert (p.step, p.samples, p.busy_s) == (2, 16.0, 0.75)


class ScriptedRuntime(WorkerRuntime):
    """Pure logic only: progress the test sets, no processes."""

    def __init__(self) -> None:
        self.now: dict[int, progress.Progress] = {}

    @property
    def running(self) -> bool:
        return True

    @property
    def round(self) -> int:
        return 1

    def start(self, round_: int, envs: dict[int, dict[str, str]]) -> dict[int, int]:
        raise NotImplementedError

    async def wait(self) -> WorkersEnded:
        raise NotImplementedError

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        raise NotImplementedError

    def pids(self) -> dict[int, int]:
        return {0: os.getpid()}

    def progress(self) -> dict[int, progress.Progress]:
        return self.now


def test_heartbeats_carry_busy_seconds_per_step_and_the_nodes_capacity() -> None:
    runtime = ScriptedRuntime()
    facts = NodeFacts(outbox=None, job="j", node="n1")  # type: ignore[arg-type]
    hb = Heartbeat(None, facts, runtime, "127.0.0.1", lambda: (1, 0))  # type: ignore[arg-type]
    runtime.now = {0: progress.Progress(step=10, samples=80, at=100.0, busy_s=2.0)}
    first = hb.event()
    assert first.ranks[0].busy_s is None  # one reading: no interval yet
    runtime.now = {0: progress.Progress(step=14, samples=112, at=102.0, busy_s=3.2)}
    second = hb.event()
    assert second.ranks[0].busy_s == pytest.approx(0.3)  # 1.2 s over 4 steps
    assert second.ranks[0].samples_per_s == pytest.approx(16.0)
    assert second.capacity is not None
    assert second.capacity.cpu >= 1 and second.capacity.memory_bytes > 0


class StalledBus:
    """A bus whose JetStream takes the heartbeats but does not acknowledge them until
    told (pure logic: what the loop does while it waits)."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.waiting = 0
        self.most_waiting = 0
        self.answer = asyncio.Event()

    async def publish(self, event: Any, *, deadline_s: float) -> None:
        self.sent.append(event.seq)
        self.waiting += 1
        self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            await self.answer.wait()
        finally:
            self.waiting -= 1


async def test_heartbeats_keep_their_interval_while_their_acknowledgements_wait() -> None:
    """Each tick sends its heartbeat though the last one's acknowledgement has not come
    (it went out: the leader hears it live), with a bounded number waiting; each one
    acknowledged tells the storage fence."""
    bus, stored = StalledBus(), []
    facts = NodeFacts(outbox=None, job="j", node="n1")  # type: ignore[arg-type]
    hb = Heartbeat(
        bus,  # type: ignore[arg-type]
        facts,
        ScriptedRuntime(),
        "127.0.0.1",
        lambda: (1, 0),
        interval_s=0.01,
        on_stored=lambda: stored.append(1),
    )
    beating = asyncio.create_task(hb.run())
    try:
        await eventually(lambda: len(bus.sent) >= heartbeat.IN_FLIGHT, timeout=30)
        assert stored == [] and bus.sent[:3] == [1, 2, 3], "sent, none acknowledged yet"
        bus.answer.set()
        await eventually(lambda: len(stored) >= heartbeat.IN_FLIGHT + 2, timeout=30)
    finally:
        await aio.cancel_and_wait([beating])
    assert bus.most_waiting == heartbeat.IN_FLIGHT, "the waiting ones are bounded"


async def test_a_heartbeat_that_fails_of_its_own_error_ends_the_loop() -> None:
    class Broken:
        async def publish(self, event: Any, *, deadline_s: float) -> None:
            raise ValueError("a bug")

    facts = NodeFacts(outbox=None, job="j", node="n1")  # type: ignore[arg-type]
    hb = Heartbeat(Broken(), facts, ScriptedRuntime(), "127.0.0.1", lambda: (1, 0), interval_s=0.01)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a bug"):
        await asyncio.wait_for(hb.run(), 30)


def test_the_step_restored_reaches_the_master_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpointer says the step it restored (step 0 too: the file stores it plus
    one, so a zeroed file says none); the agent's reports carry it in the first tick that
    sees it, not after `every_s`, and then only every `every_s` again."""
    from rove.agent.reports import ProgressReports
    from rove.control.catalogue import events as ev

    path = tmp_path / "p"
    progress.create(path)
    monkeypatch.setenv(progress.ENV, str(path))
    monkeypatch.setattr(progress, "_writer", None)
    monkeypatch.setattr(progress, "_checked", False)
    progress.report(1)
    first = progress.read(path)
    assert first is not None and first.restored_step is None
    sent: list[ev.Event] = []

    class Outbox:
        def put(self, event: ev.Event) -> None:
            sent.append(event)

    now = [0.0]
    facts = NodeFacts(outbox=Outbox(), job="j", node="n1")  # type: ignore[arg-type]
    reports = ProgressReports(
        facts, lambda: {0: p} if (p := progress.read(path)) else {}, clock=lambda: now[0]
    )
    reports.start(2, restoring=True)
    now[0] = 1.0
    reports.tick()
    assert sent == [], "nothing restored, and every_s has not passed"
    progress.restored(0.5, 0)
    progress.report(2)
    reports.tick()
    assert [(e.round, e.restored_step, e.restore_s) for e in sent] == [(2, 0, 0.5)]  # type: ignore[attr-defined]
    progress.report(3)
    now[0] = 2.0
    reports.tick()
    assert len(sent) == 1, "the step restored was said: the next report waits for every_s"
    progress.restored(0.25, 17)
    p = progress.read(path)
    assert p is not None and p.restored_step == 17 and p.restore_s == 0.75
