"""The heartbeat interval rove picks for a job's size, and the flag that overrides it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rove.agent.heartbeat import HEARTBEATS_PER_S, interval_for
from rove.agent.launcher import agent_config
from rove.agent.run_args import build_parser

SCRIPT = str(Path(__file__).parent.parent / "examples" / "train.py")


@pytest.mark.parametrize(
    ("max_nodes", "timeout", "interval"),
    [
        (1, 30.0, 1.0),
        (25_000, 30.0, 1.0),
        (50_000, 30.0, 2.0),
        (100_000, 30.0, 4.0),
        (200_000, 30.0, 6.0),  # a fifth of the node timeout at most
        (100_000, 3.0, 1.0),  # never under a second
    ],
)
def test_the_interval_keeps_a_job_to_its_heartbeats_a_second(
    max_nodes: int, timeout: float, interval: float
) -> None:
    assert interval_for(max_nodes, timeout) == interval
    if interval < timeout / 5:
        assert max_nodes / interval <= HEARTBEATS_PER_S


def _cfg(*flags: str) -> float:
    args = build_parser().parse_args(
        ["--nats", "nats://127.0.0.1:4222", "--rdzv-id", "big", *flags, SCRIPT]
    )
    return agent_config(args)[0].heartbeat_s


def test_rove_run_takes_the_interval_from_nnodes_unless_it_is_given() -> None:
    assert _cfg("--nnodes", "2:4") == 1.0
    assert _cfg("--nnodes", "1:50000") == 2.0
    assert _cfg("--nnodes", "1:50000", "--heartbeat-interval", "0.5") == 0.5
    assert _cfg("--nnodes", "1:100000", "--node-timeout", "10") == 2.0
