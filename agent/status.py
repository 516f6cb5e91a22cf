"""What an agent knows of itself: its phase, its round, how its workers last ended."""

from __future__ import annotations

from dataclasses import dataclass, field

from rove.agent.lifecycle import AgentPhase
from rove.agent.runtime import RootFailure


@dataclass
class AgentStatus:
    """What the agent knows, for logs and tests."""

    phase: AgentPhase = AgentPhase.STARTING
    round: int = 0
    max_epoch: int = 0
    starts: int = 0
    end_reason: str = ""
    history: list[AgentPhase] = field(default_factory=list)
    #: the last failure of this node's workers (its global rank, and what happened)
    failure: tuple[int, RootFailure] | None = None
