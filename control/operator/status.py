"""What `kubectl get/describe rovejob` shows, from the job's events (pure).

`status(state, report, ...)` is the RoveJob's `.status` from the job's folded
state and its goodput report: the phase, conditions with reasons, the round, its
nodes, restarts, progress, the last failure and its diagnosis, goodput.
`notable(recorded)` turns the events a person watching the job wants to see
into Kubernetes Events (`kubectl describe` lists them); each is named after the
stream sequence of its event, so a restarted operator creates none twice.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp
from rove.control.domain import words
from rove.control.master.state import JobState

#: `.status.phase`: the job's phases, and two of the operator's own before there are
#: events (`Submitting`) and for a spec it refuses (`Invalid`)
SUBMITTING, INVALID, FAILED = "Submitting", "Invalid", "Failed"


class KubeEvent(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def phase(state: JobState, seen: bool) -> str:
    return state.phase.value.capitalize() if seen else SUBMITTING


def iso(ts: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _condition(kind: str, true: bool, reason: str, message: str, now: float) -> dict[str, Any]:
    return {
        "type": kind,
        "status": "True" if true else "False",
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": iso(now),
    }


def status(
    state: JobState,
    report: gp.Report | None,
    *,
    seen: bool,
    generation: int,
    events_through: int,
    now: float,
    step: int | None = None,
    previous: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The RoveJob's `.status`. `seen`: whether the job has any event yet;
    `events_through`: the newest stream sequence turned into Kubernetes Events;
    `step`: the newest step a rank reported;
    `previous`: the status now on the object (conditions keep their transition time
    while they hold)."""
    r = state.rdzv
    failure = r.failure or r.last_failure
    running = r.active and not state.phase.terminal
    last_failure = (
        {
            "node": failure.node,
            "rank": failure.rank,
            "kind": failure.kind.value,
            "reason": failure.reason[:1024],
        }
        if failure is not None
        else None
    )
    ended = state.phase.terminal
    conditions = [
        _condition(
            "Running",
            running,
            "RoundActive" if running else ("Ended" if ended else "WaitingForNodes"),
            f"round {r.round} of {words.counted(len(r.members), 'node')}"
            if running
            else state.phase.value,
            now,
        ),
        _condition(
            "Succeeded",
            state.phase is ev.JobPhase.FINISHED,
            state.phase.value.capitalize(),
            state.end_reason,
            now,
        ),
        _condition(
            "Failed",
            state.phase is ev.JobPhase.FAILED,
            (failure.kind.value if failure is not None else "None")
            if state.phase is ev.JobPhase.FAILED
            else "None",
            failure.reason if failure is not None and state.phase is ev.JobPhase.FAILED else "",
            now,
        ),
    ]
    old = {c["type"]: c for c in (previous or {}).get("conditions", [])}
    for c in conditions:
        was = old.get(c["type"])
        if was is not None and was.get("status") == c["status"]:
            c["lastTransitionTime"] = was.get("lastTransitionTime", c["lastTransitionTime"])
    out: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase(state, seen),
        "run": state.run,
        "round": r.round,
        "nodes": len(r.members) if r.active else 0,
        "members": [m.node for m in r.members] if r.active else [],
        "worldSize": sum(m.nproc for m in r.members) if r.active else 0,
        "restarts": r.restarts,
        "conditions": conditions,
        **({"nnodes": "{}:{}".format(*known)} if (known := bounds(state)) else {}),
        "eventsThrough": events_through,
    }
    if step is not None:
        out["step"] = step
    if state.ckpt.committed is not None:
        out["checkpointStep"] = state.ckpt.committed
    if last_failure is not None:
        out["lastFailure"] = last_failure
    if report is not None and report.total_s > 0:
        out["goodput"] = f"{100 * report.goodput:.1f}%"
    return out


def bounds(state: JobState) -> tuple[int, int] | None:
    """The job's node bounds as the bus has them (a managed job's workload), if known."""
    w = state.scale.workload
    return (w.min_nodes, w.max_nodes) if w is not None else None


def reused(job: str, created: str | None, ended_ts: float | None) -> str | None:
    """Why a RoveJob created at `created` (RFC 3339) cannot run: its name is that of a
    job that ended on the bus before it was created (`ended_ts`); None if it can."""
    if not created or ended_ts is None:
        return None
    import datetime as dt

    at = dt.datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
    if ended_ts >= at:
        return None
    return (
        f"job {job} already ran and ended at {iso(ended_ts)}, before this RoveJob was "
        "created: a job name is used once (its events stay readable with `rove events "
        f"--job {job}`); create the RoveJob under a new name"
    )


def patch(status: dict[str, Any], previous: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that makes the object's `.status` read `status` when it reads
    `previous`: a field `status` no longer has is sent as null (a merge patch leaves
    out what it does not name: `step` of an earlier run would stay on forever)."""
    return {**status, **{k: None for k in previous if k not in status}}


def invalid(generation: int, why: str, now: float) -> dict[str, Any]:
    """The `.status` of a RoveJob the operator refuses to run."""
    return {
        "observedGeneration": generation,
        "phase": INVALID,
        "conditions": [_condition("Running", False, "InvalidSpec", why, now)],
    }


def submit_failure(namespace: str, name: str, reason: str | None, message: str | None) -> str:
    """What a RoveJob whose submit Job failed says: Kubernetes' reason, and where the
    refusal's own words are (the pod's log; its termination message too)."""
    said = "; ".join(x for x in (reason, message) if x)
    return (
        f"its submit Job {name} failed ({said or 'no reason given'}); why is in its log: "
        f"kubectl logs -n {namespace} job/{name}"
    )


def submit_failed(generation: int, why: str, now: float) -> dict[str, Any]:
    """The `.status` of a RoveJob whose job never started: its submit Job failed."""
    return {
        "observedGeneration": generation,
        "phase": FAILED,
        "conditions": [
            _condition("Running", False, "SubmitFailed", why, now),
            _condition("Failed", True, "SubmitFailed", why, now),
        ],
    }


def notable(event: ev.Event, seq: int) -> KubeEvent | None:
    """The Kubernetes Event a person watching the job wants for `event`, if any."""
    if isinstance(event, ev.RoundCompleted):
        names = [m.node for m in event.members]
        nodes = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        source = event.restore_source.value if event.restore_step is not None else "fresh"
        restored = f" from step {event.restore_step} ({source})" if event.restore_step else ""
        return KubeEvent(
            seq=seq,
            type="Normal",
            reason="RoundFormed",
            message=f"round {event.round}: {words.counted(len(event.members), 'node')} ({nodes}), "
            f"world size {event.world_size}{restored}",
        )
    if isinstance(event, ev.NodeLost):
        return KubeEvent(
            seq=seq,
            type="Warning",
            reason="NodeLost",
            message=f"node {event.node} sent no heartbeat for {event.timeout_s:g}s",
        )
    if isinstance(event, ev.NodeExcluded):
        return KubeEvent(
            seq=seq, type="Warning", reason="NodeExcluded", message=f"{event.node}: {event.reason}"
        )
    if isinstance(event, ev.WorkerExited):
        return KubeEvent(
            seq=seq,
            type="Warning",
            reason="WorkerFailed",
            message=f"rank {event.rank} on {event.node}: "
            f"{words.failure(event.kind.value, event.reason)}",
        )
    if isinstance(event, ev.JobEnded):
        ok = event.phase is ev.JobPhase.FINISHED
        return KubeEvent(
            seq=seq,
            type="Normal" if ok else "Warning",
            reason=f"Job{event.phase.value.capitalize()}",
            message=event.reason or f"the job {event.phase.value}",
        )
    return None
