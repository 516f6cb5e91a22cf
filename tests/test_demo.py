"""The first five minutes: `make demo` shows a failure healed from memory by itself,
on a console that speaks in short sentences (rove's own log goes to the job's folder).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.support import patience

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
#: internal lines the console used to show before anything about training
INTERNALS = ("created stream", "won the leader lease", "decided job_configured")


def test_make_demo_heals_an_injected_failure_from_memory_and_says_its_goodput(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [
            *("make", "-s", "demo", f"DEMO_DIR={tmp_path / 'demo'}"),
            *("DEMO_STEPS=60", "DEMO_FAULT=kill:1@30"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(300),
        env={k: v for k, v in os.environ.items() if k != "ROVE_VERBOSE"},
    )
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert "rove: injecting a fault (--inject-fault): SIGKILL to rank 1 at step 30" in said
    assert "rove: worker rank 1 failed: killed by SIGKILL\n" in said  # (not "killed: killed")
    restored = re.search(r"they restore step (\d+) from memory", said)
    assert restored is not None, said[-4000:]
    step = int(restored.group(1))
    assert 25 <= step <= 30, "the newest flash checkpoint before the kill (every 5 steps)"
    assert re.search(rf"restart 1, restored step {step} from memory in \d+\.\d+s", said)
    assert re.search(r"rove: round 2: training again \d+\.\ds after the interruption", said)
    assert re.search(r"rove: goodput \d+\.\d%: ", said), said[-2000:]
    assert "rove goodput --job demo" in said, "how to read the ended job"
    for line in INTERNALS:
        assert line not in said, f"{line!r}: an internal line on the console"
    (log,) = (tmp_path / "demo" / "home" / "jobs" / "demo" / "logs").glob("*/rove.log")
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    assert {r["event"] for r in rows} >= {"elected leader", "decided job_configured"}
    failed = next(r for r in rows if r["event"].startswith("worker rank 1 failed"))
    assert (failed["job"], failed["node"], failed["rank"]) == ("demo", log.parent.name, 1)


def test_verbose_puts_the_whole_log_on_the_console(tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    out = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "rove"), "run", "--standalone", "-v", str(script)],
        capture_output=True,
        text=True,
        timeout=patience(120),
        env={**os.environ, "ROVE_HOME": str(tmp_path / "home")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert all(line in out.stderr for line in INTERNALS), out.stderr[-3000:]
    assert "hello" in out.stdout
