"""Start-up: from the command to the first line a 2-rank script prints, torchrun vs rove.

Each trial runs `benchmarks/startup_script.py` (imports torch, as a training script
does, then prints one line per rank) under `--standalone --nproc-per-node 2`:
torchrun, `rove run` (warm start, the default) and `rove run --no-warm-start`,
interleaved, --repeats times. Measured per trial: seconds from starting the launcher
to the first line a rank printed (`first_line_s`), and to the launcher's exit
(`total_s`). Prints one JSON line with the medians per launcher and each rove
launcher's ratio to torchrun's, from the same run.

    python benchmarks/startup.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
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


def trial(launcher: str, home: Path) -> dict[str, float] | None:
    """One run: seconds to the first worker line and to the exit (None: it failed)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [*LAUNCHERS[launcher], str(SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "ROVE_HOME": str(home), "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    first = None
    for line in proc.stdout:
        if first is None and line.startswith(b"rank "):
            first = time.monotonic() - start
    code = proc.wait()
    total = time.monotonic() - start
    if code != 0 or first is None:
        return None
    return {"first_line_s": first, "total_s": total}


def main() -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    trials: dict[str, list[dict[str, float]]] = {name: [] for name in LAUNCHERS}
    failed = dict.fromkeys(LAUNCHERS, 0)
    with tempfile.TemporaryDirectory(prefix="rove-startup-") as tmp:
        for _ in range(a.repeats):
            for name in LAUNCHERS:
                got = trial(name, Path(tmp) / "home")
                if got is None:
                    failed[name] += 1
                else:
                    trials[name].append(got)

    def median(name: str, key: str) -> float | None:
        values = [t[key] for t in trials[name]]
        return round(statistics.median(values), 3) if values else None

    out: dict[str, Any] = {"benchmark": "startup", "repeats": a.repeats, "failed": failed}
    for name in LAUNCHERS:
        out[f"{name}_first_line_s"] = median(name, "first_line_s")
        out[f"{name}_total_s"] = median(name, "total_s")
    base = out["torchrun_first_line_s"]
    for name in ("rove", "rove_cold"):
        ours = out[f"{name}_first_line_s"]
        out[f"{name}_vs_torchrun"] = round(ours / base, 2) if ours and base else None
    out["target"] = "rove_vs_torchrun <= 1.0"
    return out


if __name__ == "__main__":
    sys.stdout.write(json.dumps(main()) + "\n")
