"""The lineage of a model from the per-step trace of examples/train_sharded.py.

Every rank appends one JSON line per step (`--trace`): its round, step and the
(epoch, index) of every sample it trained, and one line per round saying which
step it restored. The final model's lineage drops, at each round, the steps
after the one it restored; in it, every sample must appear exactly once.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any


def rows(trace: Path) -> list[dict[str, Any]]:
    out = []
    if trace.exists():
        for line in trace.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by kill -9
    return out


def lineage(trace: Path) -> list[tuple[int, int]]:
    """(epoch, index) of every sample trained in the lineage of the final model."""
    by_round: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for row in rows(trace):
        by_round[row["round"]].append(row)
    steps: dict[int, list[tuple[int, int]]] = {}
    for rnd in sorted(by_round):
        starts = {r["restored"] for r in by_round[rnd] if "restored" in r}
        assert len(starts) == 1, f"round {rnd}: ranks restored different steps {starts}"
        restored = starts.pop()
        steps = {s: v for s, v in steps.items() if s <= restored}
        for r in by_round[rnd]:
            if "step" in r:
                steps.setdefault(r["step"], []).extend(tuple(x) for x in r["samples"])
    return [x for s in sorted(steps) for x in steps[s]]


def progress(trace: Path) -> int:
    """The highest step any rank has trained."""
    return max((r["step"] for r in rows(trace) if "step" in r), default=0)
