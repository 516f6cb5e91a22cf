"""`evolve(state, event, seq) -> state`: fold one recorded event into the job state.

Pure: no clock, no I/O, no randomness; it never raises on a decoded event.
`seq` is the event's stream sequence, part of the recorded fact. Decisions
from an older epoch than the state's (a deposed master that slipped past the
fence) are counted and otherwise ignored, as are decisions that no longer
apply (a node lost twice), so replaying duplicates is harmless.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import immutables
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.master import checkpoints as ckpt
from rove.control.master import data, scaling
from rove.control.master import rdzv_state as rdzv
from rove.control.master.state import (
    RECENT_REJECTIONS,
    Counters,
    JobState,
    NodeRecord,
    NodeStatus,
    next_run,
)

_E = TypeVar("_E", bound=ev.Event)

#: Events that only change one part of the state: (the part, its fold).
_PART_FOLDS: dict[type[ev.Event], tuple[str, Callable[[Any, Any], Any]]] = {
    ev.RdzvJoined: ("rdzv", rdzv.on_rdzv_joined),
    ev.ScaleRequested: ("rdzv", rdzv.on_scale_requested),
    ev.WorkersSucceeded: ("rdzv", rdzv.on_workers_succeeded),
    ev.TaskRestarted: ("rdzv", rdzv.on_task_restarted),
    ev.NetworkCheckAssigned: ("rdzv", rdzv.on_check_assigned),
    ev.NetworkCheckReported: ("rdzv", rdzv.on_check_reported),
    ev.NetworkCheckCompleted: ("rdzv", rdzv.on_check_completed),
    ev.CkptInMemory: ("ckpt", ckpt.on_in_memory),
    ev.CkptPersisted: ("ckpt", ckpt.on_persisted),
    ev.CkptFailed: ("ckpt", ckpt.on_failed),
    ev.CkptFound: ("ckpt", ckpt.on_found),
    ev.ReplicaStored: ("ckpt", ckpt.on_replica),
    ev.CkptCommitted: ("ckpt", ckpt.on_committed),
    ev.DatasetRegistered: ("data", data.on_registered),
    ev.ShardRequested: ("data", data.on_requested),
    ev.ShardDone: ("data", data.on_done),
    ev.ShardLeased: ("data", data.on_leased),
    ev.ShardRequeued: ("data", data.on_requeued),
    ev.DataRestored: ("data", data.on_restored),
    ev.DataRejected: ("data", data.on_rejected),
    ev.StreamShardsAdded: ("data", data.on_stream_shards),
    ev.StreamCheckpointed: ("data", data.on_stream_checkpointed),
    ev.RecordsUndecodable: ("data", data.on_undecodable),
}


def evolve(state: JobState, event: ev.Event, seq: int) -> JobState:
    new = _evolve(state, event, seq)
    if isinstance(event, ev.Decision) and event.epoch >= state.epoch:
        new = replace(new, decided_at=max(new.decided_at, event.ts))
    if isinstance(event, ev.CkptCommitted) and event.epoch >= state.epoch:
        new = replace(new, data=data.on_committed(new.data, event))  # prunes streams
    scale = scaling.FOLDS.get(type(event))
    if scale is None or (isinstance(event, ev.Decision) and event.epoch < state.epoch):
        return new
    return replace(new, scale=scale(new.scale, event))


def _evolve(state: JobState, event: ev.Event, seq: int) -> JobState:
    c = state.counters
    if isinstance(event, ev.Decision) and event.epoch < state.epoch:
        counters = replace(c, events=c.events + 1, stale_decisions=c.stale_decisions + 1)
        return replace(state, counters=counters, applied_seq=seq)
    part = _PART_FOLDS.get(type(event))
    if part is not None:
        name, fold = part
        if name == "rdzv" and state.phase.terminal:
            return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
        return replace(
            state,
            **{name: fold(getattr(state, name), event)},
            counters=replace(c, events=c.events + 1),
            applied_seq=seq,
        )
    return _apply(state, event, seq, c)


def _joined_seq(state: JobState, node: str, seq: int) -> int:
    """Where a node's join at `seq` is recorded to begin: its first since the job ended
    if it joins again before the next run starts (an agent of an older rove did, for
    an earlier run it saw started), so the run starts at its first join."""
    before = state.nodes.get(node)
    if state.phase.terminal and before is not None and before.joined_seq > state.ended_seq:
        return before.joined_seq
    return seq


def _apply(state: JobState, event: ev.Event, seq: int, c: Counters) -> JobState:
    """The new state; every branch sets `applied_seq=seq` and counts the event in its one
    `replace` of the state (and one of the counters)."""
    match event:
        case ev.NodeJoined():
            record = NodeRecord(
                node=event.node,
                host=event.host,
                pid=event.pid,
                incarnation=event.incarnation,
                status=NodeStatus.ACTIVE,
                joined_ts=event.ts,
                nproc_per_node=event.nproc_per_node,
                joined_seq=_joined_seq(state, event.node, seq),
            )
            phase = ev.JobPhase.RUNNING if state.phase is ev.JobPhase.PENDING else state.phase
            return replace(
                state,
                applied_seq=seq,
                rdzv=_rdzv_unless_ended(state, rdzv.on_node_joined, event),
                nodes=state.nodes.set(event.node, record),
                replaced=_replaced(state, event),
                phase=phase,
                counters=replace(c, events=c.events + 1, nodes_joined=c.nodes_joined + 1),
            )
        case ev.NodeLeft():
            node = state.nodes.get(event.node)
            if node is None or node.incarnation != event.incarnation:
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            left = replace(node, status=NodeStatus.LEFT, reason=event.reason)
            return replace(
                state,
                applied_seq=seq,
                rdzv=_rdzv_unless_ended(state, rdzv.on_node_gone, event),
                nodes=state.nodes.set(event.node, left),
                counters=replace(c, events=c.events + 1, nodes_left=c.nodes_left + 1),
            )
        case ev.NodeLost() | ev.NodeGone():
            node = state.nodes.get(event.node)
            if (
                node is None
                or node.status is not NodeStatus.ACTIVE
                or (event.incarnation and node.incarnation != event.incarnation)
            ):
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            lost = replace(
                node,
                status=NodeStatus.LOST,
                reason=(
                    f"no heartbeat for {event.timeout_s:g}s"
                    if isinstance(event, ev.NodeLost)
                    else f"gone: {event.reason}"
                ),
            )
            return replace(
                state,
                applied_seq=seq,
                rdzv=_rdzv_unless_ended(state, rdzv.on_node_gone, event),
                nodes=state.nodes.set(event.node, lost),
                counters=replace(c, events=c.events + 1, nodes_lost=c.nodes_lost + 1),
            )
        case ev.MasterElected():
            return replace(
                state,
                applied_seq=seq,
                leader=event.master,
                epoch=event.epoch,
                elected_seq=seq,
                leader_since=event.ts,
                counters=replace(c, events=c.events + 1, elections=c.elections + 1),
            )
        case ev.JobConfigured():
            if state.spec is not None:
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            return replace(
                state, spec=event.spec, counters=replace(c, events=c.events + 1), applied_seq=seq
            )
        case ev.StopRequested():
            if state.stop_requested is not None or state.phase.terminal:
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            return replace(
                state,
                stop_requested=event.reason,
                counters=replace(c, events=c.events + 1),
                applied_seq=seq,
            )
        case ev.JobEnded():
            if state.phase.terminal:
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            return replace(
                state,
                phase=event.phase,
                end_reason=event.reason,
                counters=replace(c, events=c.events + 1),
                applied_seq=seq,
                ended_seq=seq,
            )
        case ev.RunStarted():
            if not state.phase.terminal or event.run != state.run + 1:
                return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)
            return next_run(state, event.run, seq)
        case ev.EventRejected():
            recent = (*state.recent_rejections, event)[-RECENT_REJECTIONS:]
            return replace(
                state,
                applied_seq=seq,
                recent_rejections=recent,
                counters=replace(c, events=c.events + 1, rejected=c.rejected + event.count),
            )
        case ev.WorkerExited():
            return replace(
                state,
                rdzv=_rdzv_unless_ended(state, rdzv.on_worker_exited, event),
                counters=replace(c, events=c.events + 1, worker_failures=c.worker_failures + 1),
                applied_seq=seq,
            )
        case ev.RoundCompleted():
            return replace(
                state,
                rdzv=_rdzv_unless_ended(state, rdzv.on_round_completed, event),
                ckpt=ckpt.on_round(state.ckpt, event),
                counters=replace(c, events=c.events + 1, rounds=c.rounds + 1),
                applied_seq=seq,
            )
        case ev.TrainingProgress():
            node = state.nodes.get(event.node)
            nodes = state.nodes
            if node is not None and node.incarnation == event.incarnation:
                nodes = nodes.set(event.node, replace(node, step=event.step))
            return replace(
                state,
                nodes=nodes,
                ckpt=ckpt.on_progress(state.ckpt, event),
                counters=replace(c, events=c.events + 1),
                applied_seq=seq,
            )
        case ev.NodeReplaced():
            return replace(
                state,
                replaced=_told(state.replaced, event),
                counters=replace(c, events=c.events + 1),
                applied_seq=seq,
            )
        case ev.NodeExcluded():
            node = state.nodes.get(event.node)
            nodes = state.nodes
            if node is not None and node.incarnation == event.incarnation:
                nodes = nodes.set(event.node, replace(node, reason=f"excluded: {event.reason}"))
            return replace(
                state,
                nodes=nodes,
                rdzv=_rdzv_unless_ended(state, rdzv.on_excluded, event),
                counters=replace(c, events=c.events + 1),
                applied_seq=seq,
            )
        case _:
            # Heartbeats live in their own stream and never reach the fold;
            # any other event type is folded by the features that add it.
            return replace(state, counters=replace(c, events=c.events + 1), applied_seq=seq)


def _rdzv_unless_ended(
    state: JobState, fold: Callable[[rdzv.RdzvState, _E], rdzv.RdzvState], event: _E
) -> rdzv.RdzvState:
    """The rendezvous after `event`; frozen once the job ended (a node started again
    under a finished job's name is told so and leaves: no round re-forms)."""
    return state.rdzv if state.phase.terminal else fold(state.rdzv, event)


def _replaced(state: JobState, joined: ev.NodeJoined) -> immutables.Map[str, tuple[str, ...]]:
    """The incarnations still to be told they were replaced, once `joined` is folded: the
    node's earlier one too, if it was active under another incarnation."""
    earlier = state.nodes.get(joined.node)
    if (
        earlier is None
        or earlier.status is not NodeStatus.ACTIVE
        or earlier.incarnation == joined.incarnation
    ):
        return state.replaced
    untold = state.replaced.get(joined.node, ())
    return state.replaced.set(joined.node, (*untold, earlier.incarnation))


def _told(
    replaced: immutables.Map[str, tuple[str, ...]], told: ev.NodeReplaced
) -> immutables.Map[str, tuple[str, ...]]:
    untold = tuple(i for i in replaced.get(told.node, ()) if i != told.incarnation)
    if untold:
        return replaced.set(told.node, untold)
    return replaced.delete(told.node) if told.node in replaced else replaced
