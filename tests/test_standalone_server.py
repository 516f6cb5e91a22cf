"""`rove run --standalone` whose own nats-server is killed while the job trains: the
shape an outside probe found broken (the leases' memory stream was gone with the
server, no lease reached a worker again, and the job failed a minute later in a gloo
timeout)."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
from pathlib import Path

import pytest

from tests.support import RunProc, eventually, rove_cli, trace_rows

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _server_pid(store: Path) -> int | None:
    """The job's nats-server, as its store's lock file names it."""
    try:
        held = re.search(r"its nats-server, pid (\d+)", (store / "server.lock").read_text())
    except FileNotFoundError:
        return None
    return int(held[1]) if held else None


@pytest.mark.slow
async def test_a_standalone_job_whose_nats_server_is_killed_trains_on_to_its_end(
    tmp_path: Path,
) -> None:
    """The server is started again on its port and store, the workers' data clients
    read the leases' stream made anew, and the job ends well in its first round: every
    step once on each rank, no sample twice."""
    home, trace = tmp_path / "home", tmp_path / "trace.jsonl"
    run = RunProc(
        tmp_path,
        "nk",
        *("--standalone", "--job", "nk", "--nproc-per-node", "2", str(TRAIN)),
        *("--steps", "300", "--ckpt-every", "5", "--step-sleep", "0.05"),
        *("--trace", str(trace)),
        env={"ROVE_HOME": str(home), "ROVE_SHM_DIR": str(tmp_path / "shm")},
    )
    try:
        await eventually(lambda: len(trace_rows(trace)) >= 2 * 60, timeout=180)
        store = home / "jobs" / "nk" / "nats"
        first = _server_pid(store)
        assert first is not None, (store / "server.lock").read_text()
        os.kill(first, signal.SIGKILL)
        assert run.wait(300) == 0, run.log()[-4000:]
    finally:
        run.stop()
    log = run.log()
    assert f"the job's NATS server (pid {first}) was killed by SIGKILL: starting it again" in log
    assert "the job's NATS server is back" in log
    assert "round 2" not in log, "no restart: the workers trained on"
    # the workers' data clients lost the server too: the agent says it once for the
    # node (the launcher's lines, structured, are all here: RunProc runs it verbose),
    # and the ranks do not repeat it one by one (info in a worker: ROVE_LOG_LEVEL=info
    # shows it); no debug lines, no stamina retry lines on stderr
    assert re.search(r"\[warning *\] disconnected from NATS; reconnecting servers=", log), log
    rank_said = r"^rove: rank \d: (disconnected from NATS|NATS client error)"
    assert not re.search(rank_said, log, re.M), log
    assert not re.search(r"\[debug *\]|stamina\.retry_scheduled", log), log
    rows = trace_rows(trace)
    for rank in (0, 1):
        steps = [r["step"] for r in rows if r["rank"] == rank]
        assert steps == list(range(1, 301)), f"rank {rank} trained each step once"
    delivered = collections.Counter(tuple(i) for r in rows for i in r["samples"])  # type: ignore[attr-defined]
    assert delivered and max(delivered.values()) == 1, "no sample twice in the one epoch"
    # the restart is an event of the job, read after its end as a user would
    out = rove_cli(
        *("events", "--job", "nk", "--type", "nats_server_restarted", "--json"),
        env={"ROVE_HOME": str(home)},
    )
    assert out.returncode == 0, out.stderr
    (restarted,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert restarted["pid_before"] == first, restarted
    assert restarted["ended"] == "was killed by SIGKILL", restarted
    assert restarted["pid"] not in (0, first) and restarted["down_s"] > 0, restarted
