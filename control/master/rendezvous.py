"""Rendezvous rounds and the worker-failure policy (pure: no clock, no I/O).

A round is a list of member nodes in rank order; its members start their
workers when they see its `round_completed` decision.

Forming a round (the pool is the alive members of a broken round, in their
old order, then alive waiting nodes by arrival):
  * at `max_nodes` at once; or, once `min_nodes` are there, after the last-call
    wait (`last_call_s`) from the first arrival; a broken round is re-formed at
    once with whoever is still alive;
  * the size is the largest multiple of `node_unit` the pool allows (capped at
    `max_nodes`); nodes left over wait for the next round;
  * while a round runs and nodes are waiting, a bigger round is formed after the
    last-call wait: that is how the job scales up;
  * below `min_nodes` the job waits `below_min_wait_s` for nodes, then fails.

A worker failure in the running round (the first one reported wins) leads to
the decisions below, in this order:
  * a user-code error identical to the one that caused the previous restart:
    the job fails fast, naming the error;
  * a communication failure waits until every member has sent a heartbeat after
    it (a peer's death shows up as one, and is handled as a lost node instead,
    without spending a restart);
  * a hardware fault: the node is excluded (then the round is re-formed);
  * a rank that could not listen on a port its node offered, held by another process
    (`port_taken`): rove's pick failed, not the workers; the round is re-formed with the
    same members on ports offered since, without spending a restart (at most
    `PORT_ROUNDS` times in a run; after that such a failure is counted as any other);
  * `max_restarts` restarts already used: the job fails, naming the last failure;
  * anything else: a restart, i.e. a new round with the same members.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from rove.control.catalogue import events as ev
from rove.control.domain import tf_cluster
from rove.control.domain.words import counted, failure
from rove.control.master import netcheck
from rove.control.master.rdzv_state import Failure, RdzvState, Waiter
from rove.control.master.skew import ON_TIME, ClockOff, ours

# --------------------------------------------------------------------------- decide


class FormRound(msgspec.Struct, frozen=True, kw_only=True):
    """Start round `round` with `members`, in rank order."""

    round: int
    members: tuple[ev.RoundMember, ...]
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int
    reason: str
    cause: ev.RoundCause
    tasks: tuple[ev.TfTask, ...] = ()


class ExcludeNode(msgspec.Struct, frozen=True, kw_only=True):
    """Take `node` out of the job."""

    node: str
    incarnation: str
    reason: str


class EndJob(msgspec.Struct, frozen=True, kw_only=True):
    """The job finished or failed."""

    phase: ev.JobPhase
    reason: str


Intent = FormRound | ExcludeNode | EndJob | netcheck.StartCheck | netcheck.CompleteCheck
#: Nothing to do now; `Wait` says why not yet (`running` when a round runs as it should).
Outcome = Intent | netcheck.Wait

Wait = netcheck.Wait
RUNNING = Wait(reason="")


class Alive:
    """Which (node, incarnation) pairs are alive, from the node table."""

    def __init__(self, live: Mapping[str, str]) -> None:
        self._live = live

    def __call__(self, node: str, incarnation: str) -> bool:
        return self._live.get(node) == incarnation

    def without(self, nodes: frozenset[str]) -> Alive:
        """The same, less `nodes`."""
        return Alive({n: i for n, i in self._live.items() if n not in nodes})


def decide(
    r: RdzvState,
    alive: Alive,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    leaving: frozenset[str] = frozenset(),
    settle: bool = False,
    clock_off: ClockOff = ON_TIME,
) -> Outcome:
    """The one rendezvous action due now, or why there is none (`Wait`).

    `leaving`: nodes a scale plan is stopping or relaunching. A failure on one
    of them waits for the plan (no restart is spent), and no new round takes them.
    `settle`: the new round restores from what the members hold in memory: a restart
    waits (at most `SETTLE_S`) until every member has reported its workers' end, so
    that what each said it holds is its last word (a healthy node's newest report
    could lag its memory by several steps, and the step chosen be one it had already
    overwritten: every rank then failed to restore, and the job started over).
    `clock_off`: the nodes whose clocks are off the leader's, by how much; the times they
    stamped (when they asked to join, when their workers failed) are read on its clock.

    The caller turns an intent into a decision event with its envelope
    (`decide.py`); a `Wait` is logged when its reason changes and shown by
    `rove status`.
    """
    p = r.params
    if p is None:
        return Wait(reason="no node has asked to join a round yet")
    finished = _finished(r)
    if finished is not None:
        return EndJob(phase=ev.JobPhase.FINISHED, reason=finished)
    if leaving:
        alive = alive.without(leaving)
    if r.active and r.failure is not None:
        if r.failure.node in leaving:
            return Wait(
                reason=f"{_failure_text(r.failure)}; a scale plan relaunches node "
                f"{r.failure.node}: the round re-forms once it has left"
            )
        return _on_failure(r, p, alive, liveness, now, settle, clock_off)
    if r.active:
        return _scale_up(r, p, alive, liveness, now, clock_off)
    return _form(r, p, alive, liveness, now, clock_off)


def _finished(r: RdzvState) -> str | None:
    """Why the job is finished, or None: every member's workers finished, or in a
    TensorFlow round the chief's (its parameter servers and workers serve until then)."""
    if not (r.active and r.members):
        return None
    head = tf_cluster.chief(r.tasks)
    if head is not None:
        if head.node in r.succeeded:
            return f"the TensorFlow coordinator (chief, on node {head.node}) finished"
        return None
    if len(r.succeeded) >= len(r.members):  # only the round's members are counted
        done = (
            "the node finished its workers"
            if len(r.members) == 1
            else f"all {len(r.members)} nodes finished their workers"
        )
        return done + "".join(f"; {note}" for note in r.notes)
    return None


def _failure_text(f: Failure) -> str:
    return f"rank {f.rank} on node {f.node}: {failure(f.kind.value, f.reason)}"


def _on_failure(
    r: RdzvState,
    p: ev.RdzvParams,
    alive: Alive,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    settle: bool,
    clock_off: ClockOff,
) -> Outcome:
    f = r.failure
    assert f is not None
    at = ours(clock_off, f.node, f.ts)  # when it failed, on the leader's clock
    last = r.last_failure
    if f.kind is ev.FailureKind.USER_ERROR and last is not None and last.signature == f.signature:
        return EndJob(
            phase=ev.JobPhase.FAILED,
            reason=f"the same user code error repeated after a restart: {_failure_text(f)}",
        )
    if f.kind is ev.FailureKind.COMMUNICATION:
        unheard = _unheard_since(r, at, liveness, clock_off)
        if unheard:
            # A broken connection is often the symptom of a peer that died: wait until
            # every member has proven alive after it (then restart), or a member is
            # declared lost (then the round is re-formed without spending a restart).
            return Wait(
                reason=f"a communication failure in round {r.round} ({_failure_text(f)}): "
                f"waiting for a heartbeat since from {', '.join(unheard)}, or for them to be "
                "lost, before deciding"
            )
    if f.kind is ev.FailureKind.HARDWARE:
        return ExcludeNode(
            node=f.node, incarnation=f.incarnation, reason=f"hardware fault: {f.reason}"
        )
    port_round = f.port_taken > 0 and r.port_rounds < PORT_ROUNDS
    if r.restarts >= p.max_restarts and not port_round:
        return EndJob(
            phase=ev.JobPhase.FAILED,
            reason=(
                "worker failed and restarts are off (--max-restarts 0)"
                if p.max_restarts == 0
                else "worker failed and its one restart (--max-restarts 1) is used"
                if p.max_restarts == 1
                else f"worker failed and all {p.max_restarts} restarts (--max-restarts) are used"
            )
            + f"; last failure: {_failure_text(f)}",
        )
    members = [m for m in r.members if alive(m.node, m.incarnation)]
    unheard = sorted(
        m.node for m in members if m.node not in r.failed_nodes and m.node not in r.succeeded
    )
    if settle and len(members) > 1 and unheard and now - at < SETTLE_S:
        return Wait(
            reason=f"{_failure_text(f)}: waiting for {', '.join(unheard)} to report its "
            "workers' end (what it holds in memory) before restarting",
            until=at + SETTLE_S,
        )
    pool = [_as_waiter(m, r, liveness) for m in members]
    if port_round:
        return _round(
            r,
            pool,
            liveness,
            cause=ev.RoundCause.REFORMED,
            reason=f"rank {f.rank} could not listen: port {f.port_taken} of node {f.node} "
            "was taken by another process; starting again on fresh ports, no restart spent",
        )
    return _round(
        r,
        pool,
        liveness,
        cause=ev.RoundCause.RESTART,
        reason=f"restart {r.restarts + 1}/{p.max_restarts} after {_failure_text(f)}",
    )


#: How long a restart that restores from memory waits for every member's last word.
SETTLE_S = 5.0
#: Rounds of a run started again, without spending a restart, because a port a node
#: offered was taken before its round could listen there (each pick is random among
#: thousands: more than this in a run is no bad luck, and spends restarts as usual).
PORT_ROUNDS = 3


def _unheard_since(
    r: RdzvState, ts: float, liveness: Mapping[str, ev.Heartbeat], clock_off: ClockOff
) -> list[str]:
    """Members with no heartbeat after `ts` (the leader's clock) from their current
    incarnation."""
    unheard = []
    for m in r.members:
        hb = liveness.get(m.node)
        if hb is None or hb.incarnation != m.incarnation or ours(clock_off, m.node, hb.ts) <= ts:
            unheard.append(m.node)
    return unheard


def _as_waiter(m: ev.RoundMember, r: RdzvState, liveness: Mapping[str, ev.Heartbeat]) -> Waiter:
    ports = r.ports.get(m.node, ())
    return Waiter(
        node=m.node,
        incarnation=m.incarnation,
        addr=m.addr,
        nproc=m.nproc,
        ports=ports,
        since=0.0,
        replica_port=m.replica_port,
        domain=m.domain,
    )


def _waiting_alive(r: RdzvState, alive: Alive, clock_off: ClockOff) -> list[Waiter]:
    """The waiting nodes that are alive, by when they asked to join (the leader's clock)."""
    ws = [
        w for w in r.waiting.values() if alive(w.node, w.incarnation) and w.node not in r.excluded
    ]
    if clock_off:
        ws = [
            msgspec.structs.replace(w, since=ours(clock_off, w.node, w.since))
            if w.node in clock_off
            else w
            for w in ws
        ]
    return sorted(ws, key=lambda w: (w.since, w.node))


def _size(n: int, p: ev.RdzvParams) -> int:
    size = min(n, p.max_nodes)
    return size - size % max(1, p.node_unit)


def _scale_up(
    r: RdzvState,
    p: ev.RdzvParams,
    alive: Alive,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    clock_off: ClockOff,
) -> Outcome:
    members = {m.node for m in r.members}
    newcomers = [w for w in _waiting_alive(r, alive, clock_off) if w.node not in members]
    if not newcomers:
        return RUNNING
    names = ", ".join(w.node for w in newcomers)
    if len(r.members) >= p.max_nodes:
        return Wait(reason=f"{names} wait: the round already has the most nodes, {p.max_nodes}")
    size = _size(len(r.members) + len(newcomers), p)
    if size <= len(r.members):
        return Wait(
            reason=f"{names} wait: rounds take multiples of {p.node_unit} nodes "
            f"(--node-unit); {len(r.members) + len(newcomers)} would not be one"
        )
    if now - newcomers[0].since < p.last_call_s:
        return Wait(
            reason=f"{names} will join round {r.round + 1} (scale up) after the last call",
            until=newcomers[0].since + p.last_call_s,
        )
    pool = [_as_waiter(m, r, liveness) for m in r.members] + newcomers
    return _round(
        r,
        pool[:size],
        liveness,
        cause=ev.RoundCause.SCALE_UP,
        reason=f"scale up from {len(r.members)} to {size} nodes",
    )


def _form(
    r: RdzvState,
    p: ev.RdzvParams,
    alive: Alive,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    clock_off: ClockOff,
) -> Outcome:
    old = [
        _as_waiter(m, r, liveness)
        for m in r.members
        if alive(m.node, m.incarnation) and m.node not in r.excluded
    ]
    old_nodes = {w.node for w in old}
    pool = old + [w for w in _waiting_alive(r, alive, clock_off) if w.node not in old_nodes]
    size = _size(len(pool), p)
    broken = r.broken_since is not None
    first = _last_call_from(old_nodes, pool, p, now)
    ready = (
        size >= p.min_nodes
        and size > 0
        and (len(pool) >= p.max_nodes or broken or now - first >= p.last_call_s)
    )
    if p.network_check and r.round == 0:
        checked = _network_check(r, p, pool, liveness, now, ready)
        if checked is not None:
            return checked
    if ready:
        if broken:
            why = f"re-formed with {counted(size, 'node')} after a membership change"
            cause = ev.RoundCause.REFORMED
        else:
            wanted = p.min_nodes if p.min_nodes == p.max_nodes else f"{p.min_nodes}-{p.max_nodes}"
            why = f"{size} of {wanted} node{'s' if p.max_nodes != 1 else ''} joined"
            cause = ev.RoundCause.FORMED
        return _round(r, pool[:size], liveness, cause=cause, reason=why)
    here = f"{counted(len(pool), 'node')} here"
    if broken and r.broken_since is not None:
        if now - r.broken_since > p.below_min_wait_s:
            return EndJob(
                phase=ev.JobPhase.FAILED,
                reason=f"only {counted(len(pool), 'node')} alive, fewer than the minimum "
                f"{p.min_nodes}, for {p.below_min_wait_s:g}s",
            )
        return Wait(
            reason=f"round {r.round} lost members: {here}, fewer than the minimum "
            f"{p.min_nodes}; the job fails unless nodes join (--below-min-timeout)",
            until=r.broken_since + p.below_min_wait_s,
        )
    if size < p.min_nodes or size == 0:
        unit = f" in multiples of {p.node_unit} (--node-unit)" if p.node_unit > 1 else ""
        return Wait(reason=f"waiting for nodes: {here}, {p.min_nodes} needed{unit} (--nnodes)")
    return Wait(
        reason=f"{here} of at most {p.max_nodes}: last call for more nodes",
        until=first + p.last_call_s,
    )


def _last_call_from(old_nodes: set[str], pool: list[Waiter], p: ev.RdzvParams, now: float) -> float:
    """When the last call for more nodes began: when the pool reached its minimum (the
    arrival of the newcomer that made it, the round's old members counted first), as
    torch's `last_call_timeout` counts; the first newcomer's arrival where the old
    members were already enough."""
    arrivals = sorted(w.since for w in pool if w.node not in old_nodes)
    if not arrivals:
        return now
    need = next((n for n in range(1, len(pool) + 1) if _size(n, p) >= p.min_nodes), None)
    if need is None:  # (not there yet: a wait for nodes, not a last call)
        return arrivals[0]
    k = need - len(old_nodes)
    return arrivals[min(max(k, 1), len(arrivals)) - 1]


def _network_check(
    r: RdzvState,
    p: ev.RdzvParams,
    pool: list[Waiter],
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    ready: bool,
) -> Outcome | None:
    """The check's next step before the first round; None once it is done."""
    c = r.check
    if not c.done:
        if c.check_round >= 0:
            checked = set(c.nodes())
            pool = [w for w in pool if w.node in checked]
        members = [(w.node, w.incarnation, w.addr, _port(w, liveness, 0)) for w in pool]
        return netcheck.next_action(c, members, now, ready, timeout_s=p.network_check_timeout_s)
    node = netcheck.to_exclude(c, p.exclude_stragglers, lambda n: n in r.excluded)
    if node is None:
        return None
    incarnation = next((w.incarnation for w in pool if w.node == node), "")
    if not incarnation and node in r.waiting:
        incarnation = r.waiting[node].incarnation
    why = (
        "failed both network-check rounds"
        if node in c.faulty
        else (f"straggler: network check more than {netcheck.STRAGGLER_FACTOR:g}x the median")
    )
    return ExcludeNode(node=node, incarnation=incarnation, reason=why)


def _port(w: Waiter, liveness: Mapping[str, ev.Heartbeat], previous: int) -> int:
    hb = liveness.get(w.node)
    ports = hb.ports if hb is not None and hb.incarnation == w.incarnation and hb.ports else w.ports
    for port in ports:
        if port != previous:
            return port
    return ports[0] if ports else 29500


def _fresh_ports(w: Waiter, liveness: Mapping[str, ev.Heartbeat]) -> tuple[int, ...]:
    """The ports `w` offered last: its heartbeat's (found free most recently), else its
    join's."""
    hb = liveness.get(w.node)
    if hb is not None and hb.incarnation == w.incarnation and len(hb.ports) >= w.nproc:
        return hb.ports
    return w.ports


def _round(
    r: RdzvState,
    pool: list[Waiter],
    liveness: Mapping[str, ev.Heartbeat],
    *,
    cause: ev.RoundCause,
    reason: str,
) -> Outcome:
    if not pool:
        return Wait(reason=f"no member of round {r.round} is alive to restart it")
    members = []
    rank = 0
    for w in pool:
        members.append(
            ev.RoundMember(
                node=w.node,
                incarnation=w.incarnation,
                addr=w.addr,
                nproc=w.nproc,
                first_rank=rank,
                replica_port=w.replica_port,
                domain=w.domain,
            )
        )
        rank += w.nproc
    tasks: tuple[ev.TfTask, ...] = ()
    if r.params is not None and r.params.tf_ps:
        assigned = tf_cluster.assign(
            members,
            {w.node: _fresh_ports(w, liveness) for w in pool},
            r.params.tf_ps,
            ps_nodes=frozenset(w.node for w in pool if w.tf_role == "ps"),
        )
        if isinstance(assigned, str):
            return Wait(reason=assigned)
        tasks = assigned
    return FormRound(
        tasks=tasks,
        round=r.round + 1,
        members=tuple(members),
        world_size=rank,
        master_addr=pool[0].addr,
        master_port=_port(pool[0], liveness, r.master_port),
        restart_count=r.restarts + 1 if cause is ev.RoundCause.RESTART else r.restarts,
        reason=reason,
        cause=cause,
    )
