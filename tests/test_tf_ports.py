"""A TensorFlow worker whose port another process took fails its round at once.

Real processes: a worker task (`rove.agent.tf_server`, TensorFlow's gRPC server) is
started on a port this test listens on. Started again on the same address it would fail
the same way until its restarts ran out, and the failure read as the user's code
(`UnknownError: Could not start gRPC server`, a repeat of which fails a job fast).
Instead the task says which port was taken, exits `PORT_TAKEN`, and the round fails
with a diagnosis worth a new round (whose ports are offered afresh), with no restart
in place.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import pytest

from rove.agent.runtime import TaskRestart
from rove.agent.tf_runtime import INDEX_ENV, ROLE_ENV, TfRuntime
from rove.agent.tf_server import PORT_TAKEN
from rove.control.catalogue.events import FailureKind


@pytest.mark.slow
async def test_a_worker_whose_port_is_taken_fails_the_round_instead_of_restarting(
    tmp_path: Path,
) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        config = {
            "cluster": {"chief": ["127.0.0.1:1"], "worker": [f"127.0.0.1:{port}"]},
            "task": {"type": "worker", "index": 0},
            "rpc_layer": "grpc",
        }
        restarts: list[TaskRestart] = []
        rt = TfRuntime(
            [sys.executable, "-c", "pass"],
            tmp_path / "logs",
            tmp_path / "progress",
            max_restarts=3,
            echo=sys.stderr,
            spares=False,
        )
        rt.listener = restarts.append
        try:
            rt.start(1, {0: {ROLE_ENV: "worker", INDEX_ENV: "0", "TF_CONFIG": json.dumps(config)}})
            ended = await asyncio.wait_for(rt.wait(), 120)
        finally:
            rt.stop()
            rt.close()
    log = (tmp_path / "logs" / "round1" / "rank0.stdout").read_text()
    assert ended.round == 1 and ended.failure is not None, log
    assert ended.failure.exit_code == PORT_TAKEN, log
    assert restarts == [], "never started again on the address it cannot serve on"
    assert ended.failure.diagnosis.kind is FailureKind.COMMUNICATION
    assert f"port {port} of this node is taken" in ended.failure.diagnosis.reason
    assert f"port {port} of this node is taken by another process" in log
    assert ended.failure.port_taken == port, "the port rove's pick lost: no restart spent"
