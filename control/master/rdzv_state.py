"""The rendezvous part of the job state and how facts fold into it (pure: no clock,
no I/O): who waits to join, the running round and its members, the failure that broke
it, restarts, excluded nodes, the network check's progress, TensorFlow tasks
restarted in place. What the master decides from it is `rove.control.master.rendezvous`.
"""

from __future__ import annotations

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.master import netcheck
from rove.control.master.netcheck import CheckState


class Waiter(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    incarnation: str
    addr: str
    nproc: int
    ports: tuple[int, ...]
    since: float
    tf_role: str = ""
    replica_port: int = 0
    domain: str = ""


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    round: int
    ts: float = 0.0
    node: str
    incarnation: str
    rank: int
    kind: ev.FailureKind
    reason: str
    #: the port of `node` the round gave it that another process held (`worker_exited`)
    port_taken: int = 0

    @property
    def signature(self) -> str:
        return f"{self.kind}:{self.reason}"


class RdzvState(msgspec.Struct, frozen=True, kw_only=True):
    """The rendezvous part of the job state.

    `active`: the current round's workers are supposed to be running. A round
    whose membership changed (a member lost, left, excluded or restarted) is
    *broken*: `active` is false and `broken_since` says since when.
    """

    params: ev.RdzvParams | None = None
    #: node bounds an operator set (`scale_requested`) before the first joiner's params
    bounds: tuple[int, int] | None = None
    round: int = 0
    members: tuple[ev.RoundMember, ...] = ()
    active: bool = False
    waiting: immutables.Map[str, Waiter] = msgspec.field(default_factory=immutables.Map)
    restarts: int = 0
    #: rounds started again because a port rove offered was taken (no restart spent)
    port_rounds: int = 0
    failure: Failure | None = None
    last_failure: Failure | None = None
    #: members whose workers all finished in this round (a set: a map for O(log n) adds)
    succeeded: immutables.Map[str, bool] = msgspec.field(default_factory=immutables.Map)
    #: members that reported a failure of their workers in this round
    failed_nodes: immutables.Map[str, bool] = msgspec.field(default_factory=immutables.Map)
    #: what the round's nodes said as their workers finished (a worker ended stuck)
    notes: tuple[str, ...] = ()
    broken_since: float | None = None
    excluded: immutables.Map[str, str] = msgspec.field(default_factory=immutables.Map)
    master_port: int = 0
    ports: immutables.Map[str, tuple[int, ...]] = msgspec.field(default_factory=immutables.Map)
    check: CheckState = msgspec.field(default_factory=CheckState)
    #: a TensorFlow round's tasks (roles and addresses, by rank)
    tasks: tuple[ev.TfTask, ...] = ()
    #: TensorFlow tasks restarted in place: how many per role (all rounds), the newest
    task_restarts: immutables.Map[str, int] = msgspec.field(default_factory=immutables.Map)
    recent_restarts: tuple[ev.TaskRestarted, ...] = ()

    def member(self, node: str) -> ev.RoundMember | None:
        """`node`'s place in the round (O(1): one fold per fact of a 25,000-node round)."""
        return _index(self.members).get(node)


#: The members tuple and its index by node, of the rounds looked up last.
_indexes: dict[int, tuple[tuple[ev.RoundMember, ...], dict[str, ev.RoundMember]]] = {}


def _index(members: tuple[ev.RoundMember, ...]) -> dict[str, ev.RoundMember]:
    """Node -> member of a round, built once per round (memoised by identity: the
    tuple is kept with its index, so its id cannot be reused while it is cached)."""
    cached = _indexes.get(id(members))
    if cached is not None and cached[0] is members:
        return cached[1]
    if len(_indexes) >= 8:
        _indexes.clear()
    index = {m.node: m for m in members}
    _indexes[id(members)] = (members, index)
    return index


def _break(r: RdzvState, node: str, ts: float) -> RdzvState:
    """`node` left the running round: the round is broken (if it was running)."""
    waiting = r.waiting.delete(node) if node in r.waiting else r.waiting
    if r.member(node) is None or not r.active:
        return replace(r, waiting=waiting)
    return replace(r, waiting=waiting, active=False, broken_since=ts, failure=None)


def on_node_gone(r: RdzvState, event: ev.NodeLeft | ev.NodeLost | ev.NodeGone) -> RdzvState:
    """A node was lost or left."""
    return _break(r, event.node, event.ts)


def on_node_joined(r: RdzvState, event: ev.NodeJoined) -> RdzvState:
    m = r.member(event.node)
    if m is not None and m.incarnation != event.incarnation:
        return _break(r, event.node, event.ts)  # its agent restarted: its workers are gone
    return r


def on_excluded(r: RdzvState, event: ev.NodeExcluded) -> RdzvState:
    r = _break(r, event.node, event.ts)
    return replace(r, excluded=r.excluded.set(event.node, event.reason))


def on_scale_requested(r: RdzvState, e: ev.ScaleRequested) -> RdzvState:
    """New node bounds: rounds formed from now on take `min_nodes` to `max_nodes` (the
    running round goes on; bounds that make no sense are ignored)."""
    if not 1 <= e.min_nodes <= e.max_nodes:
        return r
    if r.params is None:
        return replace(r, bounds=(e.min_nodes, e.max_nodes))
    return replace(r, params=replace(r.params, min_nodes=e.min_nodes, max_nodes=e.max_nodes))


def on_rdzv_joined(r: RdzvState, e: ev.RdzvJoined) -> RdzvState:
    if e.node in r.excluded:
        return r
    if r.params is None:
        params = e.params
        if r.bounds is not None:
            params = replace(params, min_nodes=r.bounds[0], max_nodes=r.bounds[1])
        r = replace(r, params=params)
    m = r.member(e.node)
    if r.active and m is not None and m.incarnation == e.incarnation:
        return r  # already in the running round
    known = r.waiting.get(e.node)
    since = known.since if known is not None and known.incarnation == e.incarnation else e.ts
    waiter = Waiter(
        node=e.node,
        incarnation=e.incarnation,
        addr=e.addr,
        nproc=e.nproc_per_node,
        ports=e.ports,
        since=since,
        tf_role=e.tf_role,
        replica_port=e.replica_port,
        domain=e.domain,
    )
    return replace(r, waiting=r.waiting.set(e.node, waiter), ports=r.ports.set(e.node, e.ports))


def _reports_on_current_round(r: RdzvState, e: ev.WorkerExited | ev.WorkersSucceeded) -> bool:
    """False for a late report from an earlier round, or from a node not in this one."""
    m = r.member(e.node)
    return r.active and e.round == r.round and m is not None and m.incarnation == e.incarnation


def on_worker_exited(r: RdzvState, e: ev.WorkerExited) -> RdzvState:
    if not _reports_on_current_round(r, e):
        return r
    if e.node not in r.failed_nodes:
        r = replace(r, failed_nodes=r.failed_nodes.set(e.node, True))
    if r.failure is not None and not _explains(e, r.failure):
        return r  # the first failure of a round decides, unless a cause follows a symptom
    failure = Failure(
        round=e.round,
        ts=e.ts,
        node=e.node,
        incarnation=e.incarnation,
        rank=e.rank,
        kind=e.kind,
        reason=e.reason,
        port_taken=e.port_taken,
    )
    return replace(r, failure=failure)


def _explains(e: ev.WorkerExited, symptom: Failure) -> bool:
    """Whether `e` names the cause of a round's failure that was only its symptom.

    A broken connection (`communication`) is what a peer's rank sees when another
    rank dies; the dead rank's own report can reach the stream a moment later (its
    agent saw the exit, then wrote). The round is decided on the cause: the restart's
    reason, its metric's label and `rove status` name the rank that was killed. A rank
    that could not listen on the port its round gave it (`port_taken`) is a cause too:
    its peers could not reach it.
    """
    if symptom.kind is not ev.FailureKind.COMMUNICATION or symptom.port_taken:
        return False
    return e.kind is not ev.FailureKind.COMMUNICATION or e.port_taken > 0


def on_workers_succeeded(r: RdzvState, e: ev.WorkersSucceeded) -> RdzvState:
    if not _reports_on_current_round(r, e):
        return r
    notes = (*r.notes, f"on node {e.node}, {e.note}") if e.note else r.notes
    return replace(r, succeeded=r.succeeded.set(e.node, True), notes=notes)


#: Task restarts kept for `rove status` (their count per role is exact).
RECENT_TASK_RESTARTS = 10


def on_task_restarted(r: RdzvState, e: ev.TaskRestarted) -> RdzvState:
    return replace(
        r,
        task_restarts=r.task_restarts.set(e.role, r.task_restarts.get(e.role, 0) + 1),
        recent_restarts=(*r.recent_restarts, e)[-RECENT_TASK_RESTARTS:],
    )


def on_round_completed(r: RdzvState, e: ev.RoundCompleted) -> RdzvState:
    if e.round <= r.round:
        return r
    waiting = r.waiting
    for node in [m.node for m in e.members if m.node in waiting]:
        waiting = waiting.delete(node)
    restarted = e.restart_count > r.restarts
    # (a round started again on fresh ports after one rove offered was taken)
    port_round = r.failure is not None and r.failure.port_taken > 0 and not restarted
    return replace(
        r,
        round=e.round,
        members=e.members,
        active=True,
        waiting=waiting,
        restarts=e.restart_count,
        port_rounds=r.port_rounds + port_round,
        last_failure=r.failure if restarted else r.last_failure if port_round else None,
        failure=None,
        succeeded=immutables.Map(),
        failed_nodes=immutables.Map(),
        notes=(),
        broken_since=None,
        master_port=e.master_port,
        tasks=e.tasks,
    )


def on_check_assigned(r: RdzvState, e: ev.NetworkCheckAssigned) -> RdzvState:
    return replace(r, check=netcheck.on_assigned(r.check, e))


def on_check_reported(r: RdzvState, e: ev.NetworkCheckReported) -> RdzvState:
    return replace(r, check=netcheck.on_reported(r.check, e))


def on_check_completed(r: RdzvState, e: ev.NetworkCheckCompleted) -> RdzvState:
    return replace(r, check=netcheck.on_completed(r.check, e))
