"""The lineage of a model from the per-step trace of examples/train_sharded.py.

Every rank appends one JSON line per step (`--trace`): its round, step and the
(epoch, index) of every sample it trained, and one line per round saying which
step it restored. The final model's lineage drops, at each round, the steps
after the one it restored; in it, every sample must appear exactly once.
"""

from __future__ import annotations

import collections
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class _Read:
    """What was parsed of one trace: its file's identity, the bytes read up to the last
    whole line, and their rows."""

    ident: tuple[int, int]
    offset: int = 0
    rows: list[dict[str, Any]] = field(default_factory=list)


#: Traces read so far. Tests poll them many times a second while ranks append to them:
#: reading only what was appended keeps a poll's cost flat instead of growing with the
#: job (on a busy 2-core machine the whole file, parsed 20 times a second, cost the
#: test process seconds of CPU its job's processes needed).
_READ: collections.OrderedDict[Path, _Read] = collections.OrderedDict()
#: How many traces `_READ` keeps (the running test's; older ones are dropped).
KEPT = 8


def _parse(lines: list[bytes], out: list[dict[str, Any]]) -> None:
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by kill -9


def rows(trace: Path) -> list[dict[str, Any]]:
    """Every whole row of `trace` so far (a line cut by kill -9 is skipped), in order."""
    try:
        with trace.open("rb") as f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino)
            read = _READ.get(trace)
            if read is None or read.ident != ident or st.st_size < read.offset:
                read = _READ[trace] = _Read(ident)  # new, replaced or cut short
            _READ.move_to_end(trace)
            while len(_READ) > KEPT:
                _READ.popitem(last=False)
            f.seek(read.offset)
            new = f.read()
    except FileNotFoundError:
        _READ.pop(trace, None)
        return []
    whole = new.rfind(b"\n") + 1
    _parse(new[:whole].split(b"\n"), read.rows)
    read.offset += whole
    out = list(read.rows)
    _parse([new[whole:]], out)  # a last line not ended yet, as a whole read would see it
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
