"""Faults injected on purpose: `rove run --inject-fault kill:1@300` sends SIGKILL to
rank 1 when it reports step 300 (pure; the agent sends the signal).

A plan is data, as torchft's `EventInjector().fail_at(rank, step)`: the demo shows a
failure healed without a second terminal, and tests and benchmarks fail a worker at a
step instead of racing it. Each fault fires once per `rove run`, on the node whose
workers run that global rank, the first time the rank's reported step
(`rove.agent.progress.report`) reaches the step; a restarted round that trains the
same step again does not fire it again.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

#: The signals a fault may send, by the names the option takes.
SIGNALS = {
    "kill": signal.SIGKILL,
    "term": signal.SIGTERM,
    "int": signal.SIGINT,
    "segv": signal.SIGSEGV,
    "abrt": signal.SIGABRT,
}
_FORM = re.compile(r"^(?:(?P<sig>[a-z]+):)?(?P<rank>\d+)@(?P<step>\d+)$")


class Fault(NamedTuple):
    rank: int
    step: int
    signal: signal.Signals

    def __str__(self) -> str:
        return f"{self.signal.name} to rank {self.rank} at step {self.step}"


def parse(text: str) -> Fault:
    """`[SIGNAL:]RANK@STEP` (SIGNAL one of kill, term, int, segv, abrt; default kill).

    Raises:
        ValueError: the text is not of that form (the message says what is).
    """
    found = _FORM.match(text.strip().lower())
    if found is None:
        raise ValueError(f"{text!r}: use [SIGNAL:]RANK@STEP, e.g. kill:1@300")
    name = found["sig"] or "kill"
    if name not in SIGNALS:
        raise ValueError(f"{text!r}: the signal is one of {', '.join(SIGNALS)}, not {name!r}")
    return Fault(rank=int(found["rank"]), step=int(found["step"]), signal=SIGNALS[name])


class FaultPlan:
    """The faults still to fire."""

    def __init__(self, faults: Iterable[Fault] = ()) -> None:
        self.pending = list(faults)

    def due(self, steps: Mapping[int, int]) -> list[Fault]:
        """The faults whose rank (a global rank run here, with its newest reported
        step in `steps`) reached their step; they are taken out of the plan."""
        fire = [f for f in self.pending if f.rank in steps and steps[f.rank] >= f.step]
        self.pending = [f for f in self.pending if f not in fire]
        return fire

    def fire(
        self, first_rank: int, pids: Mapping[int, int], steps: Mapping[int, int], log: Any
    ) -> None:
        """Signal the workers (`pids`, by local rank; `steps`: their newest step, by local
        rank) whose global rank reached a planned step; this node's ranks start at
        `first_rank`."""
        for fault in self.due({first_rank + lr: step for lr, step in steps.items()}):
            pid = pids.get(fault.rank - first_rank)
            if pid is None:
                continue
            log.warning(f"injecting a fault (--inject-fault): {fault}", rank=fault.rank, pid=pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, fault.signal)
