"""An agent says when no master has led its job for a while, and when one leads again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from rove.agent.leader_watch import LeaderWatch
from rove.control.process import logs as rove_logs
from rove.control.process import metrics


@pytest.fixture(autouse=True)
def _info() -> Iterator[None]:
    rove_logs.configure("info")  # the suite logs warnings only
    yield
    rove_logs.configure("warning")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(logs: list[dict[str, Any]]) -> list[str]:
    return [e["event"] for e in logs]


def test_leaderless_is_said_after_the_wait_then_every_few_minutes_and_its_end_too() -> None:
    clock = Clock()
    watch = LeaderWatch(None, "j1", after_s=60, repeat_s=300, clock=clock)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        watch.saw("m1")
        for t in (10, 30, 65):  # the lease expires at 10 s
            clock.now = t
            watch.saw(None)
        assert lines(logs) == [], "not before 60 s without a leader"
        clock.now = 75
        watch.saw(None)
        clock.now = 200
        watch.saw(None)
        clock.now = 380
        watch.saw(None)
        clock.now = 390
        watch.saw("m2")
    said = lines(logs)
    assert len(said) == 3
    assert said[0].startswith("no master has led job j1 for 65s")
    assert "rove master --job j1" in said[0]
    assert said[1].startswith("no master has led job j1 for 370s")
    assert said[2] == "master m2 leads job j1 again, after 380s without one"
    gauge = metrics.LEADERLESS.labels("j1")._value.get()
    assert gauge == 0


def test_a_short_failover_says_nothing() -> None:
    clock = Clock()
    watch = LeaderWatch(None, "j2", after_s=60, clock=clock)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        watch.saw(None)
        clock.now = 8
        watch.saw(None)
        assert metrics.LEADERLESS.labels("j2")._value.get() == 8
        clock.now = 9
        watch.saw("m2")
    assert lines(logs) == []


def test_status_says_how_long_no_master_has_decided_anything() -> None:
    from rove.control.catalogue import events as ev
    from rove.control.cli.status_cmd import render, status_view
    from tests.sim import Sim

    s = Sim(ev.RdzvParams(min_nodes=1, max_nodes=1))
    s.join("n1")
    s.tick()
    decided = s.state.decided_at
    assert decided == s.now
    quiet = render(status_view(s.state, s.liveness, None, decided + 30))
    assert "lease held by nobody (failover in progress, or no master running)" in quiet
    long = render(status_view(s.state, s.liveness, None, decided + 150))
    assert "lease held by nobody: no master has decided anything for 150s" in long
    assert "rove master --job j1" in long


def test_a_bus_that_does_not_answer_is_said_after_the_wait_and_its_return_too() -> None:
    """JetStream without a quorum answers nothing: the lease cannot be read, so no
    leaderless line could come. (The nemesis's long quorum loss went unsaid: the watch
    logged it at debug level only.)"""
    clock = Clock()
    watch = LeaderWatch(None, "j1", after_s=60, repeat_s=300, clock=clock)  # type: ignore[arg-type]
    with structlog.testing.capture_logs() as logs:
        watch.answered()
        for t in (5, 30, 64):
            clock.now = t
            watch.unanswered("nats: no response from stream")
        assert lines(logs) == [], "not before 60 s"
        clock.now = 66
        watch.unanswered("nats: no response from stream")
        clock.now = 70
        watch.unanswered("nats: no response from stream")
        clock.now = 80
        watch.answered()
        clock.now = 90
        watch.answered()
    said = lines(logs)
    assert len(said) == 2, said
    assert said[0].startswith("the bus has not answered job j1 for 61s")
    assert "JetStream has lost its quorum" in said[0] and "goes on when it answers" in said[0]
    assert said[1] == "the bus answers job j1 again, after 75s"
