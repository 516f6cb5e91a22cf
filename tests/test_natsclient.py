"""rove's tuned nats-py pieces read what nats-py would."""

from __future__ import annotations

import pytest

from rove.control.bus.natsclient import ack_position, stored_time


def test_ack_position_reads_v1_and_v2_reply_subjects() -> None:
    v1 = "$JS.ACK.ROVE_EVENTS.c1.1.42.40.1700000000250000000.7"
    assert ack_position(v1) == (42, 7)
    assert stored_time(v1) == pytest.approx(1700000000.25, abs=1e-6)
    v2 = b"$JS.ACK.dom.acchash.ROVE_EVENTS.c1.1.42.40.1700000000000000000.7.tok"
    assert ack_position(v2) == (42, 7)
    assert stored_time(v2) == pytest.approx(1700000000.0, abs=1e-6)
