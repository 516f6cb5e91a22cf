"""Readable renderings of events for `rove events`, and of long lists for `rove status`
(pure functions): no line grows with the cluster."""

from __future__ import annotations

import datetime as dt
from typing import Any

import msgspec

from rove.control.bus.records import Recorded
from rove.control.catalogue import events as ev
from rove.control.domain import words
from rove.control.process.logs import SHOWN as SHOWN
from rove.control.process.logs import some as some

_COMMON = {"job", "id", "producer", "ts", "epoch"}


_TIMES = {"last_seen", "at", "first_at"}


def _value(v: Any, key: str = "") -> str:
    if key in _TIMES and isinstance(v, float):
        return dt.datetime.fromtimestamp(v).strftime("%H:%M:%S.%f")[:-3]
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    if isinstance(v, float):
        return f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, tuple | list) and len(v) > SHOWN:
        head = msgspec.json.encode(list(v[:3])).decode()[:-1]
        return f"{head},...]({len(v):,} in all)"
    if isinstance(v, msgspec.Struct | tuple | list | dict):
        return msgspec.json.encode(v).decode()
    text = str(v)
    return text if text and " " not in text else repr(text)


def key_fields(event: ev.Event) -> dict[str, Any]:
    """The fields that say what this event is about (everything but the envelope)."""
    fields = {f: getattr(event, f) for f in event.__struct_fields__ if f not in _COMMON}
    match event:
        case ev.ScalePlan():
            fields["launch"] = ",".join(_launch(n) for n in event.launch) or None
            fields["remove"] = ",".join(event.remove) or None
            fields["speed"] = event.speed or None
        case ev.JobSubmitted(workload=w):
            del fields["workload"]
            fields["nodes"] = f"{w.min_nodes}-{w.max_nodes}"
            fields["each"] = w.resources.describe()
            fields["runs"] = " ".join(w.argv)
        case ev.PlanApplied() | ev.PlanFailed():
            fields["created"] = ",".join(event.created) or None
            fields["removed"] = ",".join(event.removed) or None
    return fields


def _launch(n: ev.NodeLaunch) -> str:
    extra = ", ".join(
        x for x in (n.resources.describe(), f"replaces {n.replaces}" if n.replaces else "") if x
    )
    return f"{n.node}({extra})"


def event_line(rec: Recorded) -> str:
    e = rec.event
    when = words.local_time(e.ts, millis=True)
    fields = " ".join(
        f"{k}={_value(v)}" for k, v in key_fields(e).items() if v not in (None, "", ())
    )
    if isinstance(e, ev.Decision):
        fields = f"epoch={e.epoch} {fields}".rstrip()
    return f"{when}  #{rec.seq:<6} {e.producer:<24} {ev.kind(e):<16} {fields}"


def event_json(rec: Recorded) -> bytes:
    body = msgspec.to_builtins(rec.event)
    return msgspec.json.encode({"seq": rec.seq, "subject": rec.subject, **body})


#: How many nodes `rove status` lists unless asked for all (`--all`).
NODE_ROWS = 50


def first_nodes(nodes: list[dict[str, Any]], most: int | None) -> list[dict[str, Any]]:
    """The nodes of `rove status` a person should see first, at most `most` (None: all,
    in name order): those not active, then those heard from longest ago."""
    if most is None or len(nodes) <= most:
        return nodes

    def concern(n: dict[str, Any]) -> tuple[bool, float, str]:
        age = n["last_heartbeat_age_s"]
        return (n["status"] == "active", -(age if age is not None else float("inf")), n["node"])

    return sorted(nodes, key=concern)[:most]


def rest_line(nodes: list[dict[str, Any]], shown: int) -> str:
    """What the nodes not listed are, by status."""
    counts: dict[str, int] = {}
    for n in nodes:
        counts[n["status"]] = counts.get(n["status"], 0) + 1
    by_status = ", ".join(f"{c:,} {s}" for s, c in sorted(counts.items()))
    return (
        f"... {len(nodes) - shown:,} more nodes not listed ({len(nodes):,} in all: {by_status}); "
        "--all lists every one, --json gives them as data"
    )
