"""Start-up: from the command to the first line a 2-rank script prints, torchrun vs rove.

Each trial runs `benchmarks/startup_script.py` (imports torch, as a training script
does, then prints one line per rank) under `--standalone --nproc-per-node 2`:
torchrun, `rove run` (warm start, the default) and `rove run --no-warm-start`,
interleaved, --repeats times. Measured per trial: seconds from starting the launcher
to the first line a rank printed (`first_line_s`), and to the launcher's exit
(`total_s`), and the CPU-seconds the launcher and everything it started used
(`cpu_s`). Prints one JSON line with the medians per launcher and each rove
launcher's ratio to torchrun's, from the same run.

`--baseline REV` adds `rove run` of an earlier commit (`rove_baseline`: a git
worktree of REV, imported ahead of this checkout), interleaved with the others, and
rove's ratio to it: a change measured beside what it changed.

    python benchmarks/startup.py [--repeats 7] [--baseline REV]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "startup_script.py"
BIN = Path(sys.executable).parent
LAUNCHERS = {
    "torchrun": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2"],
    "rove": [str(BIN / "rove"), "run", "--standalone", "--nproc-per-node", "2"],
    "rove_cold": [
        *(str(BIN / "rove"), "run", "--standalone", "--nproc-per-node", "2", "--no-warm-start")
    ],
}


#: `rove run` of the baseline commit: its code imported ahead of this checkout's
BASELINE = [sys.executable, "-m", "rove.control.cli.main", "run", "--standalone"]
BASELINE += ["--nproc-per-node", "2"]


@contextlib.contextmanager
def baseline_view(rev: str, tmp: Path) -> Iterator[Path]:
    """A folder whose `rove` package is commit `rev`'s (a git worktree of it)."""
    tree = tmp / "baseline-tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
        check=True,
        capture_output=True,
    )
    view = tmp / "baseline-view" / "rove"
    view.mkdir(parents=True)
    for part in ("control", "agent", "shard_service", "checkpoint"):
        (view / part).symlink_to(tree / part)
    try:
        yield view.parent
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
            check=False,
            capture_output=True,
        )


def adopt_orphans() -> None:
    """Make this process the reaper of its descendants' orphans (a launcher that leaves
    before its warm servers, which end as they see it gone), so their CPU counts."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def reap(timeout_s: float = 30.0) -> None:
    """Wait for every descendant left (adopted orphans) to exit and be reaped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def trial(launcher: str, home: Path, baseline: Path | None = None) -> dict[str, float] | None:
    """One run: seconds to the first worker line and to the exit (None: it failed)."""
    env = {**os.environ, "ROVE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    if launcher == "rove_baseline" and baseline is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline), env.get("PYTHONPATH")]))
    command = BASELINE if launcher == "rove_baseline" else LAUNCHERS[launcher]
    cpu = _children_cpu()
    start = time.monotonic()
    proc = subprocess.Popen(
        [*command, str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    assert proc.stdout is not None
    first = None
    for line in proc.stdout:
        if first is None and line.startswith(b"rank "):
            first = time.monotonic() - start
    code = proc.wait()
    total = time.monotonic() - start
    reap()
    # (what the launcher's own children used is counted once they are reaped: the warm
    # servers and workers are the launcher's children, the NATS server too)
    cpu_s = _children_cpu() - cpu
    if code != 0 or first is None:
        return None
    return {"first_line_s": first, "total_s": total, "cpu_s": cpu_s}


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--baseline", metavar="REV", help="also run rove of this git commit")
    a = p.parse_args()
    names = [*LAUNCHERS, *(["rove_baseline"] if a.baseline else [])]
    trials: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    failed = dict.fromkeys(names, 0)
    adopt_orphans()
    with (
        tempfile.TemporaryDirectory(prefix="rove-startup-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        view = stack.enter_context(baseline_view(a.baseline, Path(tmp))) if a.baseline else None
        for _ in range(a.repeats):
            for name in names:
                got = trial(name, Path(tmp) / "home", view)
                if got is None:
                    failed[name] += 1
                else:
                    trials[name].append(got)

    def median(name: str, key: str) -> float | None:
        values = [t[key] for t in trials[name]]
        return round(statistics.median(values), 3) if values else None

    out: dict[str, Any] = {"benchmark": "startup", "repeats": a.repeats, "failed": failed}
    if a.baseline:
        out["baseline"] = a.baseline
    for name in names:
        out[f"{name}_first_line_s"] = median(name, "first_line_s")
        out[f"{name}_total_s"] = median(name, "total_s")
        out[f"{name}_cpu_s"] = median(name, "cpu_s")
    base = out["torchrun_first_line_s"]
    for name in ("rove", "rove_cold", *(["rove_baseline"] if a.baseline else [])):
        ours = out[f"{name}_first_line_s"]
        out[f"{name}_vs_torchrun"] = round(ours / base, 2) if ours and base else None
    if a.baseline:
        for key in ("first_line_s", "total_s", "cpu_s"):
            ours, before = out[f"rove_{key}"], out[f"rove_baseline_{key}"]
            out[f"rove_vs_baseline_{key}"] = round(ours / before, 2) if ours and before else None
    out["target"] = "rove_vs_torchrun <= 1.0"
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
