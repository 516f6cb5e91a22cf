"""A TensorFlow task started before it is needed: `python -u -m rove.agent.tf_spare`.

Most of a TensorFlow task's start is importing TensorFlow: four tasks importing it at
once take about 7 s on 2 cores, and a parameter server's or the coordinator's failure
restarts every task of the round. So the TensorFlow runtime (`rove.agent.tf_runtime`)
keeps spares: processes that have imported TensorFlow and rove's TensorFlow pieces
and wait, reading stdin. A task is handed to a spare as one JSON line (`Handover`): the
task's whole environment and the module it runs. The spare takes that environment and
runs the module as `python -u -m MODULE ARGS` would: `rove.agent.tf_server` for a
parameter server or a worker, `rove.agent.child --run script SCRIPT ...` for the chief.

What this relies on of TensorFlow: importing it reads none of a task's own settings.
`TF_CONFIG` is read when the chief's resolver and a server are created, after the
hand-over. The settings TensorFlow may read once (`GRPC_FAIL_FAST`,
`TF_CPP_MIN_LOG_LEVEL`) are the same in every task and already in the spare's
environment.

A spare dies with its agent (`rove.agent.self_process.die_with_parent`), as every task does,
and ends at once when stdin closes without a task (the agent let it go).
"""

from __future__ import annotations

import json
import os
import runpy
import socket
import sys
import time
import warnings

import msgspec

from rove.agent.self_process import die_with_parent, title

#: Seconds a chief waits for its servers' ports before it lets TensorFlow connect anyway.
PEERS_WAIT_S = 30.0

#: What each spare imports before it waits: TensorFlow and what a chief imports of rove.
PRELOAD = ("tensorflow", "rove.agent.progress", "rove.checkpoint.tf", "rove.shard_service.tf")


class Handover(msgspec.Struct, frozen=True):
    """The task a spare becomes: its environment (whole) and `python -u -m module args`."""

    env: dict[str, str]
    module: str
    args: list[str]


def encode(h: Handover) -> bytes:
    return msgspec.json.encode(h) + b"\n"


def main() -> None:
    die_with_parent()
    # (set while the environment is still the one the process started with: the title's
    # first setting finds the command line's memory through it)
    title(" ".join([sys.executable, "-u", "-m", "rove.agent.tf_spare"]))
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")  # as in every task's environment
    # (TensorFlow reads its log level once, as it logs its first line at its import: the
    # task's, `worker_env.tf_env`, is the user's or this)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        os._exit(0)  # the agent let this spare go
    h = msgspec.json.decode(line, type=Handover)
    # stdin as a fresh task has it from the agent would be the agent's; the hand-over's
    # pipe is done with, and a task reading stdin reads an end
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(h.env)
    if os.environ.get("ROVE_TF_ROLE") == "chief":
        servers_listening(PEERS_WAIT_S)
    title(" ".join([sys.executable, "-u", "-m", h.module, *h.args]))
    sys.argv = [h.module, *h.args]
    with warnings.catch_warnings():
        # (runpy warns that the module was imported before: rove.agent.child is, by
        # this spare; running it as __main__ again is what is meant)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="runpy")
        runpy.run_module(h.module, run_name="__main__", alter_sys=True)


def servers_listening(timeout_s: float) -> bool:
    """Wait until every other task of the cluster (`TF_CONFIG`) accepts connections:
    a coordinator that connects before a server listens waits out gRPC's reconnect
    backoff (3 s measured here), longer than the servers' whole start from a spare.
    False when `timeout_s` passed first (TensorFlow then waits in its own way)."""
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    me = config.get("task", {})
    addresses = [
        address
        for role, tasks in config.get("cluster", {}).items()
        for i, address in enumerate(tasks)
        if (role, i) != (me.get("type"), me.get("index"))
    ]
    deadline = time.monotonic() + timeout_s
    for address in addresses:
        host, _, port = address.rpartition(":")
        while True:
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
    return True


if __name__ == "__main__":
    main()
