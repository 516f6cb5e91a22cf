"""The network-check part of the event catalogue: the groups the master assigns, each
node's result (a fact), and the verdict (docs/runtime.md, "Network check").

`rove.control.catalogue.events` re-exports everything here; import from there.
"""

from __future__ import annotations

import msgspec

from rove.control.catalogue.event_base import Decision, NodeFact


class CheckGroup(msgspec.Struct, frozen=True, kw_only=True):
    """Nodes that run the network check together; the first one hosts the store."""

    nodes: tuple[str, ...]
    incarnations: tuple[str, ...]
    master_addr: str
    master_port: int


class NodeCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One node's network-check result over the check rounds."""

    node: str
    failures: int
    best_s: float | None


class NetworkCheckReported(NodeFact, tag="network_check_reported", frozen=True, kw_only=True):
    """`node`'s result in network-check round `check_round`."""

    check_round: int
    ok: bool
    elapsed_s: float
    matmul_s: float = 0.0
    allreduce_s: float = 0.0
    error: str = ""


class NetworkCheckAssigned(Decision, tag="network_check_assigned", frozen=True, kw_only=True):
    """Check round `check_round` (0, then 1): each group times a matmul and an allreduce."""

    check_round: int
    groups: tuple[CheckGroup, ...]
    timeout_s: float
    #: on the wire only: the groups travelled in this many `event_part`s before it
    parts: int = 0


class NetworkCheckCompleted(Decision, tag="network_check_completed", frozen=True, kw_only=True):
    """Verdict of the network check: faulty nodes failed both rounds; stragglers are
    slower than twice the median."""

    results: tuple[NodeCheck, ...]
    faulty: tuple[str, ...]
    stragglers: tuple[str, ...]
