"""The nemesis's figures: every fault's rows appended to a results file, and the table
of fault x runs x survived with nothing lost x time to recover that docs/operations.md
publishes (`python -m tests.nemesis --report`)."""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.support import ROOT

#: Where runs append their rows (one JSON object per line).
DEFAULT_RESULTS = ROOT / ".nemesis" / "results.jsonl"
#: The rows of the table docs/operations.md publishes ("What rove survives, measured").
PUBLISHED = Path(__file__).parent / "published.jsonl"


def results_path() -> Path:
    return Path(os.environ.get("ROVE_NEMESIS_RESULTS") or DEFAULT_RESULTS)


def record(rows: Iterable[Any], path: Path | None = None) -> None:
    path = path or results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row.to_json()) + "\n")


def load(path: Path | None = None) -> list[dict[str, Any]]:
    path = path or results_path()
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a killed run
    return out


#: The table's order: the bus, the processes, the disk, hostile clients.
ORDER = [
    "nats-kill",
    "nats-quorum",
    "nats-partition",
    "nats-outage",
    "nats-rolling",
    "nats-restart-all",
    "node-partition",
    "master-pause",
    "disk-full",
    "checkpoint-corrupt",
    "poison",
    "flood",
]


def table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table, one line per fault."""
    lines = [
        "| fault | runs | survived, nothing lost | back to full speed (median, max) "
        "| not survived |",
        "| --- | --- | --- | --- | --- |",
    ]
    by_fault: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_fault.setdefault(r["fault"], []).append(r)
    for fault in sorted(by_fault, key=lambda f: (ORDER.index(f) if f in ORDER else 99, f)):
        runs = by_fault[fault]
        ok = [r for r in runs if r["survived"]]
        times = [r["recover_s"] for r in ok if r["recover_s"] is not None]
        timing = f"{statistics.median(times):.1f} s, {max(times):.1f} s" if times else "-"
        failed = sorted({p for r in runs if not r["survived"] for p in r["problems"][:1]})
        lines.append(
            f"| {fault} | {len(runs)} | {len(ok)} | {timing} | {'; '.join(failed)[:200]} |"
        )
    return "\n".join(lines)
