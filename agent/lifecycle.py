"""The lifecycle of an agent (pure).

    STARTING --register--> WAITING        joined the job, waiting for a round that includes it
    WAITING  --round-----> RUNNING        a round with this node started its workers
    RUNNING  --round-----> RUNNING        a newer round replaced them (restart, scale up/down)
    RUNNING  --done------> FINISHED       its workers all exited 0 (the job may not be over)
    RUNNING | FINISHED --left out--> WAITING   a round without this node, or the master lost it
    FINISHED --round-----> RUNNING        a newer round (a node failed after this one finished)
    any      --end-------> STOPPING       the job ended, the node was excluded, or a signal
    STOPPING --stopped---> STOPPED        workers stopped, last facts sent

A transition not listed is a bug in the agent, and `advance` says so.
"""

from __future__ import annotations

import enum


class AgentPhase(enum.Enum):
    STARTING = "starting"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    STOPPING = "stopping"
    STOPPED = "stopped"


_ALLOWED: dict[AgentPhase, frozenset[AgentPhase]] = {
    AgentPhase.STARTING: frozenset({AgentPhase.WAITING, AgentPhase.STOPPING}),
    AgentPhase.WAITING: frozenset({AgentPhase.WAITING, AgentPhase.RUNNING, AgentPhase.STOPPING}),
    AgentPhase.RUNNING: frozenset(
        {AgentPhase.RUNNING, AgentPhase.FINISHED, AgentPhase.WAITING, AgentPhase.STOPPING}
    ),
    AgentPhase.FINISHED: frozenset({AgentPhase.RUNNING, AgentPhase.WAITING, AgentPhase.STOPPING}),
    AgentPhase.STOPPING: frozenset({AgentPhase.STOPPING, AgentPhase.STOPPED}),
    AgentPhase.STOPPED: frozenset(),
}


def advance(current: AgentPhase, new: AgentPhase) -> AgentPhase:
    """`new`, if the lifecycle allows going there from `current`.

    Raises:
        AssertionError: the transition is not in the lifecycle (a bug).
    """
    if new not in _ALLOWED[current]:
        raise AssertionError(f"agent lifecycle: {current.value} -> {new.value} is not allowed")
    return new
