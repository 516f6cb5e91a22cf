"""Recovery after a worker is killed: torchrun vs rove, same script, same machine.

Every run trains `examples/train.py` and kills rank 1 with SIGKILL when it
reaches --kill-step. torchrun runs with torch.save checkpoints every
--ckpt-every steps (what a torchrun user has); rove runs the same, and with
flash checkpoints every step restored from memory (`_flash`),
with warm start (the default) and without it (`_cold`: --no-warm-start, every
worker a fresh interpreter).
Shapes: one node of 2 workers (`--standalone` for both launchers) and 2 nodes
x 2 workers (two agents each; torchrun with c10d rendezvous).

Each launcher runs --repeats times (interleaved); the JSON gives medians over
the trials that recovered and how many did. Measured per trial: `recovery_s`,
seconds from the kill to the first completed step after it; `regain_s`, seconds
from the kill until the step reached before the kill is trained again (the lost
work redone); `lost_steps`; and, for torchrun, the restarts it used (on this
machine a torchrun restart sometimes fails in gloo's connectFullMesh and needs
another, so it gets --torchrun-max-restarts). Then the seconds from kill -9 of
a leading `rove master` to its standby's first decision. Prints one JSON line.

    python benchmarks/recovery.py [--steps 120] [--kill-step 45]
"""

from __future__ import annotations

import argparse
import asyncio
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

from common import free_port, trace_rows

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.process import logs
from rove.control.process.aio import run as run_async

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"


def train_args(work: Path, steps: int, ckpt_every: int, sleep: float) -> list[str]:
    return [
        str(TRAIN),
        "--steps",
        str(steps),
        "--ckpt-every",
        str(ckpt_every),
        "--step-sleep",
        str(sleep),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--trace",
        str(work / "trace.jsonl"),
        "--log-every",
        "1000",
    ]


def kill_and_measure(
    procs: list[subprocess.Popen[bytes]],
    trace: Path,
    kill_step: int,
    timeout: float,
    recover_timeout: float,
) -> dict[str, Any]:
    deadline = time.time() + timeout
    victim = None
    while time.time() < deadline and victim is None:
        victim = next(
            (
                r
                for r in trace_rows(trace)
                if r["rank"] == 1 and r["step"] >= kill_step and r["restart"] == 0
            ),
            None,
        )
        time.sleep(0.01)
    if victim is None:
        raise RuntimeError("the job never reached the kill step")
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.time()
    finish_by = killed_at + recover_timeout
    for p in procs:
        try:
            p.wait(max(1, finish_by - time.time()))
        except subprocess.TimeoutExpired:
            pass
    still_running = [p for p in procs if p.poll() is None]
    for p in still_running:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
    all_rows = trace_rows(trace)
    before = max(r["step"] for r in all_rows if r["restart"] == 0)
    after = [r for r in all_rows if r["restart"] > 0]
    final = max(r["step"] for r in all_rows)
    codes = [p.returncode for p in procs]
    if not after or still_running:
        return {
            "recovered": False,
            "recovery_s": None,
            "regain_s": None,
            "lost_steps": None,
            "final_step": final,
            "exit_codes": codes,
        }
    first_after = min(after, key=lambda r: r["t"])
    regained = min((r["t"] for r in after if r["step"] >= before), default=None)
    return {
        "recovered": True,
        "recovery_s": round(first_after["t"] - killed_at, 3),
        "regain_s": round(regained - killed_at, 3) if regained is not None else None,
        "lost_steps": before - (first_after["step"] - 1),
        "restarts_used": first_after["restart"],
        "source": first_after.get("source"),
        "final_step": final,
        "exit_codes": codes,
    }


def summary(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the trials that recovered, and how many did."""
    ok = [t for t in trials if t["recovered"]]

    def median(key: str) -> Any:
        values = [t[key] for t in ok if t.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "recovered": f"{len(ok)}/{len(trials)}",
        "recovery_s": median("recovery_s"),
        "regain_s": median("regain_s"),
        "lost_steps_max": max((t["lost_steps"] for t in ok), default=None),
        "restarts_used_max": max((t["restarts_used"] for t in ok), default=None),
    }


def run_torchrun(work: Path, a: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """`nodes` torchrun agents with c10d rendezvous; with 1, torchrun --standalone."""
    port = free_port()
    procs = []
    for node_rank in range(nodes):
        if nodes == 1:
            rdzv = ["--standalone", "--nproc-per-node", "2"]
        else:
            rdzv = [
                "--nnodes",
                str(nodes),
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "bench",
            ]
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    *rdzv,
                    "--max-restarts",
                    str(a.torchrun_max_restarts),
                    *train_args(work, a.steps, a.ckpt_every, a.step_sleep),
                ],
                stdout=subprocess.DEVNULL,
                stderr=(work / f"torchrun{node_rank}.log").open("wb"),
            )
        )
    return kill_and_measure(procs, work / "trace.jsonl", a.kill_step, a.timeout, a.recover_timeout)


def run_rove(
    work: Path,
    url: str,
    a: argparse.Namespace,
    nodes: int,
    flash: bool = False,
    warm: bool = True,
) -> dict[str, Any]:
    """`nodes` rove agents and a rove master; with 1, rove run --standalone.

    `flash`: flash checkpoints every step (restore from memory) instead of torch.save.
    `warm`: warm start (the default; workers forked from a server that imported torch);
    else --no-warm-start (every worker a fresh interpreter).
    """
    rove = [sys.executable, "-m", "rove.control.cli.main"]
    job = f"bench-{work.name.replace('_', '-')}"
    env = {**os.environ, "ROVE_HOME": str(work / "home")}
    train = train_args(work, a.steps, 1 if flash else a.ckpt_every, a.step_sleep)
    # the checkpoint path alone is compared: data generated per step, as under torchrun
    train += ["--data", "generated", "--checkpoint", "flash" if flash else "torch"]
    train = ["--warm-start" if warm else "--no-warm-start", *train]
    master = None
    procs = []
    try:
        if nodes == 1:
            procs.append(
                subprocess.Popen(
                    [
                        *rove,
                        "run",
                        "--standalone",
                        "--job",
                        job,
                        "--nproc-per-node",
                        "2",
                        "--max-restarts",
                        "3",
                        *train,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=(work / "rove.log").open("wb"),
                    env=env,
                )
            )
        else:
            master = subprocess.Popen(
                [*rove, "master", "--job", job, "--nats", url],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
            )
            for node in range(nodes):
                procs.append(
                    subprocess.Popen(
                        [
                            *rove,
                            "run",
                            "--nats",
                            url,
                            "--job",
                            job,
                            "--node-id",
                            f"n{node}",
                            "--local-addr",
                            "127.0.0.1",
                            "--nnodes",
                            str(nodes),
                            "--nproc-per-node",
                            "2",
                            "--max-restarts",
                            "3",
                            *train,
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=(work / f"rove-n{node}.log").open("wb"),
                        env=env,
                    )
                )
        return kill_and_measure(
            procs, work / "trace.jsonl", a.kill_step, a.timeout, a.recover_timeout
        )
    finally:
        if master is not None:
            master.terminate()
            master.wait(30)


async def master_failover(url: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "rove.control.cli.main",
        "master",
        "--job",
        "failover",
        "--nats",
        url,
    ]
    masters = {
        m: subprocess.Popen([*cmd, "--id", m], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for m in ("ma", "mb")
    }
    bus = await Bus.connect(BusOptions(url=url))
    elected: list[tuple[float, ev.MasterElected]] = []

    def on(rec: Any) -> None:
        if isinstance(rec.event, ev.MasterElected):
            elected.append((time.time(), rec.event))

    try:
        feed = await bus.subscribe(
            subjects.EVENTS_STREAM, subjects.job_events("failover"), on, lambda r: None
        )
        while not elected:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)  # the standby is following
        masters[elected[0][1].master].kill()
        killed = time.time()
        while len(elected) < 2:
            await asyncio.sleep(0.005)
            if time.time() - killed > 60:
                raise RuntimeError("no standby took over")
        await feed.stop()
        return elected[1][0] - killed
    finally:
        await bus.close()
        for p in masters.values():
            p.terminate()
            p.wait(30)


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--kill-step", type=int, default=45)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument(
        "--recover-timeout",
        type=float,
        default=90,
        help="a launcher whose job has not finished this long after the kill did not recover",
    )
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--repeats", type=int, default=3, help="trials per launcher (default 3)")
    p.add_argument(
        "--torchrun-max-restarts",
        type=int,
        default=10,
        help="torchrun's --max-restarts (default 10: its restarts sometimes fail here)",
    )
    a = p.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = EmbeddedServer(root / "nats")
        url = server.start()
        try:
            runs: list[tuple[str, bool, int, bool, bool]] = [  # name, rove?, nodes, flash?, warm?
                ("torchrun_1x2", False, 1, False, False),
                ("rove_flash_1x2", True, 1, True, True),
                ("rove_flash_cold_1x2", True, 1, True, False),
                ("torchrun_2x2", False, 2, False, False),
                ("rove_2x2", True, 2, False, True),
                ("rove_flash_2x2", True, 2, True, True),
            ]
            trials: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in runs}
            for i in range(a.repeats):  # interleaved, so drift hits every launcher alike
                for name, is_rove, nodes, flash, warm in runs:
                    work = root / f"{name}-{i}"
                    work.mkdir()
                    if is_rove:
                        trials[name].append(run_rove(work, url, a, nodes, flash, warm))
                    else:
                        trials[name].append(run_torchrun(work, a, nodes))
            results = {name: summary(t) for name, t in trials.items()}
            failover = run_async(master_failover(url))
        finally:
            server.stop()

    def ratio(x: str, y: str) -> float | None:
        a_s, b_s = results[x]["recovery_s"], results[y]["recovery_s"]
        return None if a_s is None or b_s is None else round(a_s / b_s, 3)

    out: dict[str, Any] = {
        "benchmark": "recovery",
        "setup": "gloo on one machine; rank 1 killed with SIGKILL at step "
        f"{a.kill_step}; torch.save every {a.ckpt_every} steps, flash every step",
        # the figure: rove with flash checkpoints vs torchrun with torch.save
        "ratio_flash_1x2": ratio("rove_flash_1x2", "torchrun_1x2"),
        "ratio_flash_2x2": ratio("rove_flash_2x2", "torchrun_2x2"),
        "ratio_2x2": ratio("rove_2x2", "torchrun_2x2"),
        "ratio_flash_cold_1x2": ratio("rove_flash_cold_1x2", "torchrun_1x2"),
    }
    for name, r in results.items():
        for key, value in r.items():
            out[f"{name}_{key}"] = value
    out["master_failover_s"] = round(failover, 3)
    out["master_lease_ttl_s"] = 6.0
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
