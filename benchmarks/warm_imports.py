"""A warm restart of a script with heavy imports: rove with learned imports, rove with
only its preloads (`--no-learn-imports`), and torchrun, same script, same machine.

The script (`benchmarks/warm_imports_script.py`) trains a tiny GPT-2 with the
HuggingFace `Trainer` on 2 ranks (`--standalone --nproc-per-node 2`): most of its start
is importing `transformers` and what it pulls in. Each trial waits until the job is in
its steady state (--kill-step reached, and for rove the warm server a restart would
fork from ready: the one that learned the workers' imports, or the full one), kills
rank 1 with SIGKILL, and measures `recovery_s`, from the kill to the first step a
restarted rank completed, and that rank's own `imports_s` (0 where it found them
imported). Launchers interleaved, --repeats times; prints one JSON line with the
medians, and rove's ratio to each baseline from the same run.

    python benchmarks/warm_imports.py [--repeats 3] [--kill-step 60]
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
import time
from pathlib import Path
from typing import Any

from common import stop, trace_rows, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "warm_imports_script.py"
BIN = Path(sys.executable).parent
CASES = {
    "rove": [str(BIN / "rove"), "run", "--max-restarts", "1"],
    "rove_preloads_only": [str(BIN / "rove"), "run", "--max-restarts", "1", "--no-learn-imports"],
    "torchrun": [str(BIN / "torchrun"), "--max-restarts", "1"],
}
#: the warm server a restart forks from, by case (its ready file, under TMPDIR)
READY = {"rove": "rove-warm-learned-*/ready", "rove_preloads_only": "rove-warm-full-*/ready"}


def trial(case: str, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    work.mkdir(parents=True)
    trace = work / "trace.jsonl"
    scratch = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))  # (AF_UNIX paths are short)
    env = {**os.environ, "ROVE_HOME": str(work / "home"), "TMPDIR": str(scratch)}
    cmd = [*CASES[case], "--standalone", "--nproc-per-node", "2", str(SCRIPT), str(trace)]
    cmd += ["--step-sleep", str(a.step_sleep)]
    with (work / "launcher.log").open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            return _kill_and_measure(case, proc, trace, scratch, a)
        finally:
            stop(proc)
            shutil.rmtree(scratch, ignore_errors=True)


def _kill_and_measure(
    case: str, proc: subprocess.Popen[bytes], trace: Path, scratch: Path, a: argparse.Namespace
) -> dict[str, Any]:
    def victim() -> dict[str, Any] | None:
        return next(
            (r for r in trace_rows(trace) if r["rank"] == 1 and r["step"] >= a.kill_step), None
        )

    row = wait_for(victim, a.timeout, f"{case}: step {a.kill_step}")
    if case in READY:
        wait_for(lambda: list(scratch.glob(READY[case])), a.timeout, f"{case}: its warm server")
    first = [r for r in trace_rows(trace) if r["restart"] == 0 and r["step"] == 1]
    os.kill(row["pid"], signal.SIGKILL)
    killed = time.time()

    def restarted() -> list[dict[str, Any]]:
        return [r for r in trace_rows(trace) if r["restart"] > 0 and r["t"] > killed]

    after = wait_for(restarted, a.timeout, f"{case}: a step after the restart")
    back = min(after, key=lambda r: r["t"])
    return {
        "recovery_s": round(back["t"] - killed, 3),
        "restart_imports_s": back["imports_s"],
        "first_imports_s": max((r["imports_s"] for r in first), default=None),
        "exited": proc.poll(),
    }


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kill-step", type=int, default=60)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=240.0)
    a = p.parse_args()
    trials: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    failed = dict.fromkeys(CASES, 0)
    with tempfile.TemporaryDirectory(prefix="rove-warm-imports-") as tmp:
        for n in range(a.repeats):
            for case in CASES:
                try:
                    trials[case].append(trial(case, Path(tmp) / f"{case}-{n}", a))
                except TimeoutError as exc:
                    print(f"{case}: {exc}", file=sys.stderr)
                    failed[case] += 1

    def median(case: str, key: str) -> float | None:
        values = [t[key] for t in trials[case] if t.get(key) is not None]
        return round(statistics.median(values), 3) if values else None

    out: dict[str, Any] = {
        "benchmark": "warm_imports",
        "repeats": a.repeats,
        "kill_step": a.kill_step,
        "failed": failed,
        "trials": trials,
    }
    for case in CASES:
        out[f"{case}_recovery_s"] = median(case, "recovery_s")
        out[f"{case}_restart_imports_s"] = median(case, "restart_imports_s")
        out[f"{case}_first_imports_s"] = median(case, "first_imports_s")
    rove = out["rove_recovery_s"]
    for base in ("rove_preloads_only", "torchrun"):
        other = out[f"{base}_recovery_s"]
        out[f"rove_vs_{base}_ratio"] = round(rove / other, 3) if rove and other else None
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
