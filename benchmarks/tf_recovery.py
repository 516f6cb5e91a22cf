"""How long a TensorFlow parameter-server job stalls after a failure, under rove and by hand.

Both sides train the same job: examples/tf_ps.py's Keras model on generated
data, 1 parameter server + 2 workers + the coordinator on loopback, with a
checkpoint after every closure (`--window 1`).

- **rove** (`rove master` + `rove run --tf-ps`, over an embedded nats-server):
  - a worker is killed with -9: seconds to the next completed closure (the agent
    restarts the worker on its address; TensorFlow retries its closure);
  - the parameter server is killed with -9: seconds to the next completed
    closure (the master restarts the round; the coordinator restores its last
    committed checkpoint);
  - then the coordinator is killed with -9: the same.
  Each kill comes in the job's steady state: 20 s after its first step or the
  previous recovery, once its spares have imported TensorFlow.
- **by hand** (what a user without rove does once the job dies): the four
  processes are started again (`tf.distribute.Server`s and a plain coordinator
  with `tf.train.CheckpointManager`), the coordinator restoring the last
  checkpoint: seconds from the restart to the first completed closure. The
  time a person takes to notice and act is *not* counted: the figure is a
  lower bound for the manual path.

rove runs twice in the same run: with its spare tasks (the default) and with
`--no-warm-start` (every task of a new round a fresh process, as before spares).

Prints one JSON line with `worker_recover_s`, `ps_recover_s` and
`chief_recover_s` (with spares), the same without (`*_no_spares_s`),
`restart_job_s` (medians over `--repeats`), the ratios to the by-hand restart with
their target, and the runs they come from.

    python benchmarks/tf_recovery.py [--repeats 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import trace_rows, wait_for

from rove.agent.ports import free_ports

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "tf_ps.py"
QUIET = {"TF_CPP_MIN_LOG_LEVEL": "2"}
#: Seconds after the first step before the first kill, and after the worker's recovery
#: before the parameter server's (the steady state: the spares have imported TensorFlow).
STEADY_S = 20.0

# the same model and data as examples/tf_ps.py, without rove: a plain coordinator
MANUAL = r"""
import json, os, sys, time
import tensorflow as tf
ckdir, trace = sys.argv[1], sys.argv[2]
resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    model = tf.keras.Sequential(
        [tf.keras.layers.Dense(32, activation="relu"), tf.keras.layers.Dense(1)])
    model.build((None, 8))
    optimizer = tf.keras.optimizers.SGD(0.05)
    step = tf.Variable(0, dtype=tf.int64)
manager = tf.train.CheckpointManager(
    tf.train.Checkpoint(model=model, optimizer=optimizer, step=step), ckdir, max_to_keep=2)
if manager.latest_checkpoint:
    manager.checkpoint.restore(manager.latest_checkpoint).expect_partial()
truth = tf.constant([[0.5 * (i - 4)] for i in range(8)], tf.float32)
@tf.function
def train_shard(start):
    def sample(i):
        x = tf.random.stateless_normal([8], seed=tf.stack([i, tf.constant(0, tf.int64)]))
        return x, tf.matmul(x[None, :], truth)[0]
    def replica(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    total = tf.constant(0.0)
    for x, y in tf.data.Dataset.range(start, start + 96).map(sample).batch(32):
        total += strategy.run(replica, args=(x, y))
    return total
while True:
    k = int(step.numpy())
    coordinator.schedule(train_shard, args=(tf.constant(k * 96, tf.int64),))
    coordinator.join()
    step.assign_add(1)
    manager.save()
    with open(trace, "a") as f:
        f.write(json.dumps({"step": k + 1, "t": time.time()}) + "\n")
"""


def steps(trace: Path) -> list[dict[str, Any]]:
    return [r for r in trace_rows(trace) if "step" in r]


def next_step_after(trace: Path, t: float, timeout: float = 180) -> float:
    """Seconds from `t` to the first closure completed after it."""
    row = wait_for(
        lambda: next((r for r in steps(trace) if r["t"] > t), None), timeout, "a step completed"
    )
    return float(row["t"]) - t


def task_pids(url: str, job: str) -> list[int]:
    """The task pids of the newest round, by rank (from `rove events`)."""
    out = subprocess.run(
        [sys.executable, "-m", "rove.control.cli.main", "events", "--job", job, "--nats", url,
         "--type", "workers_started", "--json"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [json.loads(x) for x in out.splitlines() if x.strip()]
    return list(rows[-1]["pids"]) if rows else []


def rove_side(tmp: Path, url: str, repeat: int, spares: bool) -> tuple[float, float, float]:
    job = f"tfbench{repeat}{'' if spares else '-fresh'}"
    trace = tmp / f"{job}.jsonl"
    env = {**os.environ, **QUIET, "ROVE_LOG_LEVEL": "warning"}
    logs = tmp / f"{job}.log"
    with logs.open("wb") as out:
        master = subprocess.Popen(
            [sys.executable, "-m", "rove.control.cli.main", "master", "--job", job, "--nats", url],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        run = subprocess.Popen(
            [
                *(sys.executable, "-m", "rove.control.cli.main", "run", "--nats", url),
                *("--job", job, "--node-id", "n0", "--local-addr", "127.0.0.1"),
                *("--tf-ps", "--num-ps", "1", "--nproc-per-node", "4", "--max-restarts", "5"),
                *("--heartbeat-interval", "0.5", "--checkpoint-dir", str(tmp / f"{job}-ckpt")),
                *(() if spares else ("--no-warm-start",)),
                *(str(SCRIPT), "--samples", "1000000", "--shard-size", "96", "--window", "1"),
                *("--trace", str(trace)),
            ],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        wait_for(lambda: len(steps(trace)) >= 20, 240, "the rove job to train")
        # the failures come once the job is in its steady state: its spares (started at
        # the first step) have imported TensorFlow
        first = steps(trace)[0]["t"]
        time.sleep(max(0.0, first + STEADY_S - time.time()))
        pids = task_pids(url, job)
        killed = time.time()
        os.kill(pids[2], signal.SIGKILL)  # worker 0
        worker_s = next_step_after(trace, killed)
        done = len(steps(trace))
        wait_for(lambda: len(steps(trace)) >= done + 5, 120, "steady training after")
        # the steady state again: the spare the worker took is replaced and imported
        time.sleep(max(0.0, killed + worker_s + STEADY_S - time.time()))
        killed = time.time()
        os.kill(pids[1], signal.SIGKILL)  # the parameter server
        ps_s = next_step_after(trace, killed)
        time.sleep(max(0.0, killed + ps_s + STEADY_S - time.time()))
        coordinator = task_pids(url, job)[0]  # the new round's
        killed = time.time()
        os.kill(coordinator, signal.SIGKILL)
        chief_s = next_step_after(trace, killed)
        return worker_s, ps_s, chief_s
    except BaseException:
        sys.stderr.write(logs.read_text()[-4000:])
        raise
    finally:
        for p in (run, master):
            p.send_signal(signal.SIGTERM)
        for p in (run, master):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def manual_side(tmp: Path, repeat: int) -> float:
    """Train by hand, kill everything, start everything again: seconds to the next step."""
    ports = list(free_ports("127.0.0.1", 4))
    cluster = {
        "chief": [f"127.0.0.1:{ports[0]}"],
        "ps": [f"127.0.0.1:{ports[1]}"],
        "worker": [f"127.0.0.1:{ports[2]}", f"127.0.0.1:{ports[3]}"],
    }
    coordinator = tmp / "manual.py"
    coordinator.write_text(MANUAL)
    ckdir, trace = tmp / f"manual{repeat}-ckpt", tmp / f"manual{repeat}.jsonl"

    def start() -> list[subprocess.Popen[bytes]]:
        procs = []
        for role, index in (("ps", 0), ("worker", 0), ("worker", 1), ("chief", 0)):
            config = {"cluster": cluster, "task": {"type": role, "index": index},
                      "rpc_layer": "grpc"}  # fmt: skip
            env = {**os.environ, **QUIET, "TF_CONFIG": json.dumps(config),
                   "GRPC_FAIL_FAST": "use_caller"}  # fmt: skip
            argv = (
                [sys.executable, str(coordinator), str(ckdir), str(trace)]
                if role == "chief"
                else [sys.executable, "-m", "rove.agent.tf_server"]
            )
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        return procs

    def stop(procs: list[subprocess.Popen[bytes]]) -> None:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()

    procs = start()
    try:
        wait_for(lambda: len(steps(trace)) >= 20, 240, "the manual job to train")
    finally:
        stop(procs)
    restarted = time.time()
    procs = start()
    try:
        return next_step_after(trace, restarted)
    finally:
        stop(procs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", type=Path, help="keep the jobs' files and logs here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from rove.control.bus.embedded import EmbeddedServer

    worker, ps, chief, fresh, fresh_chief, manual = [], [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_) if args.work is None else args.work
        tmp.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(tmp / "nats")
        server.start()
        assert server.url is not None
        try:
            for r in range(args.repeats):
                w, p_, c = rove_side(tmp, server.url, r, spares=True)
                worker.append(w)
                ps.append(p_)
                chief.append(c)
                _, p_, c = rove_side(tmp, server.url, r, spares=False)
                fresh.append(p_)
                fresh_chief.append(c)
                manual.append(manual_side(tmp, r))
        finally:
            server.stop()
    med = statistics.median
    print(
        json.dumps(
            {
                "worker_recover_s": round(med(worker), 2),
                "ps_recover_s": round(med(ps), 2),
                "chief_recover_s": round(med(chief), 2),
                "ps_recover_no_spares_s": round(med(fresh), 2),
                "chief_recover_no_spares_s": round(med(fresh_chief), 2),
                "restart_job_s": round(med(manual), 2),
                "ps_vs_restart_ratio": round(med(ps) / med(manual), 3),
                "chief_vs_restart_ratio": round(med(chief) / med(manual), 3),
                "target_ratio": round(1 / 3, 3),
                "worker_s": [round(x, 2) for x in worker],
                "ps_s": [round(x, 2) for x in ps],
                "chief_s": [round(x, 2) for x in chief],
                "ps_no_spares_s": [round(x, 2) for x in fresh],
                "chief_no_spares_s": [round(x, 2) for x in fresh_chief],
                "restart_s": [round(x, 2) for x in manual],
                "note": "restart_job_s excludes the time a person takes to notice and act",
            }
        )
    )


if __name__ == "__main__":
    main()
