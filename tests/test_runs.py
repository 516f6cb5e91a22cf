"""Which stretch of a job's stream is one run (`rove.control.history.runs.span`)."""

from __future__ import annotations

import re

import pytest

from rove.control.errors import ConfigError
from rove.control.history.runs import span


def test_a_run_is_from_its_start_to_the_next_ones() -> None:
    found = {1: 0, 2: 40, 3: 90}
    assert span(found, None) == (90, None), "the newest by default"
    assert span(found, 2) == (40, 90)
    assert span(found, 1) == (0, 40)


@pytest.mark.parametrize(
    ("found", "says"),
    [({1: 0}, "has run 1 time (run 1 only)"), ({1: 0, 2: 5}, "has run 2 times (runs 1-2)")],
)
def test_a_run_that_never_was_is_refused_saying_which_were(
    found: dict[int, int], says: str
) -> None:
    with pytest.raises(ConfigError, match=rf"--run 9: the job {re.escape(says)}"):
        span(found, 9)
