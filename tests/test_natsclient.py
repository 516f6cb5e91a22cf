"""rove's tuned nats-py pieces read what nats-py would."""

from __future__ import annotations

from rove.control.bus.natsclient import ack_position


def test_ack_position_reads_v1_and_v2_reply_subjects() -> None:
    assert ack_position("$JS.ACK.ROVE_EVENTS.c1.1.42.40.1700000000000000000.7") == (42, 7)
    assert ack_position(b"$JS.ACK.dom.acchash.ROVE_EVENTS.c1.1.42.40.1700000000.7.tok") == (42, 7)
