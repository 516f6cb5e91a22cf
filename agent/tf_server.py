"""A TensorFlow parameter server or worker task: `python -m rove.agent.tf_server`.

The agent runs one per `ps` and `worker` task of a TensorFlow round, with
`TF_CONFIG` naming the cluster and the task. It serves the task with
`tf.distribute.Server` (gRPC) until it is stopped: the chief's
`ClusterCoordinator` places variables on the parameter servers and runs its
closures on the workers. It holds nothing that must survive it: a worker
restarted on the same address rejoins the coordinator by itself, and a
parameter server's variables are restored by the coordinator from its
checkpoint.

A task whose port was taken (by another process, between the node's offer and the
task's start) says so and exits `PORT_TAKEN`: started again on the same address it
would fail the same way, so the runtime fails the round instead, and the next round's
tasks serve on ports offered afresh.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from rove.agent.ports import taken

#: the exit code of a task whose port another process took between the node's offer and
#: the task's start (sysexits' EX_TEMPFAIL): a worker is not started again on it
PORT_TAKEN = 75


def main() -> None:
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    config = json.loads(os.environ["TF_CONFIG"])
    task = config["task"]
    began = time.monotonic()
    import tensorflow as tf

    # ROVE_TF_THREADS caps the threads one op may use (0: TensorFlow's choice); the
    # threads running ops side by side are left to TensorFlow, since too few of them
    # deadlock a worker running a closure's dataset and its remote ops
    threads = int(os.environ.get("ROVE_TF_THREADS", "0"))
    try:
        server = tf.distribute.Server(
            tf.train.ClusterSpec(config["cluster"]),
            job_name=task["type"],
            task_index=task["index"],
            protocol="grpc",
            config=tf.compat.v1.ConfigProto(intra_op_parallelism_threads=threads),
            start=True,
        )
    except tf.errors.UnknownError:  # "Could not start gRPC server": is its port taken?
        port = int(config["cluster"][task["type"]][task["index"]].rpartition(":")[2])
        if not taken(port):
            raise
        print(
            f"rove: {task['type']} {task['index']} cannot serve: port {port} of this node "
            "is taken by another process (Address already in use); the round starts "
            "again on fresh ports",
            flush=True,
        )
        sys.exit(PORT_TAKEN)
    print(
        f"rove: {task['type']} {task['index']} serving at {server.target} "
        f"(up in {time.monotonic() - began:.1f}s)",
        flush=True,
    )
    # SIGTERM (the agent stopping the round) and SIGINT (a Ctrl-C `rove run` passes on as
    # received) end the task at once: a server has no state of its own to save. The
    # default action, not a Python handler: the main thread waits inside TensorFlow's
    # join, where no Python handler ever runs (Python's own for SIGINT, or one here, made
    # every server wait out the agent's grace period for a SIGKILL: a Ctrl-C took 10 s)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.join()
    sys.exit(f"the {task['type']} {task['index']} server stopped serving")


if __name__ == "__main__":
    main()
