"""The event catalogue: wire format, one decoder, schema evolution."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rove.control import events as ev
from tests import factories

DATA = Path(__file__).parent / "data"


def test_every_event_type_round_trips_through_msgpack() -> None:
    samples = factories.all_events()
    assert {ev.kind(e) for e in samples} == set(ev.EVENT_TYPES), "a sample per event type"
    for event in samples:
        assert ev.decode(ev.encode(event)) == event


def test_payloads_written_by_the_first_catalogue_still_decode() -> None:
    payloads = msgspec.msgpack.decode((DATA / "events_v1.msgpack").read_bytes())
    expected = json.loads((DATA / "events_v1.json").read_text())
    assert len(payloads) == len(expected) >= 9
    for payload, want in zip(payloads, expected, strict=True):
        event = ev.decode(payload)
        got = json.loads(msgspec.json.encode(event))
        assert {k: got[k] for k in want} == want, "v1 fields decode to the same values"
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
