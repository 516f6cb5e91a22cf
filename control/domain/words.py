"""Counts, failures and times in the sentences rove says: "1 node", "2 nodes", "rank 0",
"ranks 0-3", "killed by SIGKILL", "2026-11-23 10:32:00".

The console, `rove status`, `rove goodput` and the events' reasons count nodes, ranks,
rounds and failures, and a job of one node or one worker a node is common (a
standalone job, a GPU a node). Pure.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun, in the singular for exactly one: "1 node", "0 nodes",
    "3 replicas" (`plural`: where adding an s does not make it)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def failure(kind: str, reason: str) -> str:
    """A worker's failure as said: its kind and the reason ("oom: CUDA out of memory"),
    the reason alone where it starts with the kind's word ("killed by SIGKILL", not
    "killed: killed by SIGKILL"), or where the kind's token would tell a person nothing
    the reason does not: "unknown" ("exited with code 3"), and "user_error", whose
    reason is the script's exception or its refused command line ("ValueError: bad
    config", not "user_error: ValueError: bad config")."""
    if kind in ("unknown", "user_error") or reason.startswith(f"{kind} "):
        return reason
    return f"{kind}: {reason}"


def ranks(numbers: Sequence[int]) -> str:
    """Consecutive ranks as a span: "rank 4", "ranks 0-3" (the first and the last);
    "no rank" for none (never an IndexError in a sentence: an agent's round handler
    once died of formatting an empty range)."""
    if not numbers:
        return "no rank"
    if len(numbers) == 1:
        return f"rank {numbers[0]}"
    return f"ranks {numbers[0]}-{numbers[-1]}"


def local_time(ts: float, *, millis: bool = False) -> str:
    """A Unix time as `rove events`, `rove status` and `rove jobs` show it: this
    machine's local time, "2026-11-23 10:32:00" (`millis`: "10:32:00.125"), a form
    `--since` and `--until` read back (`options.moment`)."""
    shown = dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S.%f")
    return shown[:-3] if millis else shown[:-7]


def local_iso(ts: float) -> str:
    """A Unix time as `rove goodput` and its `--svg` picture give a job's span: local
    time with its offset, "2026-11-23T10:32:00+05:30", unambiguous where it is read."""
    return dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")
