"""Short jobs end: a run of `benchmarks/soak.py` (8 warm-started DDP jobs beside a
CPU-bound process) in which a single hang fails, with the stacks of the hung job.

A statistical backstop: before the fix, 6 of 14 such jobs hung beside a busy core
(`../shared/reference/wave4.md`), so 8 jobs find a return of it 99 times in 100
((8/14)^8 = 0.011 that none hangs; 10 cost the suite another 25 s); the
cause itself is tested deterministically in `tests/test_groups.py`, and the 200-job
figures come from the benchmark (docs/runtime.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import patience

SOAK = Path(__file__).parent.parent / "benchmarks" / "soak.py"


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_eight_short_warm_started_jobs_all_end() -> None:
    out = subprocess.run(
        [sys.executable, str(SOAK), "--jobs", "8", "--launchers", "rove", "--fail-on-hang"],
        capture_output=True,
        text=True,
        timeout=patience(900),
        check=False,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-20000:]}"
    result = json.loads(out.stdout.splitlines()[-1])
    rove = result["launchers"]["rove"]
    assert (rove["runs"], rove["hangs"], rove["failed"]) == (8, 0, 0), out.stderr[-20000:]
