"""`rove status`: the folded state of a job as a table, or one JSON object."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from rove.checkpoint import shm_owner
from rove.control.bus import embedded, records
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.cli import status_ckpt, status_data
from rove.control.cli.format import NODE_ROWS, first_nodes, rest_line, some
from rove.control.domain import words
from rove.control.domain.words import counted
from rove.control.flags import options as common
from rove.control.history import runs
from rove.control.master import skew
from rove.control.master.decide import decide
from rove.control.master.election import Holder, current_holder
from rove.control.master.evolve import evolve
from rove.control.master.replica import Replica
from rove.control.master.silence import NOT_HEARD, Heard, last_heard
from rove.control.master.state import JobState, NodeStatus, initial
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="show a job's state", description=__doc__)
    common.add_job_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--all",
        action="store_true",
        help=f"list every node (default: the {NODE_ROWS} a person should see first)",
    )
    common.add_run_arg(p)
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return aio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    options = common.bus_options(args, name="rove-status", job=args.job)
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job):
            if common.starting(bus, args.job) and args.run is None:
                sys.stdout.write(
                    json.dumps({"job": args.job, "phase": "starting"}) + "\n"
                    if args.json
                    else f"job {args.job}: starting (its launcher runs; no event yet)\n"
                )
                return common.EXIT_OK
            raise common.no_such_job(bus, args.job)
        kv, _ttl = await bus.lease_bucket()
        holder = await current_holder(kv, subjects.lease_key(args.job))
        until = None
        if args.run is not None:
            _, until = runs.span(await runs.starts(bus, args.job), args.run)
        if until is None:  # the newest run: the job's state now
            replica = Replica(bus, args.job, live_heartbeats=False)  # read once: stored
            await replica.start()
            await replica.stop()
            state, liveness = replica.state, replica.liveness
            heard, clock_off = replica.heard, replica.clock_off
        else:  # an earlier run: the fold up to the next run's start
            state, liveness, holder = await _fold_until(bus, args.job, until), {}, None
            heard, clock_off = {}, {}
        stored = str(embedded.job_store(args.job)) if bus.stored_job else None
        cut = until is None and runs.cut_off(bus.stored_job, state.phase.terminal)
        last_event = await runs.last_heard(bus, args.job) if cut else None
    view = status_view(state, liveness, holder, time.time(), heard=heard, clock_off=clock_off)
    view["stored"] = stored
    # (the newest run never ended, and nothing more will come to it: `runs.cut_off`)
    view["cut_off"] = {"last_heard": last_event} if cut else None
    if args.json:
        sys.stdout.write(json.dumps(view) + "\n")
    else:
        sys.stdout.write(render(view, most=None if args.all else NODE_ROWS))
    return common.EXIT_OK


async def _fold_until(bus: Bus, job: str, until: int) -> JobState:
    """The job's state as it was just before stream sequence `until`."""
    state = initial(job)

    def fold(rec: records.Recorded) -> None:
        nonlocal state
        if rec.seq < until:
            state = evolve(state, rec.event, rec.seq)

    await bus.read(subjects.EVENTS_STREAM, subjects.job_events(job), fold)
    return state


def status_view(
    state: JobState,
    liveness: Mapping[str, ev.Heartbeat],
    holder: Holder | None,
    now: float,
    *,
    heard: Mapping[str, Heard] = NOT_HEARD,
    clock_off: skew.ClockOff = skew.ON_TIME,
) -> dict[str, Any]:
    """Everything `rove status` shows, as plain data (pure). `heard`: when each node's
    newest heartbeat was stored, by the server's clock; `clock_off`: the nodes whose
    clocks are off the server's, by how much (`Replica` without live heartbeats). A
    node's heartbeat age and what the leader waits for are read on the server's clock,
    as the leader reads them on its own, not on the node's."""
    nodes = []
    for n in sorted(state.nodes.values(), key=lambda r: r.node):
        hb = liveness.get(n.node)
        fresh = hb is not None and hb.incarnation == n.incarnation
        ranks = hb.ranks if fresh and hb else ()
        off = clock_off.get(n.node)
        nodes.append(
            {
                "node": n.node,
                "status": n.status.value,
                "host": n.host,
                "pid": n.pid,
                "incarnation": n.incarnation,
                "reason": n.reason,
                "last_heartbeat_age_s": (
                    round(now - last_heard(n, liveness, heard), 1) if fresh and hb else None
                ),
                # (None: no heartbeat of this incarnation to tell, e.g. a node that left)
                # seconds to add to its clock to read the server's (None: within 5 s)
                "clock_off_s": round(off, 1) if off is not None else None,
                "ranks": len(ranks) if fresh else None,
                # (its workers' newest step: live from its heartbeat; of a node that
                # left or was lost, the last one they reported, after its last beat)
                "step": n.step
                if n.step is not None and n.status is not NodeStatus.ACTIVE
                else max((r.step for r in ranks), default=n.step),
                "samples_per_s": round(sum(r.samples_per_s for r in ranks), 1) if ranks else None,
                "cpu_percent": hb.cpu_percent if fresh and hb else None,
                "mem_used_bytes": hb.mem_used_bytes if fresh and hb else None,
            }
        )
    r = state.rdzv
    failure = r.failure or r.last_failure
    decided = decide(state, liveness, now, heard=heard, clock_off=clock_off)
    waiting = decided.waiting
    return {
        "job": state.job,
        "run": state.run,
        "phase": state.phase.value,
        "round": r.round,
        "round_active": r.active,
        "world_size": sum(m.nproc for m in r.members) if r.active else 0,
        "members": [m.node for m in r.members] if r.active else [],
        "waiting": sorted(r.waiting.keys()),
        # why no round forms or changes now, as the leader sees it (pure: computed here)
        "not_yet": (
            {
                "reason": waiting.reason,
                "in_s": None if waiting.until is None else round(max(0.0, waiting.until - now), 1),
            }
            if waiting is not None and waiting.reason
            else None
        ),
        "restarts": r.restarts,
        "max_restarts": r.params.max_restarts if r.params else None,
        # rounds started again on fresh ports after one a node offered was taken
        "port_rounds": r.port_rounds,
        "last_failure": (
            {
                "node": failure.node,
                "rank": failure.rank,
                "kind": failure.kind.value,
                "reason": failure.reason,
                "round": failure.round,
            }
            if failure
            else None
        ),
        "excluded": dict(r.excluded.items()),
        "tensorflow": _tf_view(r),
        "checkpoints": status_ckpt.view(state.ckpt),
        "datasets": [
            status_data.dataset_view(state.data, ds) for ds in state.data.datasets.values()
        ],
        "scaling": _scaling_view(state, decided.scale_waiting, now),
        "streams": [
            status_data.stream_view(st, now, state.ckpt.committed)
            for st in state.data.streams.streams.values()
        ],
        "network_check": (
            {
                "done": r.check.done,
                "check_round": r.check.check_round,
                "faulty": list(r.check.faulty),
                "stragglers": list(r.check.stragglers),
                "results": [msgspec.to_builtins(x) for x in r.check.results],
            }
            if r.params is not None and r.params.network_check
            else None
        ),
        "end_reason": state.end_reason or None,
        "leader": state.leader or None,
        "epoch": state.epoch,
        "lease_holder": holder.master if holder else None,
        "last_decision_age_s": round(now - state.decided_at, 1) if state.decided_at else None,
        "applied_seq": state.applied_seq,
        "spec": msgspec.to_builtins(state.spec) if state.spec else None,
        "nodes": nodes,
        "counters": msgspec.to_builtins(state.counters),
        "recent_rejections": [
            {"stream": r.stream, "seq": r.stream_seq, "subject": r.subject, "error": r.error}
            for r in state.recent_rejections
        ],
    }


def _tf_view(r: Any) -> dict[str, Any] | None:
    """A TensorFlow job's tasks (roles, addresses) and the tasks restarted in place."""
    if r.params is None or not r.params.tf_ps:
        return None
    return {
        "tasks": [
            {"role": t.role, "index": t.index, "rank": t.rank, "node": t.node,
             "address": f"{t.addr}:{t.port}"}
            for t in r.tasks
        ],
        "restarts_by_role": dict(r.task_restarts.items()),
        "recent_restarts": [
            {"round": e.round, "role": e.role, "index": e.index, "node": e.node,
             "kind": e.kind.value, "reason": e.reason, "restarts": e.restarts}
            for e in r.recent_restarts
        ],
    }  # fmt: skip


def _tf_lines(tf: dict[str, Any]) -> list[str]:
    def name(t: dict[str, Any]) -> str:
        return t["role"] if t["role"] == "chief" else f"{t['role']} {t['index']}"

    tasks = "; ".join(f"{name(t)} on {t['node']} ({t['address']})" for t in tf["tasks"])
    lines = [f"tensorflow: {tasks or 'no round yet'}"]
    by_role = tf["restarts_by_role"]
    if by_role:
        counts = ", ".join(f"{n} {role}" for role, n in sorted(by_role.items()))
        lines.append(f"  restarted in place: {counts}")
        for e in tf["recent_restarts"][-3:]:
            lines.append(
                f"    round {e['round']}, {e['role']} {e['index']} on {e['node']}: {e['reason']}"
            )
    return lines


def _why_lines(nodes: list[dict[str, Any]], ending: str = "") -> list[str]:
    """Why the nodes marked * in the table are as they are: one line per reason, the
    nodes with the same one together (a table column would be as wide as the longest).
    A node that left saying the job's `ending` ("job J finished") left as the job ended:
    the first line says how."""
    by_reason: dict[str, list[str]] = {}
    for n in nodes:
        if n["reason"]:
            as_ended = ending and n["reason"].startswith(f"{ending}:")
            why = f"{n['status']} as the job ended" if as_ended else f"{n['status']}: {n['reason']}"
            by_reason.setdefault(why, []).append(n["node"])
    return [f"* {', '.join(names)} {why}" for why, names in by_reason.items()]


def _clock_lines(nodes: list[dict[str, Any]]) -> list[str]:
    """The nodes whose clocks are off the NATS server's (by 5 s or more): their
    heartbeat ages are read on the server's clock, but the times they stamp (their
    steps, their failures in `rove events`) are off by as much."""
    off = [
        f"{n['node']} {abs(n['clock_off_s']):g}s {'behind' if n['clock_off_s'] > 0 else 'ahead'}"
        for n in nodes
        if n.get("clock_off_s") is not None
    ]
    if not off:
        return []
    return [
        f"clocks off the NATS server's: {some(off)} (their heartbeats' stamps against when "
        "they were stored); the times they stamp are off by as much: set the machines' "
        "clocks right (NTP: chrony, timedatectl)"
    ]


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}MiB"


def _round_line(view: dict[str, Any]) -> str:
    restarts = (
        f"{view['restarts']} of {view['max_restarts']} restarts used"
        if view["max_restarts"] or view["restarts"]
        else "restarts off (--max-restarts 0)"
    )
    if view.get("port_rounds"):
        restarts += (
            f"; {counted(view['port_rounds'], 'round')} started again on fresh ports after "
            "a taken port (no restart spent)"
        )
    if view["phase"] in _ENDED:
        if not view["round"]:
            return "no round"
        return (
            f"ended after round {view['round']}; "
            f"{restarts if view['restarts'] or view.get('port_rounds') else 'no restart'}"
        )
    if view["round_active"]:
        text = (
            f"round {view['round']}: {counted(len(view['members']), 'node')}, world size "
            f"{view['world_size']}; {restarts}"
        )
    elif view["round"]:
        text = f"round {view['round']} broken, re-forming; {restarts}"
    else:
        text = "no round yet"
    if view["waiting"]:
        text += f"; waiting: {some(view['waiting'])}"
    return text


def _scaling_view(state: Any, waiting: Any, now: float) -> dict[str, Any] | None:
    s = state.scale
    w = s.workload
    if w is None:
        return None
    return {
        "min_nodes": w.min_nodes,
        "max_nodes": w.max_nodes,
        "target": s.target,
        "resources": w.resources.describe(),
        "slots": [
            {
                "node": x.node,
                "phase": x.phase.value,
                "resources": x.resources.describe(),
                "reason": x.reason,
                "unplaceable": x.unplaceable or None,
            }
            for x in sorted(s.slots.values(), key=lambda x: x.slot)
        ],
        "pending_plan": s.pending or None,
        "plans": [
            {
                "plan": p.plan,
                "rule": p.rule.value,
                "status": p.status.value,
                "reason": p.reason,
                "error": p.error or None,
                "launch": list(p.launch),
                "remove": list(p.remove),
                "age_s": round(now - p.ts, 1),
            }
            for p in s.recent
        ],
        "no_plan_yet": waiting.reason if waiting is not None and waiting.reason else None,
    }


def _scaling_lines(sc: dict[str, Any]) -> list[str]:
    live = [x for x in sc["slots"] if x["phase"] in ("launching", "joined")]
    lines = [
        f"scaling: {len(live)} of {sc['min_nodes']}-{sc['max_nodes']} nodes live "
        f"(target {sc['target']}), {sc['resources']} each"
        + (f"; plan {sc['pending_plan']} being applied" if sc["pending_plan"] else "")
    ]
    for p in sc["plans"][-5:]:
        what = " ".join(
            x
            for x in (
                f"+{','.join(p['launch'])}" if p["launch"] else "",
                f"-{','.join(p['remove'])}" if p["remove"] else "",
            )
            if x
        )
        error = f" ({p['error']})" if p["error"] else ""
        lines.append(
            f"  plan {p['plan']} {p['rule']} {p['status']}{error}, {p['age_s']:g}s ago: "
            f"{what}: {p['reason']}"
        )
    for x in live:
        if x.get("unplaceable"):
            lines.append(f"  {x['node']} cannot be placed: {x['unplaceable']}")
    if sc["no_plan_yet"]:
        lines.append(f"  no plan yet: {sc['no_plan_yet']}")
    return lines


_ENDED = frozenset(p.value for p in ev.JobPhase if p.terminal)
_NO_HOLDER = "nobody (failover in progress, or no master running)"


def _no_holder(view: dict[str, Any]) -> str:
    age = view.get("last_decision_age_s")
    if age is None or view["phase"] in _ENDED:
        return _NO_HOLDER
    return (
        f"nobody: no master has decided anything for {age:.0f}s (start one: "
        f"rove master --job {view['job']})"
        if age >= 60
        else _NO_HOLDER
    )


def _phase(view: dict[str, Any]) -> str:
    cut = view.get("cut_off")
    if cut is None:
        return str(view["phase"]) + (f" ({view['end_reason']})" if view["end_reason"] else "")
    heard = cut["last_heard"]
    at = f"; its last event at {words.local_time(heard)}" if heard is not None else ""
    return (
        f"{runs.CUT_OFF} while {view['phase']} ({runs.CUT_OFF_WHY}{at}). Run it again under "
        "the same --job to go on from the newest step its nodes find"
    )


def render(view: dict[str, Any], most: int | None = None) -> str:
    lines = [
        f"job {view['job']}"
        + (f" (run {view['run']})" if view.get("run", 1) > 1 else "")
        + f": {_phase(view)}",
        f"leader {view['leader'] or '(none elected yet)'}, epoch {view['epoch']}; "
        + (
            "no master runs: the job has ended"
            # (read from its stored events, no master can run: a lease key a master
            # killed left lives there until its TTL)
            if view["phase"] in _ENDED and (not view["lease_holder"] or view.get("stored"))
            else "no master runs: nothing keeps the job's server"
            if view.get("cut_off")
            else f"lease held by {view['lease_holder'] or _no_holder(view)}"
        ),
        f"{view['counters']['events']} events folded (stream seq {view['applied_seq']}), "
        f"{view['counters']['rejected']} rejected",
        _round_line(view),
    ]
    if view.get("stored"):
        lines.insert(1, f"(read from the job's stored events in {view['stored']})")
    if view["not_yet"]:
        n = view["not_yet"]
        lines.append(
            f"not yet: {n['reason']}" + (f" (in {n['in_s']:g}s)" if n["in_s"] is not None else "")
        )
    if view["last_failure"]:
        f = view["last_failure"]
        lines.append(
            f"last failure: rank {f['rank']} on {f['node']} in round {f['round']}: "
            + words.failure(f["kind"], f["reason"])
        )
    ended = view["phase"] in _ENDED
    cut = view.get("cut_off")
    heard = None if cut is None else cut["last_heard"]
    # (a dead run's slots stay in /dev/shm for the grace after its last touch, about its
    # last event: the next agent on the node reclaims them then)
    kept = None if heard is None else words.local_time(heard + shm_owner.grace_s())
    line = status_ckpt.line(view["checkpoints"], ended, kept)
    if line:
        lines.append(line)
    for ds in view["datasets"]:
        lines.append(status_data.dataset_line(ds, ended))
    for st in view["streams"]:
        lines.append(status_data.stream_line(st))
    if view["scaling"] is not None:
        lines.extend(_scaling_lines(view["scaling"]))
    check = view["network_check"]
    if check is not None:
        if not check["done"]:
            lines.append(f"network check: round {check['check_round']} running")
        else:
            times = ", ".join(
                f"{x['node']} {x['best_s']:.2f}s"
                if x["best_s"] is not None
                else f"{x['node']} failed"
                for x in check["results"]
            )
            lines.append(
                f"network check: {times}; faulty: {', '.join(check['faulty']) or '-'}; "
                f"stragglers: {', '.join(check['stragglers']) or '-'}"
            )
    if view["tensorflow"] is not None:
        lines.extend(_tf_lines(view["tensorflow"]))
    for node, why in view["excluded"].items():
        lines.append(f"excluded: {node}: {why}")
    lines.append("")
    header = [
        "NODE",
        "STATUS",
        "HOST",
        "PID",
        "HEARTBEAT",
        "RANKS",
        "STEP",
        "SAMPLES/S",
        "CPU%",
        "MEM",
    ]
    shown = first_nodes(view["nodes"], most)
    # (a node still active as the job was cut off has not said anything since)
    silent = [n["node"] for n in shown if view.get("cut_off") and n["status"] == "active"]
    rows = [
        [
            n["node"],
            n["status"] + ("*" if n["reason"] or n["node"] in silent else ""),
            n["host"],
            str(n["pid"]),
            "-" if n["last_heartbeat_age_s"] is None else f"{n['last_heartbeat_age_s']:g}s ago",
            _cell(n["ranks"]),
            _cell(n["step"]),
            _cell(n["samples_per_s"]),
            _cell(n["cpu_percent"]),
            _mib(n["mem_used_bytes"]),
        ]
        for n in shown
    ]
    if rows:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows]:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    else:
        lines.append("no nodes have joined")
    if len(rows) < len(view["nodes"]):
        lines.append(rest_line(view["nodes"], len(rows)))
    lines.extend(_why_lines(shown, f"job {view['job']} {view['phase']}" if ended else ""))
    if silent:
        lines.append(f"* {', '.join(silent)} active as the job was cut off: not heard from since")
    lines.extend(_clock_lines(view["nodes"]))
    if view["recent_rejections"]:
        lines.append("")
        lines.append("recently rejected messages:")
        for r in view["recent_rejections"][-5:]:
            lines.append(f"  {r['stream']} #{r['seq']} on {r['subject']}: {r['error']}")
    return "\n".join(lines) + "\n"
