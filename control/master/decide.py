"""`decide(state, liveness, now) -> decisions`: what the leading master should do now.

Pure: the clock is the `now` argument, heartbeats are the `liveness` argument
(they are soft state, read from the heartbeat stream, not folded). A decision
takes effect only when it comes back through the stream, so `decide` may
return the same decision on several ticks: its id is a function of the epoch
and the state it answers, and the server drops the repeats (`Nats-Msg-Id`).
The epoch is part of the id so that a deposed leader's copy of a decision is
refused by the fence, never silently absorbed as a duplicate.

Only the elected leader calls this, after its own `master_elected` event has
been folded (so `state.leader` and `state.epoch` name it).
"""

from __future__ import annotations

from collections.abc import Mapping

from rove.control import events as ev
from rove.control.master import checkpoints as ckpt
from rove.control.master import data
from rove.control.master import rendezvous as rdzv
from rove.control.master.state import JobState, NodeStatus


def decide(state: JobState, liveness: Mapping[str, ev.Heartbeat], now: float) -> list[ev.Decision]:
    if state.phase.terminal or state.spec is None:
        return []
    decisions: list[ev.Decision] = []
    decisions.extend(_lost_nodes(state, liveness, now))
    decisions.extend(_stop(state, now))
    if not decisions:
        decisions.extend(_rendezvous(state, liveness, now))
    decisions.extend(_commit(state, now))
    decisions.extend(_data(state, now))
    return decisions


_DATA_DECISIONS: dict[str, type[ev.Decision]] = {
    ev.kind(t): t for t in (ev.ShardLeased, ev.ShardRequeued, ev.DataRestored, ev.DataRejected)
}


def _data(state: JobState, now: float) -> list[ev.Decision]:
    if not state.data.datasets and not state.data.rejections:
        return []
    lost = frozenset(n.node for n in state.nodes.values() if n.status is not NodeStatus.ACTIVE)
    return [
        _DATA_DECISIONS[kind](**_common(state, now, kind, *id_parts), **fields)  # type: ignore[arg-type]
        for kind, fields, id_parts in data.due(state.data, state.rdzv.round, lost, now)
    ]


def _commit(state: JobState, now: float) -> list[ev.Decision]:
    due = ckpt.to_commit(state.ckpt)
    if due is None:
        return []
    step, world = due
    return [
        ev.CkptCommitted(
            **_common(state, now, "ckpt_committed", step),  # type: ignore[arg-type]
            step=step,
            world_size=world,
        )
    ]


def _common(state: JobState, now: float, *id_parts: object) -> dict[str, object]:
    return {
        "job": state.job,
        "id": ev.make_id(state.job, state.epoch, *id_parts),
        "producer": f"master:{state.leader}",
        "ts": now,
        "epoch": state.epoch,
    }


def _lost_nodes(
    state: JobState, liveness: Mapping[str, ev.Heartbeat], now: float
) -> list[ev.Decision]:
    assert state.spec is not None
    timeout = state.spec.node_timeout_s
    # A new leader gives every node one full timeout to reach it before it
    # declares anyone lost: heartbeats may have paused while there was no leader.
    if now - state.leader_since < timeout:
        return []
    lost: list[ev.Decision] = []
    for node in state.nodes.values():
        if node.status is not NodeStatus.ACTIVE:
            continue
        hb = liveness.get(node.node)
        last_seen = node.joined_ts
        if hb is not None and hb.incarnation == node.incarnation:
            last_seen = max(last_seen, hb.ts)
        if now - last_seen > timeout:
            lost.append(
                ev.NodeLost(
                    **_common(state, now, "node_lost", node.node, node.incarnation),  # type: ignore[arg-type]
                    node=node.node,
                    incarnation=node.incarnation,
                    last_seen=last_seen,
                    timeout_s=timeout,
                )
            )
    return lost


def _rendezvous(
    state: JobState, liveness: Mapping[str, ev.Heartbeat], now: float
) -> list[ev.Decision]:
    live = {n.node: n.incarnation for n in state.nodes.values() if n.status is NodeStatus.ACTIVE}
    action = rdzv.decide(state.rdzv, rdzv.Alive(live), liveness, now)
    if action is None:
        return []
    kind, fields = action
    r = state.rdzv
    match kind:
        case "round":
            members = fields["members"]
            assert isinstance(members, tuple)
            step, source = ckpt.restore_point(
                state.ckpt,
                [(m.node, tuple(range(m.first_rank, m.first_rank + m.nproc))) for m in members],
            )
            return [
                ev.RoundCompleted(
                    **_common(state, now, "round", fields["round"]),  # type: ignore[arg-type]
                    **fields,  # type: ignore[arg-type]
                    restore_step=step,
                    restore_source=source,
                )
            ]
        case "exclude":
            return [
                ev.NodeExcluded(
                    **_common(state, now, "excluded", fields["node"], fields["incarnation"]),  # type: ignore[arg-type]
                    **fields,  # type: ignore[arg-type]
                )
            ]
        case "netcheck":
            return [
                ev.NetworkCheckAssigned(
                    **_common(state, now, "netcheck", fields["check_round"]),  # type: ignore[arg-type]
                    **fields,  # type: ignore[arg-type]
                )
            ]
        case "netcheck_done":
            return [
                ev.NetworkCheckCompleted(
                    **_common(state, now, "netcheck_done"),  # type: ignore[arg-type]
                    **fields,  # type: ignore[arg-type]
                )
            ]
        case "finished" | "failed":
            phase = ev.JobPhase.FINISHED if kind == "finished" else ev.JobPhase.FAILED
            return [
                ev.JobEnded(
                    **_common(state, now, "job_ended", phase, r.round),  # type: ignore[arg-type]
                    phase=phase,
                    reason=str(fields["reason"]),
                )
            ]
    raise AssertionError(f"unknown rendezvous action {kind}")


def _stop(state: JobState, now: float) -> list[ev.Decision]:
    if state.stop_requested is None:
        return []
    reason = state.stop_requested or "stopped by an operator"
    return [
        ev.JobEnded(
            **_common(state, now, "job_ended", ev.JobPhase.STOPPED),  # type: ignore[arg-type]
            phase=ev.JobPhase.STOPPED,
            reason=reason,
        )
    ]
