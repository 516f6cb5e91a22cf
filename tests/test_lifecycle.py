"""The agent's lifecycle: the transitions its docstring lists, and no others."""

from __future__ import annotations

import pytest

from rove.agent.lifecycle import AgentPhase as P
from rove.agent.lifecycle import advance


@pytest.mark.parametrize(
    "path",
    [
        [P.STARTING, P.WAITING, P.RUNNING, P.FINISHED, P.STOPPING, P.STOPPED],
        [P.STARTING, P.WAITING, P.RUNNING, P.RUNNING, P.WAITING, P.RUNNING, P.STOPPING],
        [P.STARTING, P.WAITING, P.RUNNING, P.FINISHED, P.RUNNING, P.FINISHED],
        [P.STARTING, P.STOPPING, P.STOPPED],
    ],
)
def test_the_documented_paths_are_allowed(path: list[P]) -> None:
    phase = path[0]
    for new in path[1:]:
        phase = advance(phase, new)
    assert phase is path[-1]


@pytest.mark.parametrize(
    ("current", "new"),
    [
        (P.STARTING, P.RUNNING),
        (P.WAITING, P.FINISHED),
        (P.STOPPING, P.RUNNING),
        (P.STOPPED, P.STOPPING),
    ],
)
def test_anything_else_is_a_bug_named_in_the_error(current: P, new: P) -> None:
    with pytest.raises(AssertionError, match=f"{current.value} -> {new.value}"):
        advance(current, new)
