"""The full warm server forked from the quick one, against one started afresh
(`ROVE_WARM_FORK=0`, the baseline), same job, same machine, interleaved.

Each trial is a short `rove run --standalone` job (`examples/train.py`, 2 workers) whose
rank 1 is killed at --kill-step (`--inject-fault`), so the restart forks from whichever
server is ready. Measured per trial, from the job's own processes (this process is
their subreaper, so servers orphaned when the quick one stops are still counted):

- `servers_cpu_s`: CPU-seconds of the warm servers (the quick, the full, their forks'
  own work before they served), sampled every 0.1 s;
- `job_cpu_s`: CPU-seconds of every process of the job;
- `full_ready_s`: from the launch until the full server said it was ready;
- `recovery_s`: what rove says of the restart ("training again N s after the
  interruption").

Prints one JSON line: the medians of each case and the forked case's ratio to the
fresh one's, from the same run.

    python benchmarks/warm_servers.py [--repeats 5] [--kill-step 30]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train.py"
BIN = Path(sys.executable).parent
CASES = {"forked": "1", "fresh": "0"}
_PR_SET_CHILD_SUBREAPER = 36
_RECOVERY = re.compile(r"training again ([0-9.]+)s after the interruption")


def _subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap() -> None:
    """Orphans of the job reparented here: reaped as they end."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def trial(case: str, n: int, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp"))  # (AF_UNIX paths are short)
    env = {
        **os.environ,
        "ROVE_HOME": str(work / "home"),
        "TMPDIR": str(scratch),
        "ROVE_WARM_FORK": CASES[case],
    }
    cmd = [str(BIN / "rove"), "run", "--standalone", "--job", f"ws{n}", "--nproc-per-node", "2"]
    cmd += ["--max-restarts", "2", "--inject-fault", f"kill:1@{a.kill_step}", str(SCRIPT)]
    cmd += ["--steps", str(a.steps), "--step-sleep", str(a.step_sleep), "--ckpt-every", "5"]
    cpu: dict[tuple[int, float], tuple[bool, float]] = {}
    ready_at = None
    me = psutil.Process()
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    try:
        while proc.poll() is None:
            for q in me.children(recursive=True):
                try:
                    with q.oneshot():
                        t = q.cpu_times()
                        line = " ".join(q.cmdline())
                        key = (q.pid, q.create_time())
                        was, used = cpu.get(key, (False, 0.0))
                        # (a worker shows its script's command line once it runs; a
                        # zombie shows none: what it was is kept)
                        server = "multiprocessing.forkserver" in line if line else was
                        cpu[key] = (server, max(used, t.user + t.system))
                except psutil.Error:
                    pass
            if ready_at is None and list(scratch.glob("rove-warm-full-*/ready")):
                ready_at = time.monotonic() - started
            _reap()
            time.sleep(0.1)
            if time.monotonic() - started > a.timeout:
                proc.kill()
                raise RuntimeError(f"{case} trial {n} ran past {a.timeout}s")
        out = proc.stdout.read().decode() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        _reap()
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{case} trial {n} exited {proc.returncode}:\n{out[-2000:]}")
    said = _RECOVERY.search(out)
    return {
        "servers_cpu_s": sum(c for server, c in cpu.values() if server),
        "job_cpu_s": sum(c for _, c in cpu.values()),
        "full_ready_s": ready_at,
        "recovery_s": float(said.group(1)) if said else None,
    }


def _median(values: list[Any]) -> float | None:
    have = [v for v in values if v is not None]
    return round(statistics.median(have), 3) if have else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--timeout", type=float, default=300.0)
    a = p.parse_args()
    _subreaper()
    rows: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="rove-warm-servers-") as tmp:
        n = 0
        for _ in range(a.repeats):
            for case in CASES:
                n += 1
                rows[case].append(trial(case, n, Path(tmp), a))
    keys = ("servers_cpu_s", "job_cpu_s", "full_ready_s", "recovery_s")
    medians = {case: {k: _median([r[k] for r in rs]) for k in keys} for case, rs in rows.items()}
    ratios = {}
    for k in keys:
        forked, fresh = medians["forked"][k], medians["fresh"][k]
        if forked is not None and fresh:
            ratios[k] = round(forked / fresh, 2)
    print(
        json.dumps(
            {
                "benchmark": "warm_servers",
                "repeats": a.repeats,
                "cores": os.cpu_count(),
                "job": f"examples/train.py 2 workers, {a.steps} steps, rank 1 killed at "
                f"step {a.kill_step}",
                "baseline": "fresh (ROVE_WARM_FORK=0)",
                "medians": medians,
                "ratio_forked_to_fresh": ratios,
                "trials": rows,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
