"""The scaling part of the job state: the managed job's slots, plans and their outcomes.

Pure folds, like the rest of the master's domain. A managed job (one whose
workload was submitted) has numbered *slots*, each run by one node at a time:
attempt 0 is named `n<slot>-a0`, its relaunch `n<slot>-a1`, and so on. A
slot's record follows its current attempt:

    LAUNCHING (a plan started it) -> JOINED (its agent joined)
        -> GONE (lost, left unasked, excluded)      : a plan may relaunch the slot
        -> REMOVING (a plan stops it) -> REMOVED    : the slot is retired
    LAUNCHING -> FAILED (the plan that started it failed)

Events about an older attempt of a slot (a relaunched node's last words) are
ignored. The optimiser (`rove.control.master.optimizer`) reads this state.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev

#: Plans kept for `rove status` (the count is unbounded).
RECENT_PLANS = 20


class SlotPhase(enum.StrEnum):
    LAUNCHING = "launching"
    JOINED = "joined"
    GONE = "gone"
    FAILED = "failed"
    REMOVING = "removing"
    REMOVED = "removed"

    @property
    def live(self) -> bool:
        """Counts towards the job's size (started or starting, not being stopped)."""
        return self in (SlotPhase.LAUNCHING, SlotPhase.JOINED)


class Slot(msgspec.Struct, frozen=True, kw_only=True):
    """The current attempt of one slot."""

    slot: int
    attempt: int
    node: str
    resources: ev.Resources
    phase: SlotPhase
    since: float
    plan: int
    incarnation: str = ""
    #: the event that ended this attempt (GONE / FAILED), and why
    cause: str = ""
    reason: str = ""
    #: an OOM of this attempt's workers: the `worker_exited` id and its reason
    oom: str = ""
    oom_reason: str = ""
    #: the backend said it cannot place this attempt (`node_pending`), and why
    unplaceable: str = ""
    #: "ps": a node of a TensorFlow job's parameter servers (kept by every attempt)
    role: str = ""
    #: this attempt's `rove run` refused to start (exit code 2), and why: the next would too
    refused: str = ""


class PlanStatus(enum.StrEnum):
    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"


class PlanRecord(msgspec.Struct, frozen=True, kw_only=True):
    plan: int
    rule: ev.ScaleRule
    reason: str
    ts: float
    launch: tuple[str, ...]
    remove: tuple[str, ...]
    status: PlanStatus = PlanStatus.PENDING
    error: str = ""
    done_ts: float = 0.0


class Growth(msgspec.Struct, frozen=True, kw_only=True):
    """The last grow plan: the job's speed at `size` nodes before it added one."""

    plan: int
    size: int
    speed: float


class ScaleState(msgspec.Struct, frozen=True, kw_only=True):
    workload: ev.Workload | None = None
    target: int = 0
    slots: immutables.Map[int, Slot] = msgspec.field(default_factory=immutables.Map)
    by_node: immutables.Map[str, int] = msgspec.field(default_factory=immutables.Map)
    plans: int = 0
    pending: int = 0
    #: the plan the scaler is applying (a restarted scaler applies it again)
    pending_plan: ev.ScalePlan | None = None
    last_plan_ts: float = 0.0
    failed_in_row: int = 0
    last_error: str = ""
    causes: frozenset[str] = frozenset()
    #: nodes a plan stops that have not left yet (the rendezvous keeps them out of rounds)
    removing: frozenset[str] = frozenset()
    recent: tuple[PlanRecord, ...] = ()
    growth: Growth | None = None
    #: growing to this many nodes did not pay: never grow to it again (0: no ceiling)
    ceiling: int = 0
    #: when the current round started, and with how many nodes
    round_since: float = 0.0
    round_size: int = 0
    #: the id of the newest `scale_requested` (the cause of the plans it leads to)
    resize: str = ""

    def current(self, node: str) -> Slot | None:
        """The slot `node` runs, if `node` is its current attempt."""
        index = self.by_node.get(node)
        slot = self.slots.get(index) if index is not None else None
        return slot if slot is not None and slot.node == node else None

    def live(self) -> list[Slot]:
        return sorted((s for s in self.slots.values() if s.phase.live), key=lambda s: s.slot)


# --------------------------------------------------------------------------- folds


def _set(s: ScaleState, slot: Slot) -> ScaleState:
    return replace(s, slots=s.slots.set(slot.slot, slot))


def _record(s: ScaleState, plan: int, **changes: object) -> tuple[PlanRecord, ...]:
    return tuple(replace(r, **changes) if r.plan == plan else r for r in s.recent)


def on_submitted(s: ScaleState, e: ev.JobSubmitted) -> ScaleState:
    if s.workload is not None:
        return s  # the first submission counts
    return replace(s, workload=e.workload, target=e.workload.min_nodes)


def on_scale_requested(s: ScaleState, e: ev.ScaleRequested) -> ScaleState:
    """New node bounds for a managed job: its workload's, and a target within them (the
    optimiser starts nodes up to the minimum and removes them down to the maximum)."""
    if s.workload is None or not 1 <= e.min_nodes <= e.max_nodes:
        return s
    w = replace(s.workload, min_nodes=e.min_nodes, max_nodes=e.max_nodes)
    return replace(s, workload=w, target=min(max(s.target, e.min_nodes), e.max_nodes), resize=e.id)


def on_plan(s: ScaleState, e: ev.ScalePlan) -> ScaleState:
    if s.workload is None or e.plan <= s.plans:
        return s  # a duplicate, or a plan for a job nobody submitted
    slots, by_node = s.slots, s.by_node
    for node in e.remove:
        index = by_node.get(node)
        old = slots.get(index) if index is not None else None
        if old is not None and old.node == node and old.phase is not SlotPhase.REMOVED:
            slots = slots.set(old.slot, replace(old, phase=SlotPhase.REMOVING))
    for launch in e.launch:
        slots = slots.set(
            launch.slot,
            Slot(
                slot=launch.slot,
                attempt=launch.attempt,
                node=launch.node,
                resources=launch.resources,
                phase=SlotPhase.LAUNCHING,
                since=e.ts,
                plan=e.plan,
                role=launch.role,
            ),
        )
        by_node = by_node.set(launch.node, launch.slot)
    record = PlanRecord(
        plan=e.plan,
        rule=e.rule,
        reason=e.reason,
        ts=e.ts,
        launch=tuple(n.node for n in e.launch),
        remove=e.remove,
    )
    growth = s.growth
    ceiling = s.ceiling
    if e.rule is ev.ScaleRule.GROW:
        growth = Growth(plan=e.plan, size=e.target - 1, speed=e.speed)
    elif e.rule is ev.ScaleRule.SHRINK and growth is not None:
        ceiling = growth.size + 1
        growth = None
    return replace(
        s,
        slots=slots,
        by_node=by_node,
        plans=e.plan,
        pending=e.plan,
        pending_plan=e,
        last_plan_ts=e.ts,
        target=e.target or s.target,
        causes=s.causes | {e.cause},
        removing=s.removing | set(e.remove),
        recent=(*s.recent, record)[-RECENT_PLANS:],
        growth=growth,
        ceiling=ceiling,
    )


def on_applied(s: ScaleState, e: ev.PlanApplied) -> ScaleState:
    if e.plan != s.pending:
        return s
    return replace(
        s,
        pending=0,
        pending_plan=None,
        failed_in_row=0,
        recent=_record(s, e.plan, status=PlanStatus.APPLIED, done_ts=e.ts),
    )


def on_failed(s: ScaleState, e: ev.PlanFailed) -> ScaleState:
    if e.plan != s.pending:
        return s
    slots = s.slots
    for slot in s.slots.values():
        if slot.plan == e.plan and slot.phase is SlotPhase.LAUNCHING and slot.node not in e.created:
            slots = slots.set(
                slot.slot,
                replace(slot, phase=SlotPhase.FAILED, cause=e.id, reason=f"plan failed: {e.error}"),
            )
    return replace(
        s,
        slots=slots,
        pending=0,
        pending_plan=None,
        failed_in_row=s.failed_in_row + (0 if not e.retryable else 1),
        last_error=e.error,
        recent=_record(s, e.plan, status=PlanStatus.FAILED, error=e.error, done_ts=e.ts),
    )


def on_joined(s: ScaleState, e: ev.NodeJoined) -> ScaleState:
    slot = s.current(e.node)
    if slot is None or slot.phase not in (SlotPhase.LAUNCHING, SlotPhase.JOINED):
        return s
    return _set(s, replace(slot, phase=SlotPhase.JOINED, incarnation=e.incarnation, since=e.ts))


def _gone(s: ScaleState, node: str, incarnation: str, cause: str, reason: str) -> ScaleState:
    if node in s.removing:
        s = replace(s, removing=s.removing - {node})
    slot = s.current(node)
    if slot is None or (slot.incarnation and slot.incarnation != incarnation):
        return s
    if slot.phase is SlotPhase.REMOVING:
        return _set(s, replace(slot, phase=SlotPhase.REMOVED, cause=cause, reason=reason))
    if slot.phase.live:
        return _set(s, replace(slot, phase=SlotPhase.GONE, cause=cause, reason=reason))
    return s


def on_left(s: ScaleState, e: ev.NodeLeft) -> ScaleState:
    return _gone(s, e.node, e.incarnation, e.id, f"left: {e.reason or 'no reason given'}")


def on_lost(s: ScaleState, e: ev.NodeLost) -> ScaleState:
    return _gone(s, e.node, e.incarnation, e.id, f"lost: no heartbeat for {e.timeout_s:g}s")


def on_gone(s: ScaleState, e: ev.NodeGone) -> ScaleState:
    slot = s.current(e.node)
    incarnation = e.incarnation or (slot.incarnation if slot is not None else "")
    s = _gone(s, e.node, incarnation, e.id, f"gone: {e.reason}")
    after = s.current(e.node)
    if e.exit_code == ev.NODE_REFUSED_EXIT and after is not None and after.cause == e.id:
        s = _set(s, replace(after, refused=e.reason))
    return s


def on_excluded(s: ScaleState, e: ev.NodeExcluded) -> ScaleState:
    return _gone(s, e.node, e.incarnation, e.id, f"excluded: {e.reason}")


def on_worker_exited(s: ScaleState, e: ev.WorkerExited) -> ScaleState:
    slot = s.current(e.node)
    if e.kind is not ev.FailureKind.OOM or slot is None or slot.oom:
        return s
    if slot.phase is not SlotPhase.JOINED or slot.incarnation != e.incarnation:
        return s
    return _set(s, replace(slot, oom=e.id, oom_reason=e.reason))


def on_pending(s: ScaleState, e: ev.NodePending) -> ScaleState:
    slot = s.current(e.node)
    if slot is None or slot.phase is not SlotPhase.LAUNCHING or slot.unplaceable:
        return s
    return _set(s, replace(slot, unplaceable=e.reason))


def on_round(s: ScaleState, e: ev.RoundCompleted) -> ScaleState:
    return replace(s, round_since=e.ts, round_size=len(e.members))


#: The fold of each event type this part follows.
FOLDS: dict[type[ev.Event], Callable[[ScaleState, Any], ScaleState]] = {
    ev.JobSubmitted: on_submitted,
    ev.ScaleRequested: on_scale_requested,
    ev.ScalePlan: on_plan,
    ev.PlanApplied: on_applied,
    ev.PlanFailed: on_failed,
    ev.NodeJoined: on_joined,
    ev.NodeLeft: on_left,
    ev.NodeLost: on_lost,
    ev.NodeGone: on_gone,
    ev.NodePending: on_pending,
    ev.NodeExcluded: on_excluded,
    ev.WorkerExited: on_worker_exited,
    ev.RoundCompleted: on_round,
}
