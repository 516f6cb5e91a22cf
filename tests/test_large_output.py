"""What a person reads about a job of thousands of nodes stays a screenful: `rove
status` lists the nodes worth seeing first, `rove events` summarises long lists."""

from __future__ import annotations

import time

from rove.control.bus.records import Recorded
from rove.control.catalogue import events as ev
from rove.control.cli.format import NODE_ROWS, event_line, some
from rove.control.cli.status_cmd import render, status_view
from rove.control.master.evolve import evolve
from rove.control.master.state import initial
from tests import factories


def test_status_of_3000_nodes_lists_the_lost_one_first_and_counts_the_rest() -> None:
    state = initial(factories.JOB)
    events: list[ev.Event] = [factories.elected("m1", 1), factories.configured(1)]
    events += [factories.joined(f"n{i:04d}", n=i) for i in range(3000)]
    events += [factories.lost("n2999", 1)]
    for seq, e in enumerate(events, 1):
        state = evolve(state, e, seq)
    now = time.time()
    live = {
        f"n{i:04d}": factories.heartbeat(f"n{i:04d}", ts=now - (5 if i == 7 else 1))
        for i in range(2999)
    }
    view = status_view(state, live, None, now)
    text = render(view, most=NODE_ROWS)
    rows = [line for line in text.splitlines() if line.startswith("n") and line[1].isdigit()]
    assert len(rows) == NODE_ROWS
    assert rows[0].startswith("n2999 ") and "lost" in rows[0]
    assert rows[1].startswith("n0007 "), "then the node heard from longest ago"
    assert "2,950 more nodes not listed (3,000 in all: 2,999 active, 1 lost)" in text
    every = render(view)
    assert len([x for x in every.splitlines() if x.startswith("n") and x[1].isdigit()]) == 3000


def test_an_event_line_of_a_large_round_is_short() -> None:
    big = factories.round_completed(1, 1, *(f"node-{i:05d}" for i in range(30_000)))
    line = event_line(Recorded("ROVE_EVENTS", 7, "subject", big))
    assert len(line) < 1000
    assert "(30,000 in all)" in line and "node-00000" in line


def test_some_names_and_how_many_more() -> None:
    assert some(["a", "b"]) == "a, b"
    assert some([f"n{i}" for i in range(20)], 3) == "n0, n1, n2 and 17 more"
