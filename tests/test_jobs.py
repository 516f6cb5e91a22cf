"""Which job folders retention keeps (pure); the summaries `rove jobs` caches."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rove.control.history.jobs import Folder, to_prune


def _f(job: str, used: float, running: bool = False, pinned: bool = False) -> Folder:
    return Folder(job, used, running, pinned)


def test_retention_keeps_the_newest_the_running_and_the_pinned() -> None:
    folders = [
        _f("a", 1),
        _f("b", 2, running=True),
        _f("c", 3),
        _f("d", 4, pinned=True),
        _f("e", 5),
    ]
    assert to_prune(folders, 2) == ["c", "a"], "oldest last, b running and d pinned kept"
    assert to_prune(folders, 0) == ["e", "c", "a"]
    assert to_prune(folders, 10) == []
    assert to_prune([_f("x", 1, running=True)], 0) == []


def test_a_job_whose_workers_reported_no_step_lists_its_goodput_as_not_known() -> None:
    """As `rove goodput` says "goodput not known" for it (it was listed as 0%)."""
    from rove.control.domain import goodput as gp
    from rove.control.history.jobs import render, summarize
    from rove.control.master.state import initial
    from tests import factories

    ledger = gp.Ledger()
    for e in (factories.joined("n1", ts=100.0), factories.left("n1", ts=110.0)):
        ledger.add(e)
    report = gp.report(ledger, 120.0)
    assert report.total_s > 0 and not ledger.steps_reported
    row = summarize(initial(factories.JOB), report, ledger.steps_reported)
    assert row.goodput is None
    (line,) = render([row], set()).splitlines()[1:]
    assert " 0%" not in line and line.split()[-2:] == ["-", "-"], line


def test_a_summary_cached_by_an_older_rove_is_not_shown_but_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Summaries cached before `rove jobs` said `-` for a job without steps kept `0%`
    for ever: a cached summary is used only if this rove's `summarize` made it."""
    from rove.control.history.jobs import SUMMARY, Summary, cache, cached

    monkeypatch.setenv("ROVE_HOME", str(tmp_path))
    (tmp_path / "jobs" / "j").mkdir(parents=True)
    row = Summary("j", "finished", 100.0, 1.5, 1, 0, "", None)
    cache(row)
    assert cached("j") == row, "this rove's own summary is used as it was cached"
    old = {**row.to_json(), "goodput": 0.0}  # as cached before the version was kept
    (tmp_path / "jobs" / "j" / SUMMARY).write_text(json.dumps(old))
    assert cached("j") is None, "an older rove's summary is read again from the events"
    (tmp_path / "jobs" / "j" / SUMMARY).write_text(json.dumps(["not", "a", "summary"]))
    assert cached("j") is None


def test_a_job_whose_events_were_not_reached_lists_no_made_up_numbers() -> None:
    """(It listed `0.0s 0 0`, as if it had run for no time.)"""
    from rove.control.history.jobs import ELSEWHERE, Summary, render

    row = Summary("far", ELSEWHERE, None, 0.0, 0, 0, "its events are on nats://h:4222", None)
    (line,) = render([row], set()).splitlines()[1:]
    assert line.split()[:7] == ["far", ELSEWHERE, "-", "-", "-", "-", "-"], line
    assert line.endswith("its events are on nats://h:4222")
