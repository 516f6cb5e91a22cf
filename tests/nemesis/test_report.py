"""The nemesis's table: what docs/operations.md publishes is what `python -m
tests.nemesis --report` prints from the published rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.nemesis import report
from tests.nemesis.__main__ import main
from tests.support import ROOT


def test_the_table_in_the_docs_is_the_published_figures() -> None:
    """docs/operations.md shows what `python -m tests.nemesis --report` prints from the
    published rows (tests/nemesis/published.jsonl), every fault with its runs."""
    rows = report.load(report.PUBLISHED)
    table = report.table(rows)
    assert table in (ROOT / "docs" / "operations.md").read_text()
    assert {r["fault"] for r in rows} == set(report.ORDER)
    runs = {f: sum(1 for r in rows if r["fault"] == f) for f in report.ORDER}
    assert all(n >= (1 if f == "nats-outage" else 3) for f, n in runs.items()), runs


def test_report_prints_the_published_table_before_any_run_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ROVE_NEMESIS_RESULTS", str(tmp_path / "none.jsonl"))
    assert main(["--report"]) == 0
    out = capsys.readouterr().out
    assert "published.jsonl" in out
    assert report.table(report.load(report.PUBLISHED)) in out
