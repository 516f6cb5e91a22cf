"""Recovery after a worker is killed: torchrun vs rove, 2 nodes x 2 workers, same script.

Both run `examples/train.py` (checkpoints with torch.save every --ckpt-every
steps) as two agents on this machine: torchrun with c10d rendezvous and
--max-restarts, rove with a `rove master` and two `rove run --nnodes 2`. When
rank 1 reaches --kill-step, it is killed with SIGKILL. Measured per launcher:
seconds from the kill to the first completed step after recovery, and steps
lost (trained before the kill and trained again after it). Then, separately,
the seconds from kill -9 of a leading `rove master` to its standby's first
decision (its `master_elected`). Prints one JSON line.

    python benchmarks/recovery.py [--steps 120] [--kill-step 40]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rove.control import events as ev
from rove.control import logs, subjects
from rove.control.aio import run as run_async
from rove.control.bus import Bus, BusOptions
from rove.control.embedded import EmbeddedServer

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rows(trace: Path) -> list[dict[str, Any]]:
    if not trace.exists():
        return []
    out = []
    for line in trace.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written right now
    return out


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
                for r in rows(trace)
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
    all_rows = rows(trace)
    before = max(r["step"] for r in all_rows if r["restart"] == 0)
    after = [r for r in all_rows if r["restart"] > 0]
    final = max(r["step"] for r in all_rows)
    codes = [p.returncode for p in procs]
    if not after or still_running:
        return {
            "recovered": False,
            "recovery_s": None,
            "lost_steps": None,
            "final_step": final,
            "exit_codes": codes,
        }
    first_after = min(after, key=lambda r: r["t"])
    return {
        "recovered": True,
        "recovery_s": round(first_after["t"] - killed_at, 3),
        "lost_steps": before - (first_after["step"] - 1),
        "final_step": final,
        "exit_codes": codes,
    }


def run_torchrun(work: Path, a: argparse.Namespace, nodes: int) -> dict[str, Any]:
    """`nodes` torchrun agents with c10d rendezvous; with 1, torchrun --standalone."""
    port = free_port()
    procs = []
    for node_rank in range(nodes):
        if nodes == 1:
            rdzv = ["--standalone", "--nproc-per-node", "4"]
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
                    "3",
                    *train_args(work, a.steps, a.ckpt_every, a.step_sleep),
                ],
                stdout=subprocess.DEVNULL,
                stderr=(work / f"torchrun{node_rank}.log").open("wb"),
            )
        )
    return kill_and_measure(procs, work / "trace.jsonl", a.kill_step, a.timeout, a.recover_timeout)


def run_rove(
    work: Path, url: str, a: argparse.Namespace, nodes: int, flash: bool = False
) -> dict[str, Any]:
    """`nodes` rove agents and a rove master; with 1, rove run --standalone.

    `flash`: flash checkpoints every step (restore from memory) instead of torch.save.
    """
    rove = [sys.executable, "-m", "rove.control.cli.main"]
    job = f"bench-{work.name.replace('_', '-')}"
    env = {**os.environ, "ROVE_HOME": str(work / "home")}
    train = train_args(work, a.steps, 1 if flash else a.ckpt_every, a.step_sleep)
    if flash:
        train.append("--flash")
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
                        "4",
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
    a = p.parse_args()
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = EmbeddedServer(root / "nats")
        url = server.start()
        results: dict[str, dict[str, Any]] = {}
        try:
            runs: list[tuple[str, bool, int, bool]] = [  # name, rove?, nodes, flash?
                ("torchrun", False, 2, False),
                ("rove", True, 2, False),
                ("rove_flash", True, 2, True),
                ("torchrun_1x4", False, 1, False),
                ("rove_1x4", True, 1, False),
            ]
            for name, is_rove, nodes, flash in runs:
                work = root / name
                work.mkdir()
                if is_rove:
                    results[name] = run_rove(work, url, a, nodes, flash)
                else:
                    results[name] = run_torchrun(work, a, nodes)
            failover = run_async(master_failover(url))
        finally:
            server.stop()

    def ratio(x: dict[str, Any], y: dict[str, Any]) -> float | None:
        if x["recovery_s"] is None or y["recovery_s"] is None:
            return None
        return round(x["recovery_s"] / y["recovery_s"], 3)

    t, r, t1, r1 = (results[k] for k in ("torchrun", "rove", "torchrun_1x4", "rove_1x4"))
    return {
        "benchmark": "recovery",
        "setup": "gloo on one machine, torch.save checkpoints every "
        f"{a.ckpt_every} steps, rank 1 killed with SIGKILL at step {a.kill_step}",
        # 2 nodes x 2 workers (two agents each)
        "torchrun_recovered": t["recovered"],
        "torchrun_recovery_s": t["recovery_s"],
        "rove_recovered": r["recovered"],
        "rove_recovery_s": r["recovery_s"],
        "ratio": ratio(r, t),
        "torchrun_lost_steps": t["lost_steps"],
        "rove_lost_steps": r["lost_steps"],
        "rove_flash_recovery_s": results["rove_flash"]["recovery_s"],
        "rove_flash_lost_steps": results["rove_flash"]["lost_steps"],
        "ratio_flash": ratio(results["rove_flash"], t),
        "torchrun_final_step": t["final_step"],
        "rove_final_step": r["final_step"],
        # 1 node x 4 workers (--standalone), where torchrun does recover
        "torchrun_1x4_recovery_s": t1["recovery_s"],
        "rove_1x4_recovery_s": r1["recovery_s"],
        "ratio_1x4": ratio(r1, t1),
        "torchrun_1x4_lost_steps": t1["lost_steps"],
        "rove_1x4_lost_steps": r1["lost_steps"],
        "master_failover_s": round(failover, 3),
        "master_lease_ttl_s": 6.0,
    }


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
