"""Nodes whose clocks are off the leader's, and the times they stamp read on the
leader's clock (pure).

The replica measures a node's offset from each of its live heartbeats: the arrival, by
the leader's clock, minus the stamp, by the node's (the arrival's delay included:
milliseconds). A node off by `SKEW_SAID_S` or more is said in the master's log, and the
leader's decisions read the times it stamped (a rendezvous' last call, a failure's time,
its data leases' deadlines) shifted by its offset: a node three minutes ahead made a
`--nnodes 1:2` round wait three minutes more for its last call, and one eleven minutes
behind had its data leases expire as they were granted. Smaller offsets are left alone:
they are as likely a heartbeat's delay on a busy leader as a clock's error.

The fold keeps the stamps as they are (a replay is the same whoever leads); only the
decisions, which are events of their own, depend on what the leader measured.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

#: How far off a node's clock is said and corrected for, at the least.
SKEW_SAID_S = 5.0

#: node → seconds to add to a time it stamped to read it on the leader's clock
ClockOff = Mapping[str, float]

#: Every node's clock agrees with the leader's (within `SKEW_SAID_S`).
ON_TIME: ClockOff = MappingProxyType({})


def ours(off: ClockOff, node: str, ts: float) -> float:
    """`ts`, stamped by `node`, on the leader's clock."""
    return ts + off.get(node, 0.0) if off else ts
