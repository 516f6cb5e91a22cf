"""The event catalogue: wire format, one decoder, schema evolution."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rove.control.catalogue import events as ev
from tests import factories

DATA = Path(__file__).parent / "data"


def test_every_event_type_round_trips_through_msgpack() -> None:
    samples = factories.all_events()
    assert {ev.kind(e) for e in samples} == set(ev.EVENT_TYPES), "a sample per event type"
    for event in samples:
        assert ev.decode(ev.encode(event)) == event


def _as_written(got: object, want: object) -> object:
    """`got` restricted to the fields `want` has, at every depth (later fields have defaults)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: _as_written(got[k], v) for k, v in want.items() if k in got}
    if isinstance(want, list) and isinstance(got, list):
        return [_as_written(g, w) for g, w in zip(got, want, strict=False)]
    return got


def test_payloads_written_by_the_first_catalogue_still_decode() -> None:
    payloads = msgspec.msgpack.decode((DATA / "events_v1.msgpack").read_bytes())
    expected = json.loads((DATA / "events_v1.json").read_text())
    assert len(payloads) == len(expected) >= 9
    for payload, want in zip(payloads, expected, strict=True):
        event = ev.decode(payload)
        got = json.loads(msgspec.json.encode(event))
        assert _as_written(got, want) == want, "v1 fields decode to the same values"
        fields, values = event.__struct_fields__, event.__struct_defaults__
        defaults = dict(zip(fields[len(fields) - len(values) :], values, strict=True))
        for added in set(got) - set(want):
            assert added in defaults, f"{added} was added without a default"


def test_unknown_fields_from_a_newer_writer_are_ignored() -> None:
    newer = msgspec.to_builtins(factories.joined("n1"))
    newer["gpu_model"] = "H200"  # a field a later version might add
    event = ev.decode(msgspec.msgpack.encode(newer))
    assert event == factories.joined("n1")


def test_unknown_tag_is_a_validation_error_naming_the_tag() -> None:
    body = msgspec.to_builtins(factories.joined("n1"))
    body["type"] = "node_teleported"
    with pytest.raises(msgspec.ValidationError, match="node_teleported"):
        ev.decode(msgspec.msgpack.encode(body))


def test_wrong_field_type_is_a_validation_error_with_its_path() -> None:
    body = msgspec.to_builtins(factories.joined("n1"))
    body["pid"] = "not-a-pid"
    with pytest.raises(msgspec.ValidationError, match=r"\$\.pid"):
        ev.decode(msgspec.msgpack.encode(body))


def test_garbage_bytes_are_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        ev.decode(b"\xc1\xc1 definitely not msgpack")


def test_tags_are_unique_and_events_are_frozen() -> None:
    tags = [ev.kind(cls) for cls in ev.EVENT_TYPES.values()]
    assert len(tags) == len(set(tags))
    event = factories.joined("n1")
    with pytest.raises(AttributeError):
        event.node = "n2"  # type: ignore[misc]


def test_decisions_carry_the_master_epoch() -> None:
    for event in factories.all_events():
        is_decision = isinstance(event, ev.Decision)
        assert is_decision == ("epoch" in event.__struct_fields__)


def test_new_fields_in_the_catalogue_have_defaults() -> None:
    """Schema-evolution rule: every field beyond those in v1 payloads has a default."""
    v1 = json.loads((DATA / "events_v1.json").read_text())
    v1_fields = {row["type"]: set(row) - {"type"} for row in v1}
    for tag, cls in ev.EVENT_TYPES.items():
        if tag not in v1_fields:
            continue  # a type added later: all its fields are new and that is fine
        required = set(
            cls.__struct_fields__[: len(cls.__struct_fields__) - len(cls.__struct_defaults__)]
        )
        assert required <= v1_fields[tag], (
            f"{tag} gained required fields {required - v1_fields[tag]}"
        )


def test_every_event_of_the_union_is_in_the_catalogue_by_its_tag() -> None:
    import typing

    assert set(ev.EVENT_TYPES.values()) == set(typing.get_args(ev.AnyEvent))
    assert all(ev.kind(cls) == tag for tag, cls in ev.EVENT_TYPES.items())


def test_a_strenum_field_reads_what_a_plain_string_field_wrote() -> None:
    import msgspec

    written = msgspec.msgpack.encode(
        {
            "type": "shard_requeued",
            "job": "j1",
            "id": "x",
            "producer": "master:m1",
            "ts": 1.0,
            "epoch": 1,
            "dataset": "d",
            "shards": [[3, 0]],
            "reason": "node_lost",
        }
    )
    event = ev.decode(written)
    assert isinstance(event, ev.ShardRequeued)
    assert event.reason is ev.RequeueReason.NODE_LOST
    assert ev.encode(event) == ev.encode(msgspec.structs.replace(event))
    assert msgspec.msgpack.decode(ev.encode(event))["reason"] == "node_lost"


def test_node_facts_share_one_envelope_builder() -> None:
    env = ev.node_envelope("j1", "n1", "inc7", 5.0, 42)
    fact = ev.WorkersSucceeded(**env, round=3)
    assert (fact.node, fact.incarnation, fact.id, fact.producer) == (
        "n1",
        "inc7",
        "n1:inc7:42",
        "agent:n1",
    )
    decision = ev.NodeExcluded(
        **ev.decision_envelope("j1", 9, "m1", 5.0, "excluded", "n1"),
        node="n1",
        incarnation="inc7",
        reason="r",
    )
    assert decision.id == "j1:9:excluded:n1" and decision.epoch == 9


def test_event_ids_differ_across_jobs_for_the_same_parts() -> None:
    """Regression: one stream holds every job, and the server drops a repeated
    Nats-Msg-Id: a second job's `job_submitted` (or plan outcome) was lost as a
    duplicate of the first job's."""
    a = ev.envelope("job-a", "cli", 1.0, "submitted")["id"]
    b = ev.envelope("job-b", "cli", 1.0, "submitted")["id"]
    assert a != b
    assert ev.envelope("job-a", "cli", 2.0, "submitted")["id"] == a, "still deterministic"
