"""A finished job stays readable: `rove events`, `status` and `goodput` after the job's
launcher (and its embedded server) are gone read the job's stored stream, and say what
they said while it ran; its store is never written by a reader."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support import RunProc, eventually, free_port, patience, rove_cli

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "gated.py"


def _read(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return rove_cli(*args, "--job", "pm", timeout=60, env={"ROVE_HOME": str(home)})


def _json(home: Path, command: str) -> dict:
    out = _read(home, command, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _events(home: Path) -> list[dict]:
    out = _read(home, "events", "--json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


async def test_an_ended_job_reads_as_it_did_while_it_ran(tmp_path: Path) -> None:
    home = tmp_path / "home"
    gate = tmp_path / "gate"
    env = {"ROVE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    run = RunProc(
        tmp_path,
        "pm",
        *("--standalone", "--job", "pm", "--nproc-per-node", "2", "--max-restarts", "1"),
        *(str(SCRIPT), str(gate)),
        env=env,
    )
    try:
        await eventually(
            lambda: (tmp_path / "waiting-0").exists() and (tmp_path / "waiting-1").exists(),
            timeout=120,
        )
        live_status = _json(home, "status")
        live_events = _events(home)
        live_goodput = _json(home, "goodput")
        follower = subprocess.Popen(
            [sys.executable, "-m", "rove.control.cli.main", "logs", "--job", "pm", "--follow"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "ROVE_HOME": str(home)},
        )
        gate.write_text("go")
        assert run.wait() == 0, run.log()
        followed, follow_err = follower.communicate(timeout=patience(60))
    finally:
        run.stop()
    assert follower.returncode == 0 and b"job pm has ended" in follow_err, follow_err
    assert b"rank 0 attempt 1" in followed and b"rank 1 attempt 1" in followed
    assert b"==> round 2, node " in followed, "several files: each under its title"
    store = home / "jobs" / "pm" / "nats"
    before = _digest(store)

    status = _json(home, "status")
    events = _events(home)
    goodput = _json(home, "goodput")

    assert live_status["phase"] == "running" and status["phase"] == "finished"
    assert status["last_failure"] == live_status["last_failure"]
    assert "the first attempt fails on purpose" in status["last_failure"]["reason"]
    assert status["restarts"] == live_status["restarts"] == 1
    assert events[: len(live_events)] == live_events, "the same events, in order"
    assert [e["type"] for e in events[len(live_events) :]][-1] in ("node_left", "job_ended")
    assert any(e["type"] == "job_ended" for e in events)
    assert goodput["rounds"] == live_goodput["rounds"] == 2
    assert goodput["failures"] == live_goodput["failures"]

    text = _read(home, "status")
    assert "read from the job's stored events" in text.stdout
    assert "no master runs: the job has ended" in text.stdout
    follow = _read(home, "events", "--follow")
    assert follow.returncode == 0 and "has ended (finished" in follow.stderr, follow.stderr
    assert follow.stderr.endswith("): nothing more will come\n"), follow.stderr
    later = _read(home, "events", "--until-end", "--since", "0s")  # its end not among those read
    assert later.returncode == 0 and later.stdout == "", "finished: 0, and nothing newer"
    assert "has ended (finished" in later.stderr, later.stderr

    first = _read(home, "logs", "--round", "1", "--rank", "1", "--stream", "stderr")
    assert first.returncode == 0 and "RuntimeError: the first attempt fails" in first.stdout
    assert "==>" not in first.stdout, "one file: as written"
    newest = _read(home, "logs")
    assert "rank 1 attempt 1" in newest.stdout and "attempt 0" not in newest.stdout

    with ThreadPoolExecutor(2) as pool:  # two readers at once, each on its own copy
        both = list(pool.map(lambda _: _read(home, "events").stdout, range(2)))
    assert both[0] == both[1] and both[0].count("\n") == len(events)

    assert _digest(store) == before, "a reader never writes to the job's store"
    assert not list(Path(tempfile.gettempdir()).glob("rove-read-pm-*")), "copies deleted"


async def test_a_stale_url_and_a_damaged_store_are_said_in_one_line(tmp_path: Path) -> None:
    """A launcher killed with -9 leaves its `nats.url`; a half-deleted job folder is
    no job to read."""
    home = tmp_path / "home"
    gate = tmp_path / "gate"
    gate.write_text("go at once")
    run = RunProc(
        tmp_path,
        "pm",
        *("--standalone", "--job", "pm", "--nproc-per-node", "2", "--max-restarts", "1"),
        *(str(SCRIPT), str(gate)),
        env={"ROVE_HOME": str(home), "OMP_NUM_THREADS": "1"},
    )
    assert run.wait() == 0, run.log()
    url_file = home / "jobs" / "pm" / "nats.url"
    url_file.write_text(f"nats://127.0.0.1:{free_port()}\n")  # as a killed launcher leaves it
    status = _read(home, "status")
    assert status.returncode == 0, status.stderr
    assert "pm: finished" in status.stdout
    assert not url_file.exists(), "the stale nats.url is removed"

    _a_server_that_stops_as_a_follow_connects(home)
    _jobs_and_retention(home)

    for stream in (home / "jobs" / "pm" / "nats").rglob("ROVE_EVENTS"):
        for part in stream.rglob("*.blk"):
            part.unlink()
    damaged = _read(home, "events")
    assert damaged.returncode == 4, damaged.stderr
    lines = damaged.stderr.strip().splitlines()
    assert len(lines) == 1 and "damaged or was partly deleted" in lines[0], damaged.stderr

    missing = rove_cli("events", "--job", "nope", env={"ROVE_HOME": str(home)})
    assert missing.returncode == 4 and "no job 'nope' on this machine" in missing.stderr


def _a_server_that_stops_as_a_follow_connects(home: Path) -> None:
    """The job's server answers `rove events --follow`'s look, then stops before the
    follow read anything (it waited for the server to come back, without end): the
    follow reads the job's stored stream instead, and ends as the job did."""
    url_file = home / "jobs" / "pm" / "nats.url"
    listener = socket.create_server(("127.0.0.1", 0))  # answers, as a stopping server may
    listener.settimeout(patience(60))
    url_file.write_text(f"nats://127.0.0.1:{listener.getsockname()[1]}\n")
    follower = subprocess.Popen(
        [sys.executable, "-m", "rove.control.cli.main", "events", "--job", "pm", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ROVE_HOME": str(home)},
    )
    accepted = []
    try:  # its look at the server, then its connection: the server stops
        accepted = [listener.accept()[0] for _ in range(2)]
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    try:
        out, err = follower.communicate(timeout=patience(60))
    finally:
        follower.kill()
    assert follower.returncode == 0 and "has ended (finished" in err, err
    assert out == _read(home, "events").stdout, "every event, from the stored stream"
    assert not url_file.exists(), "the stale nats.url is removed"


def _jobs_and_retention(home: Path) -> None:
    """`rove jobs` lists the job as it ended; retention keeps the newest N, the running
    and the pinned, and removes the rest (copies of the real job's folder, made older)."""
    listed = _jobs_json(home)
    assert [j["job"] for j in listed] == ["pm"]
    assert listed[0]["state"] == "finished" and listed[0]["rounds"] == 2
    assert listed[0]["restarts"] == 1 and "first attempt fails" in listed[0]["last_failure"]
    assert (home / "jobs" / "pm" / "summary.json").is_file(), "cached once ended"
    assert _jobs_json(home) == listed, "the cached summary says the same"
    cached = home / "jobs" / "pm" / "summary.json"
    stale = {**json.loads(cached.read_text()), "rounds": 9, "goodput": 0.0}
    del stale["version"]  # as an older rove cached it
    cached.write_text(json.dumps(stale))
    assert _jobs_json(home) == listed, "an older rove's summary is read again from the events"

    jobs = home / "jobs"
    for age, name in enumerate(["old1", "old2", "old3", "old4"], start=1):
        shutil.copytree(jobs / "pm", jobs / name)
        (jobs / name / "summary.json").unlink()
        for part in [jobs / name / "nats", jobs / name / "nats" / "ports", jobs / name / "logs"]:
            for p in [part, *(part.iterdir() if part.name == "logs" else [])]:
                os.utime(p, (time.time() - 3600 * age, time.time() - 3600 * age))
    listener = socket.create_server(("127.0.0.1", 0))  # old3 "runs": its URL answers
    (jobs / "old3" / "nats.url").write_text(f"nats://127.0.0.1:{listener.getsockname()[1]}\n")
    try:
        assert _read_plain(home, "jobs", "--keep", "old4").returncode == 0
        pruned = _read_plain(home, "jobs", "--prune", env={"ROVE_KEEP_JOBS": "2"})
        assert pruned.returncode == 0, pruned.stderr
    finally:
        listener.close()
    left = sorted(p.name for p in jobs.iterdir())
    assert left == ["old1", "old3", "old4", "pm"], "newest 2, the running one, the pinned one"
    assert "removed job old2" in pruned.stdout
    table = _read_plain(home, "jobs").stdout
    assert "old4 *" in table and "pinned with rove jobs --keep" in table
    bad = _read_plain(home, "jobs", "--prune", env={"ROVE_KEEP_JOBS": "some"})
    assert bad.returncode == 2 and "ROVE_KEEP_JOBS" in bad.stderr


def _read_plain(
    home: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return rove_cli(*args, timeout=60, env={"ROVE_HOME": str(home), **(env or {})})


def _jobs_json(home: Path) -> list[dict]:
    out = _read_plain(home, "jobs", "--json")
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]
