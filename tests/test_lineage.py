"""The tests' reader of per-step traces (`tests.lineage.rows`): it reads only what was
appended since its last read, and must see exactly what a whole read would."""

from __future__ import annotations

import json
from pathlib import Path

from tests import lineage


def whole(trace: Path) -> list[dict[str, object]]:
    """A read of the whole file, as the reader did before it read increments."""
    out = []
    for line in trace.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_rows_appended_between_reads_cut_lines_and_a_replaced_file_read_as_a_whole_read(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    assert lineage.rows(trace) == [], "no file yet"
    with trace.open("a") as f:
        f.write('{"step": 1}\n{"step": 2}\n')
    assert lineage.rows(trace) == whole(trace) == [{"step": 1}, {"step": 2}]
    with trace.open("a") as f:
        f.write('{"step": 3}\n{"st')  # a rank is writing its next line
        f.flush()
        assert lineage.rows(trace) == [{"step": 1}, {"step": 2}, {"step": 3}]
        f.write('ep": 4}')  # whole, but not ended yet
        f.flush()
        assert lineage.rows(trace) == whole(trace)
        assert lineage.rows(trace)[-1] == {"step": 4}
        f.write('\n{"step": 5, "cut by kill -9')  # and the next rank appends after it
        f.write('{"step": 6}\n{"step": 7}\n')
    assert lineage.rows(trace) == whole(trace)
    assert [r["step"] for r in lineage.rows(trace)] == [1, 2, 3, 4, 7]
    replaced = tmp_path / "new.jsonl"
    replaced.write_text('{"step": 9}\n')
    replaced.replace(trace)
    assert lineage.rows(trace) == [{"step": 9}], "another file under the same name"
    trace.write_text("")
    assert lineage.rows(trace) == [], "cut short"
    trace.unlink()
    assert lineage.rows(trace) == []


def test_the_reader_keeps_only_the_newest_traces(tmp_path: Path) -> None:
    for i in range(lineage.KEPT + 3):
        trace = tmp_path / f"t{i}.jsonl"
        trace.write_text(f'{{"step": {i}}}\n')
        assert lineage.rows(trace) == [{"step": i}]
    assert len(lineage._READ) == lineage.KEPT
    assert tmp_path / f"t{lineage.KEPT + 2}.jsonl" in lineage._READ
