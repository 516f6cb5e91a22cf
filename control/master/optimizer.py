"""The resource optimiser: the scale plan a managed job needs now, and why (pure).

`decide(scale, rdzv, liveness, now)` returns one `Plan`, a `FailJob`, a `Wait`
(why nothing is planned yet) or None (nothing to do). Each rule is a small
function of the state and `now`; the first rule that proposes a plan wins:

  oom        a node's worker ran out of memory: relaunch the node with memory
             x `oom_memory_factor`, at most `oom_max_step_bytes` more, never over
             `max_memory_bytes` (an OOM at the cap fails the job, naming it);
  replace    a node was lost, left unasked, was excluded (faulty, network check)
             or its launch failed: relaunch its slot (next attempt), one per plan;
             a node whose `rove run` refused to start (exit code 2) fails the job
             instead, saying why: every attempt would be refused alike;
  pending    a launched node has not joined after `pending_timeout_s`, or the
             backend said it cannot place it (`node_pending`): fewer nodes if the
             job is above its minimum, else retry with half the memory;
  straggler  a node's ranks spend `straggler_factor` x the others' median busy
             time per step (`progress.report(busy_s=)`): replace it;
  grow       the job runs `settle_s` at its target size below `--nnodes` MAX:
             add a node, remembering the speed before; once the grown round has
             settled, keep it only if the new node added at least
             `min_marginal_speed` of a node's speed, else shrink back and never
             grow to that size again.

Guards before any rule: one plan at a time (the scaler must report the last),
at least `plan_interval_s` between plans (doubled per failed plan in a row),
at most `max_plans` plans, `max_failed_plans` failures in a row fail the job;
a cause (the event behind a plan) gets one plan only.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Mapping

import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.domain.words import counted
from rove.control.master.netcheck import Wait
from rove.control.master.rdzv_state import RdzvState
from rove.control.master.scaling import ScaleState, Slot, SlotPhase

GIB = ev.GIB


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """A plan to publish (its number is the state's next)."""

    rule: ev.ScaleRule
    reason: str
    cause: str
    target: int
    launch: tuple[ev.NodeLaunch, ...] = ()
    remove: tuple[str, ...] = ()
    speed: float = 0.0


class FailJob(msgspec.Struct, frozen=True, kw_only=True):
    reason: str


Outcome = Plan | FailJob | Wait | None


def leaving(s: ScaleState) -> frozenset[str]:
    """Nodes a plan is about to stop (an OOM to relaunch, a node being removed): the
    rendezvous neither restarts a round for their failure nor puts them in a new one."""
    return s.removing | {slot.node for slot in s.slots.values() if slot.oom and slot.phase.live}


def decide(
    s: ScaleState, r: RdzvState, liveness: Mapping[str, ev.Heartbeat], now: float
) -> Outcome:
    w = s.workload
    if w is None:
        return None
    p = w.policy
    if s.pending:
        return Wait(reason=f"plan {s.pending} is being applied by the scaler")
    if s.failed_in_row >= p.max_failed_plans:
        return FailJob(
            reason=f"{s.failed_in_row} scale plans in a row failed (max_failed_plans); "
            f"last error: {s.last_error}"
        )
    failed = _failed(s, p)
    if failed is not None:
        return failed
    for plan in _proposals(s, w, r, liveness, now):
        if plan.cause in s.causes:
            continue  # this cause has had its plan
        if s.plans >= p.max_plans:
            return Wait(
                reason=f"would {plan.rule.value} ({plan.reason}), but the job's budget of "
                f"{p.max_plans} plans is spent (max_plans)"
            )
        ready_at = s.last_plan_ts + p.plan_interval_s * 2**s.failed_in_row
        if s.plans and now < ready_at:
            return Wait(
                reason=f"next plan ({plan.rule.value}) after the plan interval", until=ready_at
            )
        return plan
    return None


def _proposals(
    s: ScaleState,
    w: ev.Workload,
    r: RdzvState,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
) -> Iterator[Plan]:
    """Candidate plans, the most urgent first (generated lazily: the first usable wins)."""
    p = w.policy
    yield from _oom(s, p)
    yield from _shrink(s, w)
    yield from _fill(s, w)
    yield from _pending(s, w, now)
    yield from _straggler(s, r, liveness, now)
    yield from _throughput(s, w, r, liveness, now)


def _failed(s: ScaleState, p: ev.ScalePolicy) -> FailJob | None:
    """A job the optimiser cannot help: an OOM at the memory cap, a slot out of attempts."""
    for slot in s.live():
        mem = slot.resources.memory_bytes
        if slot.oom and mem and mem >= p.max_memory_bytes:
            return FailJob(
                reason=f"node {slot.node} ran out of memory with {mem / GIB:.3g} GiB, the "
                f"most a node may get (max_memory_bytes): {slot.oom_reason}"
            )
    if len(s.live()) >= s.target:
        return None
    for slot in s.slots.values():
        if slot.phase is SlotPhase.GONE and slot.refused:
            return FailJob(
                reason=f"node {slot.node} refused to start ({slot.refused}): every node is "
                "given the job's arguments and would refuse alike; its log says why "
                "(rove logs, or the pod's); fix the job and submit it again"
            )
        if slot.phase in (SlotPhase.GONE, SlotPhase.FAILED) and slot.attempt + 1 >= p.max_attempts:
            return FailJob(
                reason=f"slot {slot.slot} failed {counted(slot.attempt + 1, 'time')} "
                f"(max_attempts); last: {slot.node} {slot.reason}"
            )
    return None


def _relaunch(slot: Slot, resources: ev.Resources) -> tuple[ev.NodeLaunch, tuple[str, ...]]:
    launch = ev.NodeLaunch(
        node=ev.node_name(slot.slot, slot.attempt + 1),
        slot=slot.slot,
        attempt=slot.attempt + 1,
        resources=resources,
        replaces=slot.node,
        role=slot.role,
    )
    return launch, ((slot.node,) if slot.phase.live else ())


def _gib(n: int) -> str:
    return f"{n / GIB:.3g} GiB"


def _oom(s: ScaleState, p: ev.ScalePolicy) -> Iterator[Plan]:
    for slot in s.live():
        mem = slot.resources.memory_bytes
        if not slot.oom or not mem:
            continue  # no limit to raise: the rendezvous handles the failure
        new = min(int(mem * p.oom_memory_factor), mem + p.oom_max_step_bytes, p.max_memory_bytes)
        launch, remove = _relaunch(slot, replace(slot.resources, memory_bytes=new))
        yield Plan(
            rule=ev.ScaleRule.OOM,
            reason=f"{slot.node} ran out of memory ({slot.oom_reason}): relaunched as "
            f"{launch.node} with {_gib(new)} instead of {_gib(mem)}",
            cause=slot.oom,
            target=s.target,
            launch=(launch,),
            remove=remove,
        )


def _shrink(s: ScaleState, w: ev.Workload) -> Iterator[Plan]:
    """More nodes live than an operator's new maximum: stop the newest slots."""
    live = [x for x in s.live() if x.node not in s.removing]
    if len(live) <= w.max_nodes:
        return
    # the newest nodes go first; a parameter server's never (the job needs every one)
    workers = [x for x in live if x.role != ev.PS_ROLE]
    extra = tuple(x.node for x in workers[len(workers) - (len(live) - w.max_nodes) :])
    yield Plan(
        rule=ev.ScaleRule.RESIZE,
        reason=f"the job's nodes are now {w.min_nodes}-{w.max_nodes} (scale_requested): "
        f"stop {', '.join(extra)}",
        cause=f"resize:{s.resize}:{w.max_nodes}",
        target=w.max_nodes,
        remove=extra,
    )


def _fill(s: ScaleState, w: ev.Workload) -> Iterator[Plan]:
    live = s.live()
    if len(live) >= s.target:
        return
    if not s.plans:
        nodes = tuple(_new_launch(w, i) for i in range(s.target))
        of_ps = (
            f", {w.ps.count} of them for the parameter servers ({w.ps.resources.describe()} each)"
            if w.ps is not None
            else ""
        )
        yield Plan(
            rule=ev.ScaleRule.INITIAL,
            reason=f"start {counted(s.target, 'node')} ({w.resources.describe()} each{of_ps})",
            cause="submitted",
            target=s.target,
            launch=nodes,
        )
        return
    ended = sorted(
        (x for x in s.slots.values() if x.phase in (SlotPhase.GONE, SlotPhase.FAILED)),
        key=lambda x: x.slot,
    )
    for slot in ended:
        launch, _ = _relaunch(slot, slot.resources)
        yield Plan(
            rule=ev.ScaleRule.REPLACE,
            reason=f"{slot.node} {slot.reason}: replaced by {launch.node} "
            f"({len(live)} of {s.target} nodes live)",
            cause=slot.cause or f"replace:{slot.node}",
            target=s.target,
            launch=(launch,),
        )
    if not ended:
        index = _next_slot(s)
        yield Plan(
            # (below the target with no slot to relaunch: an operator raised the minimum)
            rule=ev.ScaleRule.RESIZE if s.resize else ev.ScaleRule.REPLACE,
            reason=f"{len(live)} of {s.target} nodes live: start {ev.node_name(index, 0)}",
            cause=f"fill:{index}",
            target=s.target,
            launch=(_new_launch(w, index),),
        )


def _next_slot(s: ScaleState) -> int:
    return max(s.slots.keys(), default=-1) + 1


def _new_launch(w: ev.Workload, index: int) -> ev.NodeLaunch:
    """The first attempt of slot `index`: one of a TensorFlow job's parameter servers'
    nodes (the first `w.ps.count` slots), else a node like every other."""
    if w.ps is not None and index < w.ps.count:
        return ev.NodeLaunch(
            node=ev.node_name(index, 0),
            slot=index,
            attempt=0,
            resources=w.ps.resources,
            role=ev.PS_ROLE,
        )
    return ev.NodeLaunch(node=ev.node_name(index, 0), slot=index, attempt=0, resources=w.resources)


def _pending(s: ScaleState, w: ev.Workload, now: float) -> Iterator[Plan]:
    p = w.policy
    live = s.live()
    for slot in live:
        if slot.phase is not SlotPhase.LAUNCHING:
            continue
        if slot.unplaceable:
            waited = f"{slot.node} cannot be placed ({slot.unplaceable})"
        elif now - slot.since > p.pending_timeout_s:
            waited = f"{slot.node} has not joined {now - slot.since:.0f}s after its launch"
        else:
            continue
        if len(live) > w.min_nodes and slot.role != ev.PS_ROLE:
            yield Plan(
                rule=ev.ScaleRule.PENDING,
                reason=f"{waited}: go on with {counted(len(live) - 1, 'node')}",
                cause=f"pending:{slot.node}",
                target=max(w.min_nodes, s.target - 1),
                remove=(slot.node,),
            )
            continue
        mem = slot.resources.memory_bytes
        smaller = replace(slot.resources, memory_bytes=mem // 2 if mem >= 2 * GIB else mem)
        launch, remove = _relaunch(slot, smaller)
        yield Plan(
            rule=ev.ScaleRule.PENDING,
            reason=f"{waited}: retried as {launch.node} ({smaller.describe()})",
            cause=f"pending:{slot.node}",
            target=s.target,
            launch=(launch,),
            remove=remove,
        )


def _round_heartbeats(
    r: RdzvState, liveness: Mapping[str, ev.Heartbeat]
) -> dict[str, ev.Heartbeat] | None:
    """Every member's heartbeat from the running round, or None if one is missing."""
    beats = {}
    for m in r.members:
        hb = liveness.get(m.node)
        if hb is None or hb.incarnation != m.incarnation or hb.round != r.round or not hb.ranks:
            return None
        beats[m.node] = hb
    return beats


def _settled(s: ScaleState, r: RdzvState, w: ev.Workload, now: float) -> bool:
    return r.active and bool(r.members) and now - s.round_since >= w.policy.settle_s


def _straggler(
    s: ScaleState, r: RdzvState, liveness: Mapping[str, ev.Heartbeat], now: float
) -> Iterator[Plan]:
    w = s.workload
    assert w is not None
    if len(r.members) < 2 or not _settled(s, r, w, now):
        return
    beats = _round_heartbeats(r, liveness)
    if beats is None:
        return
    busy = {}
    for node, hb in beats.items():
        values = [x.busy_s for x in hb.ranks if x.busy_s is not None]
        if values:
            busy[node] = statistics.fmean(values)
    factor = w.policy.straggler_factor
    for node, mine in sorted(busy.items()):
        others = [b for n, b in busy.items() if n != node]
        slot = s.current(node)
        if not others or slot is None or slot.phase is not SlotPhase.JOINED:
            continue
        median = statistics.median(others)
        if median > 0 and mine > factor * median:
            launch, remove = _relaunch(slot, slot.resources)
            yield Plan(
                rule=ev.ScaleRule.STRAGGLER,
                reason=f"{node} is a straggler: {mine:.3g}s of work per step, "
                f"{mine / median:.1f}x the others' median {median:.3g}s; replaced by {launch.node}",
                cause=f"straggler:{node}",
                target=s.target,
                launch=(launch,),
                remove=remove,
            )


def job_speed(r: RdzvState, liveness: Mapping[str, ev.Heartbeat]) -> float | None:
    """Samples per second of the running round, once every rank of every member has a
    measured speed: a rank that has not (its first heartbeats since it began stepping
    report 0) would make a job that just grew look slower than it is."""
    beats = _round_heartbeats(r, liveness)
    if beats is None:
        return None
    rates = [x.samples_per_s for hb in beats.values() for x in hb.ranks]
    if not rates or min(rates) <= 0:
        return None
    return sum(rates)


def _throughput(
    s: ScaleState,
    w: ev.Workload,
    r: RdzvState,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
) -> Iterator[Plan]:
    p = w.policy
    if not p.auto_grow or w.max_nodes <= w.min_nodes or not _settled(s, r, w, now):
        return
    live = s.live()
    if len(r.members) != s.target or any(x.phase is not SlotPhase.JOINED for x in live):
        return
    speed = job_speed(r, liveness)
    if speed is None:
        return
    g = s.growth
    size = len(r.members)
    if g is not None and g.plan == s.plans and size == g.size + 1 and g.speed > 0:
        marginal = (speed - g.speed) / (g.speed / g.size)
        if marginal < p.min_marginal_speed:
            newest = max(live, key=lambda x: x.slot)
            yield Plan(
                rule=ev.ScaleRule.SHRINK,
                reason=f"node {size} added {marginal:.2f} of a node's speed ({speed:.1f} vs "
                f"{g.speed:.1f} samples/s), less than {p.min_marginal_speed:g}: back to "
                f"{counted(g.size, 'node')}, and no more growth",
                cause=f"shrink:{g.plan}",
                target=g.size,
                remove=(newest.node,),
                speed=speed,
            )
            return
    if size >= w.max_nodes or (s.ceiling and size + 1 >= s.ceiling):
        return
    index = _next_slot(s)
    yield Plan(
        rule=ev.ScaleRule.GROW,
        reason=f"{speed:.1f} samples/s with {size} nodes: try {size + 1} "
        f"(kept if the new node adds {p.min_marginal_speed:g} of a node's speed)",
        cause=f"grow:{s.plans}",
        target=size + 1,
        launch=(_new_launch(w, index),),
        speed=speed,
    )
