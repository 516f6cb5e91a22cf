"""A node that waits for its round says so on the console, now and then.

`rove run --nnodes 2` on the first machine said where to watch the job and then
nothing, for as long as the second node took to come (or for ever, where no
`rove master` ran): a person could not tell a wait from a hang. Now, once it has
waited `FIRST_S`, and every `EVERY_S` after, the node says for how long, what the
round needs, and where to see what it waits for (`rove status` names it: nodes, a
master, a last call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rove.agent.lifecycle import AgentPhase
from rove.control.catalogue import events as ev
from rove.control.domain.words import counted

#: Seconds a node waits before it first says so, and between two sayings.
FIRST_S = 10.0
EVERY_S = 60.0


def waiting_line(waited_s: float, params: ev.RdzvParams, status: str) -> str:
    """What a node waiting `waited_s` for its round says (pure); `status`: the command
    that says what the round waits for."""
    lo, hi = params.min_nodes, params.max_nodes
    joined = f"{counted(lo, 'node')} {'has' if lo == 1 else 'have'} joined"
    needs = (
        f"once {joined} (--nnodes {lo})"
        if lo == hi
        else f"once at least {joined} (--nnodes {lo}:{hi})"
    )
    return (
        f"waiting {waited_s:.0f}s for a round with this node: it starts {needs} and a "
        f"master leads the job; `{status}` says what it waits for"
    )


class RoundWait:
    """Told the agent's phase every duty tick (`tick`); says the wait on the console
    (`log`'s `say`). `status`: the command that names what the round waits for."""

    def __init__(
        self, log: Any, params: ev.RdzvParams, status: str, clock: Callable[[], float]
    ) -> None:
        self.log = log
        self.params = params
        self.status = status
        self.clock = clock
        self._since: float | None = None
        self._next = 0.0

    def tick(self, phase: AgentPhase) -> None:
        now = self.clock()
        if phase is not AgentPhase.WAITING:
            self._since = None
        elif self._since is None:
            self._since, self._next = now, now + FIRST_S
        elif now >= self._next:
            self._next = now + EVERY_S
            self.log.info(waiting_line(now - self._since, self.params, self.status), say=True)
