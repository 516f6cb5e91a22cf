"""What the agent's actor reads, one at a time, besides what its parts hand it
(`WorkersEnded`, a `Verdict`, a `CheckResult`): the job's decisions, a worker gone
quiet (`Hang`), a signal (`Signal`).

A decision recorded before this node joined is the job's history (`Past`): an
earlier run's start and end, read by stream sequence (`History`), never by its
timestamp, which a node's clock may be minutes off.
"""

from __future__ import annotations

from dataclasses import dataclass

from rove.control.bus import records


@dataclass(frozen=True)
class Hang:
    round: int
    local_rank: int
    step: int
    silent_s: float


@dataclass(frozen=True)
class Signal:
    signum: int


@dataclass(frozen=True)
class Past:
    """A decision recorded before this node joined: history, not news to act on."""

    rec: records.Recorded


class History:
    """Tells the decisions recorded before this node joined from those after.

    `mark` is the newest decision's sequence when the node joined (read from any
    replica: one that lags gives an older mark, which only counts less as history,
    never a decision made after the join). Decisions come in order; the first past the
    mark ends the history for good (a stream numbered anew later is all news).
    """

    def __init__(self) -> None:
        self.mark = 0

    def sort(self, rec: records.Recorded) -> records.Recorded | Past:
        if rec.seq <= self.mark:
            return Past(rec)
        self.mark = 0
        return rec
