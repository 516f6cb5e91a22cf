"""A node waiting for its round says so now and then (pure: a fake clock and log)."""

from __future__ import annotations

import types
from typing import Any

from rove.agent.lifecycle import AgentPhase
from rove.agent.round_wait import EVERY_S, FIRST_S, RoundWait, waiting_line
from rove.control.catalogue import events as ev
from rove.control.flags.options import nats_flag


class Said:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, text: str, **kw: Any) -> None:
        assert kw == {"say": True}, "on the console"
        self.lines.append(text)


def test_a_waiting_node_says_so_after_a_while_then_now_and_then_and_not_once_it_runs() -> None:
    now = [0.0]
    log = Said()
    status = "rove status --job mn --nats nats://h:4222"
    wait = RoundWait(log, ev.RdzvParams(min_nodes=2, max_nodes=2), status, lambda: now[0])
    for t in (0.0, FIRST_S - 1):
        now[0] = t
        wait.tick(AgentPhase.WAITING)
    assert log.lines == [], "a short wait says nothing"
    now[0] = FIRST_S
    wait.tick(AgentPhase.WAITING)
    assert log.lines == [
        "waiting 10s for a round with this node: it starts once 2 nodes have joined "
        "(--nnodes 2) and a master leads the job; `rove status --job mn --nats "
        "nats://h:4222` says what it waits for"
    ]
    now[0] = FIRST_S + EVERY_S - 1
    wait.tick(AgentPhase.WAITING)
    now[0] = FIRST_S + EVERY_S
    wait.tick(AgentPhase.WAITING)
    assert len(log.lines) == 2 and log.lines[1].startswith("waiting 70s for a round")
    now[0] += 1
    wait.tick(AgentPhase.RUNNING)
    now[0] += 3 * EVERY_S
    wait.tick(AgentPhase.RUNNING)
    wait.tick(AgentPhase.WAITING)  # left out of a round: a new wait, said after a while
    assert len(log.lines) == 2


def test_the_line_says_a_range_of_nodes_and_a_jobs_own_server_needs_no_url() -> None:
    line = waiting_line(12.4, ev.RdzvParams(min_nodes=2, max_nodes=4), "rove status --job j")
    assert line.startswith("waiting 12s for a round with this node: it starts once at least")
    assert "2 nodes have joined (--nnodes 2:4)" in line and "`rove status --job j`" in line
    # the command it names: a job's own server is found by the job's folder, no URL
    own = types.SimpleNamespace(server=object(), url="nats://127.0.0.1:4222")
    shared = types.SimpleNamespace(server=None, url="nats://h:4222")
    assert nats_flag(own) == ""  # type: ignore[arg-type]
    assert nats_flag(shared) == " --nats nats://h:4222"  # type: ignore[arg-type]
