"""`decide(state, liveness, now) -> Decided`: what the leading master should do now.

Pure: the clock is the `now` argument, heartbeats are the `liveness` argument
(they are soft state, read from the heartbeat stream, not folded). A decision
takes effect only when it comes back through the stream, so `decide` may
return the same decision on several ticks: its id is a function of the epoch
and the state it answers, and the server drops the repeats (`Nats-Msg-Id`).
The epoch is part of the id so that a deposed leader's copy of a decision is
refused by the fence, never silently absorbed as a duplicate.

The sub-deciders (`rendezvous`, `netcheck`, `data`, `checkpoints`) return
small typed intents; this module alone wraps them into decision events with
their envelope. When the rendezvous has nothing to do, it says why not yet
(`Decided.waiting`), which the runner logs when it changes and `rove status`
shows.

Only the elected leader calls this, after its own `master_elected` event has
been folded (so `state.leader` and `state.epoch` name it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.master import checkpoints as ckpt
from rove.control.master import data_due, netcheck, optimizer, skew
from rove.control.master import rendezvous as rdzv
from rove.control.master.silence import NOT_HEARD, Heard, last_heard
from rove.control.master.state import JobState, NodeRecord, NodeStatus


class Decided(NamedTuple):
    """The decisions due now, why the rendezvous waits (None when it has acted), and
    why the optimiser plans nothing yet (None when it has nothing to wait for)."""

    decisions: list[ev.Decision]
    waiting: netcheck.Wait | None
    scale_waiting: netcheck.Wait | None = None


def decide(
    state: JobState,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    *,
    suspects: Collection[str] | None = None,
    hearing_since: float = 0.0,
    heard: Mapping[str, Heard] = NOT_HEARD,
    clock_off: skew.ClockOff = skew.ON_TIME,
) -> Decided:
    """What the leader decides now. `suspects`: the only nodes that may be lost (the
    runner's `Silence` finds them at the cost of those that are silent); None looks at
    every node. `hearing_since`: since when this leader could hear heartbeats (its
    connection to NATS came back then; `now` while it is away). `heard`: when it last
    heard each node live, by its own clock (`silence.last_heard`). `clock_off`: the nodes
    whose clocks are off its own, by how much (their stamped times are read on its clock:
    `skew`)."""

    if state.phase.terminal:
        return Decided(_next_run(state, now), None)
    if state.spec is None:
        return Decided([], None)
    decisions: list[ev.Decision] = []
    decisions.extend(_lost_nodes(state, liveness, now, suspects, hearing_since, heard))
    decisions.extend(_stop(state, now))
    waiting = scale_waiting = None
    if not decisions and state.scale.workload is not None:
        planned = optimizer.decide(state.scale, state.rdzv, liveness, now)
        if isinstance(planned, netcheck.Wait):
            scale_waiting = planned
        elif planned is not None:
            decisions.append(_scale(state, planned, now))
    if not decisions:
        live = {
            n.node: n.incarnation for n in state.nodes.values() if n.status is NodeStatus.ACTIVE
        }
        leaving = optimizer.leaving(state.scale)
        outcome = rdzv.decide(
            state.rdzv,
            rdzv.Alive(live),
            liveness,
            now,
            leaving,
            settle=bool(state.ckpt.memory),
            clock_off=clock_off,
        )
        if isinstance(outcome, netcheck.Wait):
            waiting = outcome
        else:
            decisions.append(_rendezvous(state, outcome, now))
    if not any(isinstance(d, ev.RoundCompleted) for d in decisions):
        # a round formed now starts a new lineage: what to commit is decided after it.
        # Commits go first: a job that ends now ends with its last step committed (its
        # agents persisted it before saying their workers finished), and says so.
        commits = _commit(state, now)
        decisions = [*commits, *(_ending(state, d, commits) for d in decisions)]
    decisions.extend(_data(state, now, clock_off))
    decisions.extend(_replaced(state, now))
    return Decided(decisions, waiting, scale_waiting)


def _replaced(state: JobState, now: float) -> list[ev.Decision]:
    """Each agent that a newer one of its node took the place of is told so: if it still
    runs (a second agent under the same node id), it leaves, rather than the two waiting
    for each other."""
    told: list[ev.Decision] = []
    for node, incarnations in state.replaced.items():
        newest = state.nodes[node]
        told.extend(
            ev.NodeReplaced(
                **_envelope(state, now, "replaced", node, incarnation),
                node=node,
                incarnation=incarnation,
                by_incarnation=newest.incarnation,
                by_host=newest.host,
                by_pid=newest.pid,
            )
            for incarnation in incarnations
        )
    return told


def _scale(state: JobState, intent: optimizer.Plan | optimizer.FailJob, now: float) -> ev.Decision:
    if isinstance(intent, optimizer.FailJob):
        return ev.JobEnded(
            **_envelope(state, now, "job_ended", ev.JobPhase.FAILED, "scale"),
            phase=ev.JobPhase.FAILED,
            reason=intent.reason,
        )
    number = state.scale.plans + 1
    return ev.ScalePlan(
        **_envelope(state, now, "scale_plan", number),
        plan=number,
        rule=intent.rule,
        reason=intent.reason,
        cause=intent.cause,
        launch=intent.launch,
        remove=intent.remove,
        target=intent.target,
        speed=intent.speed,
    )


def _envelope(state: JobState, now: float, *id_parts: object) -> ev.DecisionEnvelope:
    # a later run decides the same things again (round 1, step 10): its ids differ
    run = () if state.run == 1 else (f"run{state.run}",)
    return ev.decision_envelope(state.job, state.epoch, state.leader, now, *run, *id_parts)


def _next_run(state: JobState, now: float) -> list[ev.Decision]:
    """An ended job that a node joined since: its next run starts (`run_started`), as
    torchrun runs again under an `--rdzv-id` it ran before."""
    joined = [
        n
        for n in state.nodes.values()
        if n.status is NodeStatus.ACTIVE and n.joined_seq > state.ended_seq > 0
    ]
    if not joined:
        return []
    run = state.run + 1
    first = min(joined, key=lambda n: n.joined_seq)
    return [
        ev.RunStarted(
            **ev.decision_envelope(state.job, state.epoch, state.leader, now, "run_started", run),
            run=run,
            node=first.node,
            since=first.joined_seq,
        )
    ]


def _rendezvous(state: JobState, intent: rdzv.Intent, now: float) -> ev.Decision:
    match intent:
        case rdzv.FormRound():
            restore = ckpt.restore_point(
                state.ckpt,
                [
                    (m.node, tuple(range(m.first_rank, m.first_rank + m.nproc)))
                    for m in intent.members
                ],
                {m.node: m.incarnation for m in intent.members},
            )
            return ev.RoundCompleted(
                **_envelope(state, now, "round", intent.round),
                round=intent.round,
                members=intent.members,
                world_size=intent.world_size,
                master_addr=intent.master_addr,
                master_port=intent.master_port,
                restart_count=intent.restart_count,
                reason=intent.reason,
                cause=intent.cause,
                restore_step=restore.step,
                restore_source=restore.source,
                fetches=restore.fetches,
                tasks=intent.tasks,
            )
        case rdzv.ExcludeNode():
            return ev.NodeExcluded(
                **_envelope(state, now, "excluded", intent.node, intent.incarnation),
                node=intent.node,
                incarnation=intent.incarnation,
                reason=intent.reason,
            )
        case netcheck.StartCheck():
            return ev.NetworkCheckAssigned(
                **_envelope(state, now, "netcheck", intent.check_round),
                check_round=intent.check_round,
                groups=intent.groups,
                timeout_s=intent.timeout_s,
            )
        case netcheck.CompleteCheck():
            return ev.NetworkCheckCompleted(
                **_envelope(state, now, "netcheck_done"),
                results=intent.results,
                faulty=intent.faulty,
                stragglers=intent.stragglers,
            )
        case rdzv.EndJob():
            return ev.JobEnded(
                **_envelope(state, now, "job_ended", intent.phase, state.rdzv.round),
                phase=intent.phase,
                reason=intent.reason,
            )


def _data(state: JobState, now: float, clock_off: skew.ClockOff) -> list[ev.Decision]:
    if not state.data.datasets and not state.data.rejections:
        return []
    left = frozenset(n.node for n in state.nodes.values() if n.status is NodeStatus.LEFT)
    lost = frozenset(n.node for n in state.nodes.values() if n.status is NodeStatus.LOST)
    return [
        _data_decision(state, intent, now)
        for intent in data_due.due(state.data, state.rdzv.round, lost, now, clock_off, left)
    ]


def _data_decision(state: JobState, intent: data_due.DataIntent, now: float) -> ev.Decision:
    match intent:
        case data_due.Reject(rejection=r):
            return ev.DataRejected(
                **_envelope(state, now, "data_rejected", r.event_id, r.client),
                dataset=r.dataset,
                client=r.client,
                event_id=r.event_id,
                reason=r.reason,
            )
        case data_due.AnnounceRestore():
            return ev.DataRestored(
                **_envelope(state, now, "data_restored", intent.dataset, intent.round),
                dataset=intent.dataset,
                round=intent.round,
                step=intent.step,
                done_shards=intent.done_shards,
                partial_shards=intent.partial_shards,
            )
        case data_due.Announce(grant=g):
            # the empty answer to a parked request is an answer of its own: shards granted
            # to the request meanwhile are announced too (not deduplicated by the id)
            idle = ("parked",) if intent.unparked else ("lapsed",) if intent.lapsed else ()
            return ev.ShardLeased(
                **_envelope(state, now, "shard_leased", intent.dataset, g.client, g.request, *idle),
                dataset=intent.dataset,
                client=g.client,
                request=g.request,
                node=g.node,
                rank=g.rank,
                shards=g.shards,
                deadline=g.deadline,
                exhausted=g.exhausted,
                ranges=g.ranges,
                lapsed=intent.lapsed,
            )
        case data_due.Requeue():
            return ev.ShardRequeued(
                **_envelope(
                    state,
                    now,
                    "shard_requeued",
                    intent.dataset,
                    intent.client,
                    intent.reason,
                    intent.digest,
                ),
                dataset=intent.dataset,
                client=intent.client,
                reason=intent.reason,
                shards=intent.shards,
            )


def _commit(state: JobState, now: float) -> list[ev.Decision]:
    """The newest step every rank persisted; or first, the older step a round's workers
    fell back to, committed again (its own id: the step was committed once before)."""
    out: list[ev.Decision] = []
    again = state.ckpt.recommit
    if again is not None:
        rnd = state.rdzv.round
        out.append(
            ev.CkptCommitted(
                **_envelope(state, now, "ckpt_committed", again, "fell-back", rnd),
                step=again,
                world_size=sum(m.nproc for m in state.rdzv.members),
                round=rnd,
            )
        )
    due = ckpt.to_commit(state.ckpt)
    if due is None:
        return out
    step, world = due
    return [
        *out,
        ev.CkptCommitted(
            **_envelope(state, now, "ckpt_committed", step),
            step=step,
            world_size=world,
            round=state.rdzv.round,
        ),
    ]


def _ending(state: JobState, decision: ev.Decision, commits: list[ev.Decision]) -> ev.Decision:
    """`decision`, and if it ends the job, its reason naming the step left durable."""
    if not isinstance(decision, ev.JobEnded):
        return decision
    committing = max((c.step for c in commits if isinstance(c, ev.CkptCommitted)), default=None)
    clause = ckpt.at_end(state.ckpt, [m.node for m in state.rdzv.members], committing)
    return replace(decision, reason=(decision.reason + clause)[: ev.REASON_CHARS])


def _lost_nodes(
    state: JobState,
    liveness: Mapping[str, ev.Heartbeat],
    now: float,
    suspects: Collection[str] | None,
    hearing_since: float,
    heard: Mapping[str, Heard],
) -> list[ev.Decision]:
    assert state.spec is not None
    timeout = state.spec.node_timeout_s
    # A new leader gives every node one full timeout to reach it before it
    # declares anyone lost: heartbeats may have paused while there was no leader.
    # So does a leader that was cut off from NATS (a server restarted, every server
    # of a cluster): the nodes' silence then was its own deafness, and nodes that
    # trained on throughout would all be lost at once as it reconnects.
    if now - max(state.leader_since, hearing_since) < timeout:
        return []
    lost: list[ev.Decision] = []
    if suspects is None:
        nodes: Iterable[NodeRecord] = state.nodes.values()
    else:
        nodes = (state.nodes[n] for n in suspects if n in state.nodes)
    for node in nodes:
        if node.status is not NodeStatus.ACTIVE:
            continue
        last_seen = last_heard(node, liveness, heard)
        if now - last_seen > timeout:
            lost.append(
                ev.NodeLost(
                    # joined_ts: an agent the master lost that joined again (same
                    # incarnation) and goes silent again is a new loss, not a duplicate
                    **_envelope(
                        state, now, "node_lost", node.node, node.incarnation, node.joined_ts
                    ),
                    node=node.node,
                    incarnation=node.incarnation,
                    last_seen=last_seen,
                    timeout_s=timeout,
                )
            )
    return lost


def _stop(state: JobState, now: float) -> list[ev.Decision]:
    if state.stop_requested is None:
        return []
    reason = state.stop_requested or "stopped by an operator"
    return [
        ev.JobEnded(
            **_envelope(state, now, "job_ended", ev.JobPhase.STOPPED),
            phase=ev.JobPhase.STOPPED,
            reason=reason,
        )
    ]
