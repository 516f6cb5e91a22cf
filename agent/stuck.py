"""Which workers look stuck, from what they do (pure: the caller samples and gives `now`).

A worker shows life by using CPU, reading or writing anything (its output, files,
sockets) or reporting a step. One that shows none for `timeout_s` is *quiet*: it waits
for something (one whose script returned and whose ending, threads and atexit
handlers, is over only waits to exit: it is never suspected). Quiet is normal in a
collective that waits for a slow peer, so a quiet worker is only looked at more
closely (its stacks: `rove.agent.stacks`) when

* it, or another rank of its round on this node, has returned from its script (the
  others are done: nothing should be left to wait for), or
* it has been quiet that long at all, in which case only a deadlock its stacks prove
  (torch's gloo teardown) will end it.

CPU counts as life above `CPU_IDLE` seconds per second: a thread blocked on the GIL
still wakes every few milliseconds (CPython's switch interval), about 0.7% of a core.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

#: CPU seconds per second below which a process counts as idle.
CPU_IDLE = 0.05
#: CPU seconds of slack on top (clock-tick granularity of /proc).
CPU_SLACK_S = 0.05


class Activity(NamedTuple):
    """What one worker process has done so far."""

    cpu_s: float  # user + system CPU seconds, all threads
    io: int  # bytes read and written (any file, pipe, socket, terminal)
    step: int  # the last step it reported (-1: none)
    returned_at: float  # when its script returned successfully (0: not so far)
    #: when its ending after that was over (0: not so far); from then on it only waits
    #: for its local peers (a warm worker) and exits: never a suspect
    ended_at: float = 0.0
    #: False once the process has exited (then only `returned_at` counts)
    alive: bool = True


class Suspect(NamedTuple):
    local_rank: int
    quiet_s: float
    #: local ranks that have returned from their scripts (this one included, if it has)
    returned: tuple[int, ...]

    @property
    def after_return(self) -> bool:
        """Stuck while it or a peer has returned: not waiting on anything legitimate."""
        return bool(self.returned)


@dataclass
class Quiet:
    """Since when each local rank has shown no life; who was looked at already."""

    timeout_s: float
    _since: dict[int, tuple[Activity, float]] = field(default_factory=dict)
    _examined: dict[int, float] = field(default_factory=dict)

    def observe(self, activity: dict[int, Activity], now: float) -> list[Suspect]:
        """Fold one sample of every worker of the round (exited ones too: `alive`); the
        live ranks to examine now (each at most once per quiet spell of `timeout_s`)."""
        returned = tuple(sorted(lr for lr, a in activity.items() if a.returned_at > 0))
        activity = {lr: a for lr, a in activity.items() if a.alive}
        for local_rank in [lr for lr in self._since if lr not in activity]:
            del self._since[local_rank]  # exited
            self._examined.pop(local_rank, None)
        for local_rank, now_a in activity.items():
            known = self._since.get(local_rank)
            if known is None or _lively(known[0], now_a, now - known[1]):
                self._since[local_rank] = (now_a, now)
                self._examined.pop(local_rank, None)
        due = []
        for local_rank, (_, since) in sorted(self._since.items()):
            if activity[local_rank].ended_at > 0:
                continue
            quiet_s = now - since
            last = self._examined.get(local_rank)
            if quiet_s >= self.timeout_s and (last is None or now - last >= self.timeout_s):
                self._examined[local_rank] = now
                due.append(Suspect(local_rank, quiet_s, returned))
        return due


def _lively(then: Activity, now: Activity, elapsed_s: float) -> bool:
    """Whether a worker showed life between two samples `elapsed_s` apart."""
    return (
        now.step != then.step
        or now.io != then.io
        or now.returned_at != then.returned_at
        or now.cpu_s - then.cpu_s > CPU_IDLE * elapsed_s + CPU_SLACK_S
    )
