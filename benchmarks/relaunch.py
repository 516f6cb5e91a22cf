"""Node replacement and OOM recovery by rove's scaler: from a node's death to full size.

A managed 2-node job (`rove submit`, `rove master`, `rove scaler`) trains
`examples/train_sharded.py` with leased data and flash checkpoints. When it
has trained --kill-step steps, the whole node n1-a0 (its `rove run` agent and
its workers) is killed with SIGKILL. Measured: seconds from the kill to the
first step trained again by a round of full size (2 nodes), with

* `pool_replace_s`: the replacement assigned to an idle `rove agent --pool`
  daemon already running (`--backend pool`), whose standby node (torch imported,
  its warm server started: `rove.agent.standby`) becomes the node;
* `fresh_replace_s`: the replacement started as a new `rove run` process by
  the local backend (`--backend local`).

`*_from_plan_s`: the same, from the master's plan that declared the node gone and
replaced it (the issue's measure) instead of from the kill. What a pool saves on a
cluster beyond this (a pod schedule and an image pull) is not part of this
measurement.
Then `oom_recover_s`: a 1-node job with `--node-memory 2G` whose worker needs
2.5 GiB at step 5: seconds from the worker's out-of-memory exit to the first
step of the node relaunched with 4 GiB. torchrun cannot replace a node at all
(its rendezvous waits for the same node to come back, or the job fails), which
is recorded as `torchrun_replace_s: null`.

Each measurement runs --repeats times; the JSON gives the median and all trials.

    python benchmarks/relaunch.py [--repeats 3]
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

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.process import logs
from rove.control.process.aio import run as run_async

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_sharded.py"
CLI = [sys.executable, "-m", "rove.control.cli.main"]


def spawn(work: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    with (work / f"{name}.log").open("ab") as out:
        return subprocess.Popen(
            [*CLI, *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=work,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


async def job_events(url: str, job: str) -> list[ev.AnyEvent]:
    """Every event of `job` stored now."""
    async with await Bus.connect(BusOptions(url=url)) as bus:
        got: list[Any] = []
        feed = await bus.subscribe(
            subjects.EVENTS_STREAM, subjects.job_events(job), got.append, lambda r: None
        )
        await feed.caught_up.wait()
        await feed.stop()
    return [r.event for r in got]


async def job_ended(url: str, job: str) -> ev.JobEnded | None:
    return next((e for e in await job_events(url, job) if isinstance(e, ev.JobEnded)), None)


async def plan_ts(url: str, job: str, since: float) -> float | None:
    """When the master decided the first scale plan after `since` (the node declared
    lost and its replacement planned in one decision)."""
    events = await job_events(url, job)
    plans = [e.ts for e in events if isinstance(e, ev.ScalePlan) and e.ts > since]
    return min(plans) if plans else None


async def worker_oom_ts(url: str, job: str) -> float | None:
    exits = [e.ts for e in await job_events(url, job) if isinstance(e, ev.WorkerExited)]
    return min(exits) if exits else None


def trial(
    work: Path, url: str, job: str, backend: str, kill_step: int, oom: bool
) -> tuple[float, float | None]:
    """(seconds from the failure to the first step at full size, and from the plan that
    replaced the node to it)."""
    trace = work / "trace.jsonl"
    procs = [spawn(work, "master", "master", "--job", job, "--nats", url, "--node-timeout", "20")]
    try:
        if backend == "pool":
            for a in ("a1", "a2", "a3"):
                procs.append(
                    spawn(
                        work,
                        f"agent-{a}",
                        "agent",
                        "--pool",
                        "bench",
                        "--id",
                        a,
                        "--nats",
                        url,
                        "--state-dir",
                        str(work / f"nodes-{a}"),
                    )
                )
            scaler = ["--backend", "pool", "--pool", "bench"]
        else:
            scaler = ["--state-dir", str(work / "nodes")]
        procs.append(spawn(work, "scaler", "scaler", "--job", job, "--nats", url, *scaler))
        submit = [
            "submit",
            "--job",
            job,
            "--nats",
            url,
            "--cwd",
            str(work),
            *(("--node-memory", "2G") if oom else ()),
            "--",
            "--nnodes",
            "1" if oom else "2",
            "--nproc-per-node",
            "1",
            "--checkpoint-dir",
            str(work / "ckpt"),
            "--last-call-timeout",
            "1",
            str(SCRIPT),
            "--samples",
            "3000",
            "--epochs",
            "1",
            "--step-sleep",
            "0.05",
            "--trace",
            str(trace),
            *(("--needs-memory", "2.5G") if oom else ()),
        ]
        subprocess.run([*CLI, *submit], check=True, capture_output=True, timeout=120)
        if oom:
            failed_at = wait_for(lambda: run_async(worker_oom_ts(url, job)), 180, "the OOM")
            since, full = failed_at, 1
        else:
            wait_for(
                lambda: max((r.get("step", 0) for r in trace_rows(trace)), default=0) >= kill_step,
                180,
                f"step {kill_step}",
            )
            markers = list(work.glob("nodes*/" + job + "/n1-a0.json"))
            pid = int(json.loads(markers[0].read_text())["pid"])
            since, full = time.time(), 2
            os.killpg(pid, signal.SIGKILL)

        def back() -> float | None:
            late = [r for r in trace_rows(trace) if "step" in r and r["t"] > since]
            worlds = {r["round"]: r["world"] for r in trace_rows(trace) if "world" in r}
            full_size = [r["t"] for r in late if worlds.get(r["round"]) == full and r["round"] > 1]
            return min(full_size) if full_size else None

        resumed = wait_for(back, 240, "training at full size again")
        wait_for(lambda: run_async(job_ended(url, job)), 300, "the job's end")
        planned = run_async(plan_ts(url, job, since))
        return round(resumed - since, 3), round(resumed - planned, 3) if planned else None
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for marker in work.glob("nodes*/*/*.json"):
            try:
                os.killpg(int(json.loads(marker.read_text())["pid"]), signal.SIGKILL)
            except (ProcessLookupError, PermissionError, ValueError, KeyError):
                pass


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=20)
    a = p.parse_args()
    logs.configure("warning")
    results: dict[str, list[float]] = {"pool": [], "fresh": [], "oom": []}
    from_plan: dict[str, list[float]] = {"pool": [], "fresh": [], "oom": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(os.environ.get("RELAUNCH_DIR") or tmp)
        print(f"working in {root}", file=sys.stderr, flush=True)
        os.environ["ROVE_HOME"] = str(root / "home")
        server = EmbeddedServer(root / "nats")
        server.start()
        assert server.url is not None
        try:
            n = 0
            for _ in range(a.repeats):
                for kind in ("pool", "fresh", "oom"):
                    n += 1
                    work = root / f"t{n}"
                    work.mkdir()
                    backend = "pool" if kind == "pool" else "local"
                    took, planned = trial(
                        work, server.url, f"bench{n}", backend, a.kill_step, kind == "oom"
                    )
                    results[kind].append(took)
                    if planned is not None:
                        from_plan[kind].append(planned)
                    print(f"{kind}: {took:.2f}s ({planned}s from the plan)", file=sys.stderr)
        finally:
            server.stop()
    return {
        "benchmark": "relaunch",
        "pool_replace_s": statistics.median(results["pool"]),
        "fresh_replace_s": statistics.median(results["fresh"]),
        "oom_recover_s": statistics.median(results["oom"]),
        "torchrun_replace_s": None,
        "torchrun_note": "torchrun cannot replace a node: its rendezvous waits for the "
        "same node to return (or the job fails)",
        "pool_replace_from_plan_s": _median(from_plan["pool"]),
        "fresh_replace_from_plan_s": _median(from_plan["fresh"]),
        "trials": results,
        "trials_from_plan": from_plan,
        # issue 24: a replaced node trains in < 2 s from its predecessor declared lost
        # (the replace plan); the pool agents keep a standby node ready
        "target_pool_replace_from_plan_s": 2.0,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
