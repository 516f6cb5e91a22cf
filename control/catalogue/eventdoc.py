"""Render the event catalogue as Markdown (`docs/events.md` is this module's output).

    python -m rove.control.catalogue.eventdoc > docs/events.md

The test suite regenerates it and fails when the checked-in file differs, so
the document cannot drift from the code.
"""

from __future__ import annotations

import enum
import inspect
import re
import sys
import typing

import msgspec

from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects

_ENVELOPE = ("job", "id", "producer", "ts")

_PLACEHOLDER = {str: "x", int: 0, float: 0.0, bytes: b"", bool: False}


def _subject(cls: type[ev.Event]) -> str:
    """The subject pattern of `cls`, from `subjects.subject_for` on a placeholder event."""
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for name, tp in hints.items():
        if name in cls.__struct_fields__:
            values[name] = _PLACEHOLDER.get(tp)
    values.update(job="JOB", id="x", producer="x")
    if "node" in cls.__struct_fields__:
        values["node"] = "NODE"
    if cls is ev.JobConfigured:
        values["spec"] = ev.JobSpec()
    if cls is ev.JobEnded:
        values["phase"] = ev.JobPhase.STOPPED
    if cls in (ev.WorkerExited, ev.TaskRestarted):
        values["kind"] = ev.FailureKind.UNKNOWN
    if cls is ev.ShardRequeued:
        values["reason"] = ev.RequeueReason.LEASE_EXPIRED
    for tuple_field in (
        "ranks",
        "pids",
        "members",
        "groups",
        "results",
        "faulty",
        "stragglers",
        "shards",
        "offsets",
    ):
        if tuple_field in cls.__struct_fields__:
            values[tuple_field] = ()
    if "dataset" in cls.__struct_fields__:
        values["dataset"] = "DATASET"
    if "client" in cls.__struct_fields__:
        values["client"] = "CLIENT"
    if cls is ev.DatasetRegistered:
        values["spec"] = ev.DatasetSpec(size=1, shard_size=1)
    if cls is ev.ShardDone:
        values["shard"] = ev.ShardRef(0)
    if cls is ev.JobSubmitted:
        values["workload"] = ev.Workload(argv=(), cwd="", min_nodes=1, max_nodes=1)
    if cls is ev.ScalePlan:
        values["rule"] = ev.ScaleRule.GROW
    if cls is ev.EventPart:
        values.update(kind="KIND", items=msgspec.Raw(b"\x90"))
    event = msgspec.convert(
        {k: v for k, v in values.items() if v is not None}, cls, from_attributes=True
    )
    subject = subjects.subject_for(event)
    for placeholder in ("JOB", "NODE", "DATASET", "CLIENT", "KIND"):
        subject = subject.replace(placeholder, f"<{placeholder.lower()}>")
    if cls is ev.EventPart:
        subject = subject.replace(".part.0", ".part.<index>")
    roots = {
        subjects.HEARTBEAT_ROOT: subjects.HEARTBEAT_STREAM,
        subjects.ANSWER_ROOT: subjects.ANSWER_STREAM,
    }
    stream = next(
        (name for root, name in roots.items() if subject.startswith(f"{root}.")),
        subjects.EVENTS_STREAM,
    )
    return f"`{subject}` (stream {stream})"


def _type_name(tp: object) -> str:
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp.__name__
    text = str(tp).replace("typing.", "")
    text = re.sub(r"rove\.control\.(catalogue\.)?\w+\.", "", text)  # (the catalogue's modules)
    text = text.replace("<class '", "").replace("'>", "")
    return text


def _fields(cls: type[msgspec.Struct]) -> list[tuple[str, str, str]]:
    hints = typing.get_type_hints(cls)
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    rows = []
    for f in info.fields:
        if f.name in _ENVELOPE or f.name == "epoch":
            continue
        if isinstance(f.default, enum.Enum):
            default = repr(f.default.value)
        elif f.default is not msgspec.NODEFAULT:
            default = repr(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            default = repr(f.default_factory())
        else:
            default = "required"
        rows.append((f.name, _type_name(hints[f.name]), default))
    return rows


def render() -> str:
    out = [
        "# Event catalogue",
        "",
        "Generated from `rove.control.catalogue.events` by",
        "`python -m rove.control.catalogue.eventdoc`; a test fails when this file and the",
        "code disagree.",
        "",
        "Every event carries the envelope `job`, `id` (deterministic, sent as",
        "`Nats-Msg-Id`), `producer` and `ts` (the producer's Unix time). Master",
        "decisions also carry `epoch`, the leader-lease revision of the master that",
        "made them. Events are msgpack-encoded tagged structs; the tag is in `type`.",
        "",
        "## Schema evolution",
        "",
        inspect.cleandoc(ev.__doc__ or "")
        .split("Schema evolution (the rule every change to this file follows):")[1]
        .strip(),
        "",
    ]
    groups: list[tuple[str, list[type[ev.Event]]]] = [
        (
            "Agent facts",
            [
                ev.NodeJoined,
                ev.NodeLeft,
                ev.Heartbeat,
                ev.RdzvJoined,
                ev.WorkersStarted,
                ev.TaskRestarted,
                ev.WorkerExited,
                ev.WorkersSucceeded,
                ev.TrainingProgress,
                ev.NetworkCheckReported,
                ev.CkptFound,
                ev.CkptInMemory,
                ev.CkptPersisted,
                ev.CkptFailed,
                ev.ReplicaStored,
                ev.NatsServerRestarted,
            ],
        ),
        (
            "Data clients (trainers)",
            [
                ev.DatasetRegistered,
                ev.ShardRequested,
                ev.ShardDone,
                ev.StreamCheckpointed,
                ev.RecordsUndecodable,
            ],
        ),
        ("Operator commands", [ev.StopRequested, ev.JobSubmitted, ev.ScaleRequested]),
        ("Scaler facts", [ev.PlanApplied, ev.PlanFailed, ev.NodeGone, ev.NodePending]),
        ("Stream bridges", [ev.StreamShardsAdded]),
        ("Master decisions", [c for c in ev.EVENT_TYPES.values() if issubclass(c, ev.Decision)]),
    ]
    listed = {c for _, cs in groups for c in cs}
    assert listed == set(ev.EVENT_TYPES.values()), "every event type belongs to a group"
    for title, classes in groups:
        out += [f"## {title}", ""]
        for cls in classes:
            tag = ev.kind(cls)
            subject = _subject(cls)
            out += [
                f"### `{tag}`",
                "",
                inspect.cleandoc(cls.__doc__ or ""),
                "",
                f"Subject: {subject}",
                "",
            ]
            rows = _fields(cls)
            if rows:
                out += ["| field | type | default |", "| --- | --- | --- |"]
                out += [f"| `{n}` | `{t}` | {d} |" for n, t, d in rows]
                out.append("")
    out += ["## Values used inside events", ""]
    for value_cls in (
        ev.JobSpec,
        ev.RdzvParams,
        ev.RoundMember,
        ev.CheckGroup,
        ev.NodeCheck,
        ev.RankStat,
    ):
        out += [f"### `{value_cls.__name__}`", "", inspect.cleandoc(value_cls.__doc__ or ""), ""]
        out += ["| field | type | default |", "| --- | --- | --- |"]
        out += [f"| `{n}` | `{t}` | {d} |" for n, t, d in _fields(value_cls)]
        out.append("")
    for enum_cls in (
        ev.JobPhase,
        ev.FailureKind,
        ev.RoundCause,
        ev.RestoreSource,
        ev.RequeueReason,
    ):
        values = ", ".join(f"`{m.value}`" if m.value else '`""`' for m in enum_cls)
        out += [f"`{enum_cls.__name__}`: {values}.", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
