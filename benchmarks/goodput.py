"""Goodput under repeated failures: rove vs torchrun, same script, same schedule.

Both launchers train `examples/train.py` on one node of 2 workers for
--duration seconds, and a worker (a seeded random rank) is killed with SIGKILL
every --interval seconds from the launch. rove runs with flash checkpoints
every --ckpt-every steps restored from memory, warm start (its defaults) and
its own master; torchrun with torch.save every --ckpt-every steps (what a
torchrun user has). Then --dense-interval over --dense-duration: the same with
failures closer together.

Goodput is measured the same way for both, from the trainers' own trace (one
line per rank and step): the steps the final model contains (the lineage of
restores, followed back from the last process), times the run's median step
time, over the wall time from launch to stop. For rove, `rove goodput` reads
the same run from its event log (`rove_reported_goodput`, and its badput by
bucket) as a cross-check.

    python benchmarks/goodput.py [--interval 60] [--duration 300]

Prints one JSON line: `rove_goodput`, `torchrun_goodput`, `failures`, and the
same for the dense schedule; for each launcher where the rest of the wall time went
(`badput_s`: the first start, the restarts, steps rolled back, steps slower than the
median, the end), from the same trace, and each restart's gap (`restart_gaps_s`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import pid_alive, stop, trace_rows

from rove.control.bus.embedded import EmbeddedServer
from rove.control.process import logs

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "examples" / "train.py"
ROVE = [sys.executable, "-m", "rove.control.cli.main"]


def train_args(work: Path, a: argparse.Namespace, flash: bool) -> list[str]:
    args = [
        str(TRAIN),
        "--steps",
        "10000000",
        "--ckpt-every",
        str(a.ckpt_every),
        "--step-sleep",
        str(a.step_sleep),
        "--ckpt-dir",
        str(work / "ckpt"),
        "--trace",
        str(work / "trace.jsonl"),
        "--log-every",
        "100000",
    ]
    # the checkpoint path alone is compared: data generated per step, as under torchrun
    return [*args, "--data", "generated", "--checkpoint", "flash" if flash else "torch"]


def inflict(
    launcher: subprocess.Popen[bytes],
    trace: Path,
    interval: float,
    duration: float,
    seed: int,
) -> tuple[float, float, int]:
    """Kill a random rank's worker every `interval` s from now for `duration` s; stop the
    launcher at the end. (launch time, stop time, kills)."""
    rng = random.Random(seed)
    began = time.time()
    kills = 0
    next_kill = began + interval
    while time.time() < began + duration:
        if launcher.poll() is not None:
            raise RuntimeError(f"the launcher exited early with {launcher.returncode}")
        if time.time() >= next_kill:
            rank = rng.randrange(2)
            mine = [r for r in trace_rows(trace) if r["rank"] == rank]
            newest = max(mine, key=lambda r: r["t"], default=None)
            if newest is not None and pid_alive(newest["pid"]):
                os.kill(newest["pid"], signal.SIGKILL)
                kills += 1
                next_kill += interval
        time.sleep(0.05)
    stopped = time.time()
    stop(launcher)
    return began, stopped, kills


def trace_goodput(all_rows: list[dict[str, Any]], began: float, stopped: float) -> dict[str, Any]:
    """Steps in the final lineage times the median step time, over the wall time (rank 0),
    and where the rest of the wall time went (`badput_s`, from the same trace):

    - `first_start`: from the launch to the first step's end (a step's own time is
      counted as one median step);
    - `restarts`: from the last step of a process to the first step of the next one,
      less one median step, summed over the restarts;
    - `lost_steps`: steps trained and rolled back (not in the final lineage);
    - `slow_steps`: the steps' time over the median (checkpoint saves, the machine's
      noise, a failing peer's last step);
    - `after_last_step`: from the last step to the stop.
    """
    r0 = sorted((r for r in all_rows if r["rank"] == 0 and r["t"] <= stopped), key=lambda r: r["t"])
    attempts: dict[int, list[tuple[int, float]]] = {}
    for r in r0:
        attempts.setdefault(r["pid"], []).append((r["step"], r["t"]))
    ordered = sorted(attempts.values(), key=lambda steps: steps[0][1])
    gaps = [
        b[1] - a[1] for steps in ordered for a, b in itertools.pairwise(steps) if b[0] == a[0] + 1
    ]
    step_s = statistics.median(gaps) if gaps else 0.0
    kept = 0
    limit = float("inf")
    for steps in reversed(ordered):
        kept += sum(1 for s, _ in steps if s <= limit)
        limit = min(limit, steps[0][0] - 1)
    wall = stopped - began
    restarts = [b[0][1] - a[-1][1] for a, b in itertools.pairwise(ordered)]
    badput = {}
    if ordered:
        badput = {
            "first_start": ordered[0][0][1] - began - step_s,
            "restarts": sum(restarts) - step_s * len(restarts),
            "lost_steps": (len(r0) - kept) * step_s,
            "slow_steps": sum(
                b[1] - a[1] - step_s for steps in ordered for a, b in itertools.pairwise(steps)
            ),
            "after_last_step": stopped - ordered[-1][-1][1],
        }
    return {
        "goodput": round(kept * step_s / wall, 4) if wall > 0 else 0.0,
        "kept_steps": kept,
        "trained_steps": len(r0),
        "step_s": round(step_s, 4),
        "processes": len(ordered),
        "restart_gaps_s": [round(g, 3) for g in restarts],
        "badput_s": {k: round(v, 3) for k, v in badput.items()},
    }


def run_torchrun(
    work: Path, a: argparse.Namespace, interval: float, duration: float
) -> dict[str, Any]:
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1000",
            *train_args(work, a, flash=False),
        ],
        stdout=subprocess.DEVNULL,
        stderr=(work / "torchrun.log").open("wb"),
        start_new_session=True,
    )
    began, stopped, kills = inflict(launcher, work / "trace.jsonl", interval, duration, a.seed)
    log = (work / "torchrun.log").read_text(errors="replace")
    return {
        "failures": kills,
        **trace_goodput(trace_rows(work / "trace.jsonl"), began, stopped),
        # restarts that failed before a step: gloo could not connect to a peer
        "gloo_connect_failures": log.count("connectFullMesh failed"),
    }


def run_rove(
    work: Path, url: str, a: argparse.Namespace, interval: float, duration: float
) -> dict[str, Any]:
    job = f"goodput-{work.name}"
    env = {**os.environ, "ROVE_HOME": str(work / "home")}
    master = subprocess.Popen(
        [*ROVE, "master", "--job", job, "--nats", url],
        stdout=subprocess.DEVNULL,
        stderr=(work / "master.log").open("wb"),
        env=env,
    )
    try:
        launcher = subprocess.Popen(
            [
                *ROVE,
                "run",
                "--nats",
                url,
                "--job",
                job,
                "--node-id",
                "n0",
                "--local-addr",
                "127.0.0.1",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "1000",
                *train_args(work, a, flash=True),
            ],
            stdout=subprocess.DEVNULL,
            stderr=(work / "rove.log").open("wb"),
            env=env,
            start_new_session=True,
        )
        began, stopped, kills = inflict(launcher, work / "trace.jsonl", interval, duration, a.seed)
        measured = trace_goodput(trace_rows(work / "trace.jsonl"), began, stopped)
        window = ("--since", _iso(began), "--until", _iso(stopped))
        out = subprocess.run(
            [*ROVE, "goodput", "--job", job, "--nats", url, "--json", *window],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        reported = json.loads(out.stdout)
        badput = {k: v for k, v in reported["buckets"].items() if k != "productive" and v}
        return {
            "failures": kills,
            **measured,
            "rove_reported_goodput": reported["goodput"],
            "rove_reported_badput_s": badput,
        }
    finally:
        master.terminate()
        master.wait(30)


def _iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat()


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interval", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--duration", type=float, default=300.0, help="seconds each run trains")
    p.add_argument("--dense-interval", type=float, default=15.0)
    p.add_argument("--dense-duration", type=float, default=120.0)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--work", type=Path, help="keep traces and logs here (default: a temp dir)")
    a = p.parse_args()
    logs.configure("warning")  # stdout is the JSON line alone
    result: dict[str, Any] = {"workers": 2, "ckpt_every": a.ckpt_every}
    with tempfile.TemporaryDirectory(prefix="rove-goodput-") as tmp:
        root = a.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        server = EmbeddedServer(root / "nats")
        url = server.start()
        try:
            for label, interval, duration in (
                ("", a.interval, a.duration),
                ("dense_", a.dense_interval, a.dense_duration),
            ):
                if duration <= 0:
                    continue
                rove_work = root / f"{label}rove"
                torch_work = root / f"{label}torchrun"
                rove_work.mkdir()
                torch_work.mkdir()
                r = run_rove(rove_work, url, a, interval, duration)
                t = run_torchrun(torch_work, a, interval, duration)
                result.update(
                    {
                        f"{label}interval_s": interval,
                        f"{label}duration_s": duration,
                        f"{label}failures": r["failures"],
                        f"{label}rove_goodput": r["goodput"],
                        f"{label}torchrun_goodput": t["goodput"],
                        f"{label}ratio": round(r["goodput"] / t["goodput"], 3)
                        if t["goodput"]
                        else None,
                        f"{label}rove_reported_goodput": r["rove_reported_goodput"],
                        f"{label}rove": r,
                        f"{label}torchrun": t,
                    }
                )
        finally:
            server.stop()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
