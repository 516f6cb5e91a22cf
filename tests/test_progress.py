"""Step progress from a worker to its heartbeat: step, throughput and busy time per step."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from rove.agent import progress
from rove.agent.facts import NodeFacts
from rove.agent.heartbeat import Heartbeat
from rove.agent.runtime import WorkerRuntime, WorkersEnded


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
