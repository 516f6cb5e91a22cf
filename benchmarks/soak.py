"""Does every short job end? rove (warm start), rove (--no-warm-start) and torchrun run
the same short DDP jobs, interleaved, beside one CPU-bound process.

Each job is `benchmarks/ddp_tutorial.py 1` (the shape of pytorch/examples' DDP
tutorial: one epoch, 2 ranks, gloo) under `--standalone --nproc-per-node 2`. Each
rank prints `finished` as its `main` ends. A job *hangs* when it has not exited
`--hang-after` seconds (30) after the last rank's final line: the stacks of its
processes (py-spy) are printed to stderr and it is killed. A job that exits with
another status, or never gets to the end (`--job-timeout`), has *failed*.

Prints one JSON line: per launcher the runs, hangs, failures and median wall seconds
of the jobs that ended; torchrun is the baseline, and each rove launcher's median
wall is given as a ratio of torchrun's, from the same run.

    python benchmarks/soak.py --jobs 200
    python benchmarks/soak.py --jobs 20 --launchers rove --fail-on-hang   # in make test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common import cpu_bound_beside

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "ddp_tutorial.py"
BIN = Path(sys.executable).parent

LAUNCHERS = {
    "rove": [str(BIN / "rove"), "run", "--standalone", "--nproc-per-node", "2"],
    "rove-cold": [
        str(BIN / "rove"),
        *("run", "--standalone", "--nproc-per-node", "2", "--no-warm-start"),
    ],
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
}


@dataclass
class Tally:
    runs: int = 0
    hangs: int = 0
    failed: int = 0
    walls: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, object]:
        return {
            "runs": self.runs,
            "hangs": self.hangs,
            "failed": self.failed,
            "median_wall_s": round(statistics.median(self.walls), 2) if self.walls else None,
            "failures": self.failures[:5],
        }


def one_job(launcher: str, home: Path, hang_after: float, job_timeout: float) -> tuple[str, float]:
    """('ok' | 'hang' | 'failed: ...', wall seconds) of one job."""
    began = time.monotonic()
    proc = subprocess.Popen(
        [*LAUNCHERS[launcher], str(SCRIPT), "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "ROVE_HOME": str(home), "PYTHONUNBUFFERED": "1"},
    )
    finished: list[float] = []
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode(errors="replace")
            lines.append(line)
            if line.rstrip().endswith("] finished"):
                finished.append(time.monotonic())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while proc.poll() is None:
        now = time.monotonic()
        if len(finished) >= 2 and now - finished[-1] > hang_after:
            print(
                f"--- {launcher}: no exit {hang_after:g}s after the last rank's final line",
                file=sys.stderr,
            )
            print(stacks(proc.pid), file=sys.stderr, flush=True)
            kill(proc)
            return "hang", now - began
        if now - began > job_timeout:
            kill(proc)
            tail = "".join(lines[-5:]).strip().replace("\n", " | ")
            return f"failed: no end within {job_timeout:g}s: {tail[-300:]}", now - began
        time.sleep(0.05)
    reader.join(5)
    wall = time.monotonic() - began
    if proc.returncode != 0:
        tail = "".join(lines[-5:]).strip().replace("\n", " | ")
        return f"failed: exit {proc.returncode}: {tail[-300:]}", wall
    return "ok", wall


def stacks(pid: int) -> str:
    """The stacks of `pid` and its descendants (py-spy, native frames too)."""
    spy = shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")
    if spy is None:
        return "(py-spy is not installed)"
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return "(the job's processes are gone)"
    out = []
    for p in procs:
        try:
            if "python" not in p.name():
                continue
        except psutil.Error:
            continue
        dump = subprocess.run(
            [spy, "dump", "--native", "--pid", str(p.pid)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        out.append(dump.stdout + dump.stderr)
    return "\n".join(out)


def kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=20, help="jobs per launcher (default 20)")
    p.add_argument(
        "--launchers",
        default="rove,rove-cold,torchrun",
        help=f"comma-separated, of {', '.join(LAUNCHERS)} (default: all, interleaved)",
    )
    p.add_argument("--hang-after", type=float, default=30.0, metavar="SECONDS")
    p.add_argument("--job-timeout", type=float, default=300.0, metavar="SECONDS")
    p.add_argument(
        "--quiet-machine", action="store_true", help="without the CPU-bound process beside"
    )
    p.add_argument(
        "--fail-on-hang", action="store_true", help="exit 1 if a rove job hangs or fails"
    )
    args = p.parse_args()
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = sorted(set(launchers) - set(LAUNCHERS))
    if unknown:
        p.error(f"unknown launcher(s) {', '.join(unknown)}")
    tallies = {name: Tally() for name in launchers}
    with (
        cpu_bound_beside(not args.quiet_machine) as beside,
        tempfile.TemporaryDirectory(prefix="rove-soak-") as tmp,
    ):
        for i in range(args.jobs):
            for name in launchers:
                outcome, wall = one_job(name, Path(tmp) / "home", args.hang_after, args.job_timeout)
                t = tallies[name]
                t.runs += 1
                if outcome == "ok":
                    t.walls.append(wall)
                elif outcome == "hang":
                    t.hangs += 1
                else:
                    t.failed += 1
                    t.failures.append(outcome)
                if outcome != "ok":
                    print(f"job {i + 1} under {name}: {outcome}", file=sys.stderr, flush=True)
    result: dict[str, object] = {
        "benchmark": "soak",
        "jobs": args.jobs,
        "beside": beside,
        "hang_after_s": args.hang_after,
        "script": str(SCRIPT.relative_to(ROOT)),
        "launchers": {name: t.summary() for name, t in tallies.items()},
    }
    base = tallies.get("torchrun")
    if base is not None and base.walls:
        result["baseline"] = "torchrun"
        result["wall_ratio_to_torchrun"] = {
            name: round(statistics.median(t.walls) / statistics.median(base.walls), 2)
            for name, t in tallies.items()
            if name != "torchrun" and t.walls
        }
    print(json.dumps(result), flush=True)
    bad = sum(t.hangs + t.failed for name, t in tallies.items() if name.startswith("rove"))
    return 1 if args.fail_on_hang and bad else 0


if __name__ == "__main__":
    sys.exit(main())
