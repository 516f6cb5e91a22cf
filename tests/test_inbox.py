"""The agent tells the job's history (decisions recorded before its node joined) from
news by stream sequence: a node whose clock is off reads them the same."""

from __future__ import annotations

from rove.agent.inbox import History, Past
from rove.control.bus import records
from tests import factories


def _rec(seq: int) -> records.Recorded:
    return records.Recorded(stream="EVENTS", seq=seq, subject="rove.x", event=factories.ended(1))


def test_decisions_up_to_the_mark_are_history_and_the_first_past_it_ends_it() -> None:
    history = History()
    history.mark = 5
    assert [type(history.sort(_rec(s))) for s in (3, 5)] == [Past, Past]
    assert history.sort(_rec(6)) == _rec(6)
    # a stream made anew numbers from 1 again: its decisions are news, not history
    assert not isinstance(history.sort(_rec(2)), Past)


def test_a_node_that_joined_an_empty_stream_has_no_history() -> None:
    assert not isinstance(History().sort(_rec(1)), Past)
