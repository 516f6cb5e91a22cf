"""The `rove` CLI against a real server: readable and JSON output, clear errors, exit codes."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from rove.control.bus.client import Bus
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.flags import options as common
from tests import factories
from tests.support import free_port, patience, rove_cli


async def seed(bus: Bus) -> None:
    await bus.publish(factories.elected("m1", 1, ts=time.time()))
    await bus.publish(factories.configured(1, 30.0))
    await bus.publish(factories.joined("n1", ts=time.time()))
    await bus.publish(factories.joined("n2", ts=time.time(), n=2))
    await bus.publish(factories.heartbeat("n1", ts=time.time(), step=42))
    await bus.publish(factories.lost("n2", 1))


async def test_events_prints_one_readable_line_per_event(bus: Bus) -> None:
    await seed(bus)
    out = await asyncio.to_thread(rove_cli, "events", "--job", "j1", "--nats", bus.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 5  # heartbeats live in their own stream
    assert "master_elected" in lines[0] and "epoch=1" in lines[0] and "master=m1" in lines[0]
    assert "node_joined" in lines[2] and "node=n1" in lines[2] and "agent:n1" in lines[2]
    assert "node_lost" in lines[4] and "node=n2" in lines[4]


async def test_events_json_filters_by_type_and_node(bus: Bus) -> None:
    await seed(bus)
    out = await asyncio.to_thread(
        rove_cli,
        "events",
        "--job",
        "j1",
        "--nats",
        bus.url,
        "--json",
        "--type",
        "node_joined",
        "--node",
        "n2",
    )
    rows = [json.loads(x) for x in out.stdout.splitlines()]
    assert [(r["type"], r["node"], r["seq"]) for r in rows] == [("node_joined", "n2", 4)]


async def test_events_since_skips_older_events(bus: Bus) -> None:
    await bus.publish(factories.joined("old"))
    await asyncio.sleep(1.0)
    between = dt.datetime.now(dt.UTC).isoformat()
    await asyncio.sleep(1.0)
    await bus.publish(factories.joined("new", n=1))
    out = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--since", between
    )
    assert "node=new" in out.stdout and "node=old" not in out.stdout
    # a time after every event: nothing printed, and the command still ends
    later = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--since", "0s"
    )
    assert later.returncode == 0 and "node_joined" not in later.stdout
    assert "stalled" not in later.stderr


async def test_events_follow_prints_new_events_as_they_arrive(bus: Bus) -> None:
    await bus.publish(factories.joined("n1"))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rove.control.cli.main",
            "events",
            "--job",
            "j1",
            "--follow",
            "--nats",
            bus.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = await asyncio.to_thread(proc.stdout.readline)
        assert "node=n1" in first
        await bus.publish(factories.joined("n7", n=7))
        second = await asyncio.to_thread(proc.stdout.readline)
        assert "node=n7" in second
    finally:
        proc.terminate()
        proc.wait(patience(10))


async def test_events_until_end_follows_a_shared_nats_until_the_newest_run_ends(
    any_bus: Bus,
) -> None:
    """`--until-end` against a shared NATS: a run that ended before is no end (a new run
    started); the follow ends with the newest run's end, saying how, exit 1 for a failure
    (0 for a finished job). A plain `--follow` there goes on (the job may run again)."""
    bus = any_bus  # (one server, and the 3-node cluster users deploy)
    for e in (
        factories.elected("m1", 1),
        factories.joined("n1"),
        factories.ended(1, ev.JobPhase.FINISHED),
        factories.run_started(1),
    ):
        await bus.publish(e)
    base = [sys.executable, "-m", "rove.control.cli.main", "events", "--job", "j1"]
    base += ["--nats", bus.url]
    until = subprocess.Popen(
        [*base, "--until-end"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    plain = subprocess.Popen(
        [*base, "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert until.stdout is not None
        while "run_started" not in await asyncio.to_thread(until.stdout.readline):
            pass  # (the history read: the first run's end is no end of the follow)
        assert until.poll() is None, "the newest run has not ended"
        failed = msgspec.structs.replace(
            factories.ended(1, ev.JobPhase.FAILED), id="ended-2", reason="rank 1 on n1: boom"
        )
        await bus.publish(failed)
        out, err = await asyncio.to_thread(until.communicate, timeout=patience(30))
        assert until.returncode == 1, (out, err)
        assert "job_ended" in out.splitlines()[-1], out
        assert err.endswith(
            "rove events: job j1 has ended (failed: rank 1 on n1: boom): nothing more will come\n"
        ), err
        assert plain.poll() is None, "a plain follow of a shared NATS goes on"
        # the job already ended: it reads to the end and says so, exit 0 for a finished one
        await bus.publish(factories.run_started(1, run=3))
        await bus.publish(
            msgspec.structs.replace(factories.ended(1, ev.JobPhase.FINISHED), id="e3")
        )
        done = subprocess.run(
            [*base, "--until-end", "--type", "node_joined"],
            capture_output=True,
            text=True,
            timeout=patience(30),
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.count("node_joined") == 1, done.stdout
        assert "has ended (finished: enough)" in done.stderr, done.stderr
    finally:
        for p in (until, plain):
            p.kill()
            p.wait(patience(10))


@pytest.mark.parametrize(
    "command",
    [("events",), ("events", "--json"), ("events", "--follow"), ("status",)],
    ids=["events", "json", "follow", "status"],
)
async def test_a_command_whose_reader_went_away_ends_quietly(
    bus: Bus, command: tuple[str, ...]
) -> None:
    """`rove events --job J | head -1`: the reader closes the pipe. `rove events` used to
    go on for ever, saying "NATS client error: Broken pipe" for each event, and `rove
    status` printed a traceback; each ends now, with nothing on stderr and 141, as a
    command killed by SIGPIPE."""
    await seed(bus)
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line: every write fails
    try:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "rove.control.cli.main"),
            *(*command, "--job", "j1", "--nats", bus.url),
            stdout=write,
            stderr=asyncio.subprocess.PIPE,
        )
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(proc.communicate(), patience(60))
    assert (proc.returncode, err.decode()) == (141, "")


async def test_status_shows_leader_nodes_and_heartbeats(bus: Bus) -> None:
    await seed(bus)
    out = await asyncio.to_thread(rove_cli, "status", "--job", "j1", "--nats", bus.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "job j1: running" in text
    assert "leader m1, epoch 1" in text
    n1 = next(line for line in text.splitlines() if line.startswith("n1 "))
    assert "active" in n1 and "42" in n1
    n2 = next(line for line in text.splitlines() if line.startswith("n2 "))
    assert "lost" in n2
    # why a node is as it is: under the table, not in a column as wide as the reason
    assert "lost*" in n2 and "* n2 lost: " in text, text


async def test_a_job_name_run_on_a_shared_nats_after_a_standalone_run_reads_the_newer(
    bus: Bus, tmp_path: Path
) -> None:
    """`rove status --job J` with no --nats read J's ended standalone run stored on this
    machine even once J ran again on a shared NATS from it: the newer run was never
    read. A standalone run's start forgets the shared NATS of an earlier one, so
    whichever ran last is read."""
    home = tmp_path / "home"
    env = {"ROVE_HOME": str(home)}
    shared = home / "jobs" / "j1" / "shared-nats.url"
    shared.parent.mkdir(parents=True)
    shared.write_text(bus.url + "\n")  # a run on a shared NATS, before
    script = tmp_path / "hello.py"
    script.write_text("print('standalone run')\n")
    run = await asyncio.to_thread(
        rove_cli, "run", "--standalone", "--job", "j1", str(script), env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    assert not shared.exists(), "the standalone run is the newer one"
    status = await asyncio.to_thread(rove_cli, "status", "--job", "j1", env=env)
    assert status.stdout.startswith("job j1: finished"), status.stdout + status.stderr
    await seed(bus)  # then the job runs on a shared NATS (`rove run --nats` keeps its URL)
    shared.write_text(bus.url + "\n")
    status = await asyncio.to_thread(rove_cli, "status", "--job", "j1", env=env)
    assert "job j1: running" in status.stdout, status.stdout + status.stderr
    assert "leader m1, epoch 1" in status.stdout


async def test_status_json_is_one_object(bus: Bus) -> None:
    await seed(bus)
    out = await asyncio.to_thread(rove_cli, "status", "--job", "j1", "--nats", bus.url, "--json")
    view = json.loads(out.stdout)
    assert view["leader"] == "m1" and view["epoch"] == 1 and view["phase"] == "running"
    assert {n["node"]: n["status"] for n in view["nodes"]} == {"n1": "active", "n2": "lost"}
    assert view["nodes"][0]["step"] == 42
    assert view["counters"]["nodes_lost"] == 1


async def test_status_reads_a_skewed_nodes_heartbeat_on_the_servers_clock_and_says_so(
    any_bus: Bus,
) -> None:
    """A node whose clock is three minutes behind beat a second ago: `rove status` said
    "180s ago" (and one ahead "-120s ago"), reading the node's stamp on the reader's
    clock. It reads when the server stored the heartbeat, and names the clocks that are
    off by how much."""
    now = time.time()
    await any_bus.publish(factories.elected("m1", 1, ts=now))
    await any_bus.publish(factories.configured(1, 30.0))
    for n, node in enumerate(("n1", "n2", "n3")):
        await any_bus.publish(factories.joined(node, ts=now, n=n))
    await any_bus.publish(factories.heartbeat("n1", ts=time.time() - 180.0, step=7))  # behind
    await any_bus.publish(factories.heartbeat("n2", ts=time.time() + 120.0, step=7))  # ahead
    await any_bus.publish(factories.heartbeat("n3", ts=time.time(), step=7))
    out = await asyncio.to_thread(
        rove_cli, "status", "--job", "j1", "--nats", any_bus.url, "--json"
    )
    assert out.returncode == 0, out.stderr
    nodes = {n["node"]: n for n in json.loads(out.stdout)["nodes"]}
    for node in ("n1", "n2", "n3"):
        assert 0 <= nodes[node]["last_heartbeat_age_s"] < 60, nodes[node]
    assert nodes["n1"]["clock_off_s"] == pytest.approx(180.0, abs=30)
    assert nodes["n2"]["clock_off_s"] == pytest.approx(-120.0, abs=30)
    assert nodes["n3"]["clock_off_s"] is None
    assert all(n["status"] == "active" for n in nodes.values()), "none read as silent"
    text = (
        await asyncio.to_thread(rove_cli, "status", "--job", "j1", "--nats", any_bus.url)
    ).stdout
    (line,) = [x for x in text.splitlines() if x.startswith("clocks off")]
    assert re.search(r": n1 1[0-9.]+s behind, n2 1[0-9.]+s ahead \(", line), text
    assert "n3" not in line and "NTP" in line, text


async def test_stop_asks_the_job_to_stop(bus: Bus) -> None:
    await seed(bus)
    out = await asyncio.to_thread(
        rove_cli, "stop", "--job", "j1", "--nats", bus.url, "--reason", "done"
    )
    assert out.returncode == 0, out.stderr
    events = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--type", "stop_requested", "--json"
    )
    assert json.loads(events.stdout)["reason"] == "done"


async def test_scale_sets_the_jobs_node_bounds(any_bus: Bus) -> None:
    bus = any_bus  # (one server, and the 3-node cluster users deploy)
    await seed(bus)
    out = await asyncio.to_thread(
        rove_cli, "scale", "--job", "j1", "--nats", bus.url, "--nnodes", "2:6", "--reason", "more"
    )
    assert out.returncode == 0, out.stderr
    assert "2-6 nodes requested" in out.stdout
    events = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--type", "scale_requested", "--json"
    )
    asked = json.loads(events.stdout)
    assert (asked["min_nodes"], asked["max_nodes"], asked["reason"]) == (2, 6, "more")


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (
            ["scale", "--job", "j1", "--nnodes", "4:2", "--nats", "nats://x:1"],
            common.EXIT_USAGE,
            "--nnodes '4:2': give MIN or MIN:MAX, 1 <= MIN <= MAX",
        ),
        (
            ["status", "--job", "j1", "--nats", "localhost:4222"],
            common.EXIT_USAGE,
            "invalid NATS URL",
        ),
        (["status", "--job", "bad.name", "--nats", "nats://x:1"], common.EXIT_USAGE, "invalid job"),
        (["events", "--job", "a b"], common.EXIT_USAGE, "argument --job: invalid job name 'a b'"),
        (["status", "--job", "j1"], common.EXIT_UNKNOWN_JOB, "no job 'j1' on this machine"),
        (["stop", "--job", "j1"], common.EXIT_USAGE, "no NATS server to connect to"),
        (["status", "--jbo", "j1"], common.EXIT_USAGE, "(did you mean: --jbo → --job?)"),
        (
            ["goodput"],
            common.EXIT_USAGE,
            "rove goodput: which job? give --job J (rove jobs lists the jobs kept on this machine)",
        ),
        (["stauts", "--job", "j1"], common.EXIT_USAGE, "(did you mean: stauts → status?)"),
        (  # a subcommand's unknown flag, said as its own with its flags (was `rove:`)
            ["events", "--job", "j1", "--folow"],
            common.EXIT_USAGE,
            "rove events: unrecognized arguments: --folow (did you mean: --folow → --follow?); "
            "see rove events --help",
        ),
        (
            ["events", "--job", "j1", "--since", "yesterday", "--nats", "nats://x:1"],
            common.EXIT_USAGE,
            "invalid time 'yesterday': give a duration back from now",
        ),
        (
            ["events", "--job", "j1", "--type", "nope", "--nats", "nats://x:1"],
            common.EXIT_USAGE,
            "unknown event type",
        ),
        (
            ["status", "--job", "j1", "--nats", "nats://h:1", "--nats-creds", "/no/such.creds"],
            common.EXIT_USAGE,
            "no such file",
        ),
        (["frobnicate"], common.EXIT_USAGE, "invalid choice"),
        (["run", "--standalone", "--nnodes", "abc", "x.py"], common.EXIT_USAGE, "e.g. 2 or 1:4"),
        (
            ["run", "--standalone", "--nproc-per-nodes", "2", "x.py"],
            common.EXIT_USAGE,
            "did you mean: --nproc-per-nodes → --nproc-per-node?",
        ),
        (["run", "--nnodes", "3:1", "x.py"], common.EXIT_USAGE, "MIN <= MAX"),
        (  # torch elastic's line with a rendezvous other machines may reach: --nats needed
            ["run", "--nnodes", "1:4", "--rdzv-endpoint", "10.1.2.3:29400", "x.py"],
            common.EXIT_USAGE,
            "--nnodes 1:4: the nodes meet on a NATS server, and none was given",
        ),
        (
            ["run", "--standalone", "--nproc-per-node", "2"],
            common.EXIT_USAGE,
            "rove run: no training script given: rove run [options] SCRIPT [ARGS...]; "
            "see rove run --help",
        ),
        (["run", "--standalone", "--bogus", "x.py"], common.EXIT_USAGE, "unrecognized arguments"),
        (
            ["run", "--nproc-per-node", "gpu", "examples/train.py"],
            common.EXIT_USAGE,
            "--nproc-per-node gpu: torch sees no CUDA GPU on this machine",
        ),
        (["run", "--standalone", "no/such/train.py"], common.EXIT_USAGE, "not found"),
        (
            ["run", "--standalone", "-m", "no_such_pkg.train"],
            common.EXIT_USAGE,
            "rove run: no module no_such_pkg to run with -m no_such_pkg.train, here (",
        ),
        (
            ["run", "--standalone", "docs"],
            common.EXIT_USAGE,
            "training script docs is a folder without a __main__.py: give the script file in it",
        ),
        (
            ["run", "--standalone", "--checkpoint-dir", "ftp://host/x", "examples/train.py"],
            common.EXIT_USAGE,
            "--checkpoint-dir: cannot use ftp://host/x for checkpoints",
        ),
        (
            ["run", "--standalone", "--checkpoint-dir", "/proc/rove-ckpt", "examples/train.py"],
            common.EXIT_USAGE,
            "--checkpoint-dir /proc/rove-ckpt: No such file or directory: /proc/rove-ckpt; "
            "give a directory this user can create and write",
        ),
        (
            ["run", "--standalone", "--log-dir", "/proc/rove-logs", "examples/train.py"],
            common.EXIT_USAGE,
            "rove run: --log-dir /proc/rove-logs: No such file or directory: /proc/rove-logs; "
            "give a folder this user can write",
        ),
        (
            ["run", "--standalone", "--tf-role", "ps", "examples/train.py"],
            common.EXIT_USAGE,
            "--tf-role is for a TensorFlow job: add --tf-ps",
        ),
        (
            ["run", "--standalone", "--tf-ps", "--tf-role", "ps", "examples/tf_ps.py"],
            common.EXIT_USAGE,
            "a --standalone job is one node",
        ),
        (["run", "--nnodes", "2", "examples/train.py"], common.EXIT_USAGE, "add --nats"),
        (["run", "--standalone", "--nnodes", "3:2", "x.py"], common.EXIT_USAGE, "MIN <= MAX"),
        (
            ["run", "--standalone", "--nnodes", "2", "examples/train.py"],
            common.EXIT_USAGE,
            "--standalone runs a one-node job",
        ),
        (
            ["run", "--standalone", "--run-path", "-m", "examples.train"],
            common.EXIT_USAGE,
            "--run-path runs a script file",
        ),
        (
            ["run", "--node-unit", "0", "--standalone", "examples/train.py"],
            common.EXIT_USAGE,
            "--node-unit",
        ),
    ],
)
def test_user_mistakes_get_one_clear_line_and_an_exit_code(
    args: list[str], code: int, message: str, tmp_path: Path
) -> None:
    # (no GPU, whatever the machine: one case asks for a worker per GPU)
    out = rove_cli(*args, env={"ROVE_HOME": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert f"rove {args[0]}: rove {args[0]}" not in out.stderr, "the prefix is said once"
    assert "usage:" not in out.stderr, "one line, not argparse's usage (45 lines for rove run)"
    jobs = tmp_path / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir()), "a refused command leaves no job behind"


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"ROVE_NATS_REPLICAS": "three"}, ["run", "--standalone", "x.py"], "ROVE_NATS_REPLICAS"),
        ({"ROVE_NATS_REPLICAS": "three"}, ["master", "--job", "j"], "ROVE_NATS_REPLICAS"),
        ({"ROVE_METRICS_PORT": "abc"}, ["master", "--job", "j"], "ROVE_METRICS_PORT"),
        (
            {"PET_VIRTUAL_LOCAL_RANK": "maybe"},
            ["run", "--standalone", "x.py"],
            "PET_VIRTUAL_LOCAL_RANK='maybe': give 1 or 0",
        ),
        (  # (each TensorFlow task died with a ValueError, and every round after it)
            {"ROVE_TF_THREADS": "four"},
            ["run", "--standalone", "--tf-ps", "1", "x.py"],
            "ROVE_TF_THREADS must be a whole number of threads (0: TensorFlow's choice), "
            "got 'four'",
        ),
        (  # (a misspelt level was the default, unsaid)
            {"ROVE_LOG_LEVEL": "debgu"},
            ["run", "--standalone", "x.py"],
            "ROVE_LOG_LEVEL must be one of debug, info, warning, warn, error, critical, "
            "got 'debgu'",
        ),
        (
            {"ROVE_LOG_FORMAT": "xml"},
            ["run", "--standalone", "x.py"],
            "ROVE_LOG_FORMAT must be one of console, json, got 'xml'",
        ),
        (
            {"ROVE_WARM_FORK": "no"},
            ["run", "--standalone", "x.py"],
            "ROVE_WARM_FORK must be 1 or 0, got 'no'",
        ),
    ],
)
def test_a_bad_environment_variable_is_one_clear_line_not_a_traceback(
    env: dict[str, str], args: list[str], message: str, tmp_path: Path
) -> None:
    """An environment variable that gives a flag's default was parsed as the parser was
    built: a bad one was a traceback from every command, `rove status` too (one with no
    such flag)."""
    out = rove_cli(*args, env={"ROVE_HOME": str(tmp_path), **env})
    assert out.returncode == common.EXIT_USAGE, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr
    other = rove_cli("status", "--job", "nothing", env={"ROVE_HOME": str(tmp_path), **env})
    assert "Traceback" not in other.stderr, other.stderr


def test_a_script_that_does_not_compile_is_refused_before_anything_starts(
    tmp_path: Path,
) -> None:
    """Its workers failed, then failed again after a restart, and only then did the
    job fail ("the same user code error repeated")."""
    script = tmp_path / "broken.py"
    script.write_text("import os\n\nx = (\n")
    home = tmp_path / "home"
    out = rove_cli(
        "run", "--standalone", "--max-restarts", "3", str(script), env={"ROVE_HOME": str(home)}
    )
    assert out.returncode == common.EXIT_USAGE, out.stderr
    assert (
        f"rove run: training script {script} does not compile: SyntaxError: '(' was never "
        "closed (line 3); fix it and run again"
    ) in out.stderr
    assert "round 1" not in out.stderr and not (home / "jobs").exists(), "no job started"
    # a script of another Python (PYTHON_EXEC) is that Python's to read
    other = rove_cli(
        "run",
        "--standalone",
        str(script),
        env={"ROVE_HOME": str(home), "PYTHON_EXEC": "/no/such/python"},
    )
    assert "does not compile" not in other.stderr
    assert (home / "jobs").exists(), "a job that starts has a folder there"


def test_a_module_in_the_working_folder_runs_and_one_missing_fails_in_pythons_words(
    tmp_path: Path,
) -> None:
    """A worker's `python -m` without its module said it with a traceback through runpy
    ("at <frozen runpy>:142"); now as python says it, and the job's failure names it."""
    # (tests.scripts is found from the working folder, as by python -m: nothing installs it)
    ran = rove_cli(
        "run",
        "--standalone",
        "-m",
        "tests.scripts.print_env",
        str(tmp_path),
        env={"ROVE_HOME": str(tmp_path)},
    )
    assert ran.returncode == 0, ran.stderr
    assert (tmp_path / "rank-0.json").exists()
    out = rove_cli(
        "run", "--standalone", "-m", "tests.no_such_module", env={"ROVE_HOME": str(tmp_path)}
    )
    assert out.returncode == common.EXIT_FAILED, out.stderr
    assert f"{sys.executable}: No module named tests.no_such_module\n" in out.stderr
    assert "Traceback" not in out.stderr and "runpy" not in out.stderr, out.stderr
    assert "failed: python -m: No module named tests.no_such_module" in out.stderr


def test_a_rove_home_that_cannot_be_written_is_said_in_one_line(tmp_path: Path) -> None:
    """(It was a traceback of pathlib's mkdir, chained five times.)"""
    said = (
        "rove keeps its jobs' events and logs in /proc/rove ($ROVE_HOME, else ~/.rove): No "
        "such file or directory: /proc/rove; set ROVE_HOME to a folder this user can create "
        "and write\n"
    )
    out = rove_cli("run", "--standalone", "examples/train.py", env={"ROVE_HOME": "/proc/rove"})
    assert (out.returncode, out.stderr) == (common.EXIT_USAGE, f"rove run: {said}")
    # a master with its own NATS server keeps the server's store there
    out = rove_cli("master", "--job", "j1", env={"ROVE_HOME": "/proc/rove"})
    assert (out.returncode, out.stderr) == (common.EXIT_USAGE, f"rove master: {said}")
    # a home it can write, where the job's store cannot be made (a file in its place)
    store = tmp_path / "jobs" / "j1" / "nats"
    store.parent.mkdir(parents=True)
    store.write_text("")
    out = rove_cli("master", "--job", "j1", env={"ROVE_HOME": str(tmp_path)})
    assert (out.returncode, out.stderr) == (
        common.EXIT_USAGE,
        f"rove master: cannot keep the NATS server's store in {store}: File exists: {store}\n",
    )


def test_run_help_tells_what_rove_does_with_torchruns_flags() -> None:
    out = rove_cli("run", "--help", check=True).stdout
    flat = " ".join(out.split())
    assert "C10d" not in flat and "TCP store" not in flat, "torchrun's wording is gone"
    assert "embedded NATS JetStream server and a rove master" in flat
    options = flat[flat.index("options:") :]
    for flag in ("--rdzv-backend", "--rdzv-endpoint", "--master-addr", "--master-port"):
        after = options[options.index(flag) :]
        assert "ignored by rove" in after[:300], f"{flag} says it is ignored"


@pytest.mark.parametrize("command", ["jobs", "submit", "auth"])
def test_a_commands_help_keeps_its_examples_one_to_a_line(command: str) -> None:
    """argparse re-wrapped the descriptions: `rove jobs --help` ran its five example
    command lines and what each does into one paragraph."""
    from rove.control.cli.main import build_parser

    parser = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    ).choices[command]
    assert parser.description is not None
    examples = [x for x in parser.description.splitlines() if x.startswith("    rove ")]
    out = rove_cli(command, "--help", check=True).stdout.splitlines()
    assert examples and all(x in out for x in examples), out


def test_an_ignored_torchrun_flag_is_named_in_a_warning() -> None:
    out = rove_cli("run", "--standalone", "--master-addr", "10.1.1.1", "no/such/train.py")
    assert out.returncode == common.EXIT_USAGE
    assert "--master-addr is ignored: rove takes each round's store address" in out.stderr


def test_the_exit_codes_rove_help_lists_are_the_ones_it_uses() -> None:
    """Each is produced where it says, tested: 0 and 1 by every job test, 2 by
    test_user_mistakes_..., 3 and 4 below, 130 and 143 in tests/test_signals.py."""
    flat = " ".join(rove_cli("--help", check=True).stdout.split())
    listed = flat[flat.index("exit codes:") :]
    for code, what in (
        (common.EXIT_OK, "ok"),
        (common.EXIT_FAILED, "failed"),
        (common.EXIT_USAGE, "bad arguments"),
        (common.EXIT_UNREACHABLE, "NATS unreachable"),
        (common.EXIT_UNKNOWN_JOB, "unknown job"),
        (common.EXIT_INTERRUPTED, "interrupted"),
    ):
        assert f"{code} {what}" in listed, listed
    assert "143 SIGTERM" in listed


def test_an_unreachable_server_exits_3() -> None:
    out = rove_cli("status", "--job", "j1", "--nats", f"nats://127.0.0.1:{free_port()}")
    assert out.returncode == common.EXIT_UNREACHABLE
    assert "cannot connect to NATS" in out.stderr and "Traceback" not in out.stderr


def test_an_unknown_job_exits_4(nats_server: EmbeddedServer) -> None:
    assert nats_server.url
    out = rove_cli("status", "--job", "nosuchjob", "--nats", nats_server.url)
    assert out.returncode == common.EXIT_UNKNOWN_JOB
    assert "no events of job 'nosuchjob'" in out.stderr


def test_a_job_whose_server_runs_but_has_no_event_yet_is_starting(
    nats_server: EmbeddedServer,
) -> None:
    """`rove run`'s first line names `rove status`, before the job's first event: asked at
    once, it said "no events of job ...; check the job name" (exit 4)."""
    from rove.control.bus import embedded

    assert nats_server.url
    embedded.url_file("early").parent.mkdir(parents=True)
    embedded.url_file("early").write_text(nats_server.url + "\n")  # as `rove run` does
    out = rove_cli("status", "--job", "early")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "job early: starting (its launcher runs; no event yet)\n"
    events = rove_cli("events", "--job", "early")
    assert events.returncode == common.EXIT_UNKNOWN_JOB
    assert "job 'early' is starting" in events.stderr, events.stderr
    follow = subprocess.Popen(
        [sys.executable, "-m", "rove.control.cli.main", "events", "--job", "early", "-f"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:  # a follow waits for the events to come
        with pytest.raises(subprocess.TimeoutExpired):
            follow.wait(5)
    finally:
        follow.kill()
        _, err = follow.communicate()
    assert "is starting" not in err, err


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("90s", 90), ("5m", 300), ("1.5h", 5400), ("2d", 172800), ("250ms", 0.25)],
)
def test_durations(text: str, seconds: float) -> None:
    assert common.duration(text) == pytest.approx(seconds)


def test_a_time_without_a_zone_is_local_and_one_with_a_zone_is_its_own(zone_ahead: str) -> None:
    utc = dt.datetime(2026, 11, 23, 10, 32, tzinfo=dt.UTC).timestamp()
    at = common.moment_at
    assert at(common.moment("2026-11-23 10:32:00"), 0) == utc - 5.5 * 3600
    assert at(common.moment("2026-11-23T10:32"), 0) == utc - 5.5 * 3600
    assert at(common.moment("2026-11-23T10:32:00Z"), 0) == utc
    assert at(common.moment("2026-11-23T10:32:00+01:00"), 0) == utc - 3600


async def test_a_time_rove_events_printed_given_to_since_means_the_same_time(
    bus: Bus, zone_ahead: str
) -> None:
    """Copied from `rove events`' output (local time) into `--since`, on a machine whose
    zone is not UTC: it starts the listing at that event, not hours off."""
    await bus.publish(factories.joined("old", ts=time.time()))
    await asyncio.sleep(1.0)
    await bus.publish(factories.joined("new", n=1, ts=time.time()))
    listed = await asyncio.to_thread(rove_cli, "events", "--job", "j1", "--nats", bus.url)
    [line] = [x for x in listed.stdout.splitlines() if "node=new" in x]
    printed = line[:23]  # 2026-12-06 21:42:28.123
    assert dt.datetime.fromisoformat(printed).astimezone().utcoffset() == dt.timedelta(
        hours=5, minutes=30
    )
    out = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--since", printed
    )
    assert "node=new" in out.stdout and "node=old" not in out.stdout, out.stdout


async def test_status_and_events_show_scale_plans_and_their_outcomes(bus: Bus) -> None:
    now = time.time()
    await bus.publish(factories.elected("m1", 7, ts=now))
    await bus.publish(factories.configured(7, 30.0))
    for event in factories.scale_events()[:3]:  # submitted, plan 1 (oom), applied
        await bus.publish(event)
    out = await asyncio.to_thread(rove_cli, "status", "--job", "j1", "--nats", bus.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    scaling = next(line for line in lines if line.startswith("scaling:"))
    assert "of 1-2 nodes live (target 1), 1 CPU, 2 GiB each" in scaling
    plan = next(line for line in lines if line.strip().startswith("plan 1"))
    assert "plan 1 oom applied" in plan and "+n0-a1 -n0-a0" in plan
    assert "n0-a0 ran out of memory" in plan
    events = await asyncio.to_thread(
        rove_cli, "events", "--job", "j1", "--nats", bus.url, "--type", "scale_plan"
    )
    [line] = events.stdout.splitlines()
    assert "rule=oom" in line and "launch='n0-a1(4 GiB)'" in line and "remove=n0-a0" in line


def test_status_gives_a_node_that_left_the_last_step_its_workers_reported() -> None:
    """A finished job's node showed step 26, its last heartbeat's, where its workers had
    reported step 30 as they ended (`training_progress`, after the heartbeat)."""
    from rove.control.cli.status_cmd import status_view
    from rove.control.master.evolve import evolve
    from rove.control.master.state import initial

    state = initial("j1")
    for seq, e in enumerate(
        [
            factories.elected("m1", 1),
            factories.configured(1, 30.0),
            factories.joined("n1"),
            factories.progressed("n1", 1, 30, 110.0),
        ],
        start=1,
    ):
        state = evolve(state, e, seq)
    beat = {"n1": factories.heartbeat("n1", ts=109.0, step=26)}
    assert status_view(state, beat, None, 111.0)["nodes"][0]["step"] == 26, "live: its beat"
    state = evolve(state, factories.left("n1"), 5)
    assert status_view(state, beat, None, 111.0)["nodes"][0]["step"] == 30


def test_rove_alone_lists_its_commands_and_version_says_the_version() -> None:
    """(`rove` alone said "the following arguments are required: COMMAND"; `--version`
    was refused.)"""
    import importlib.metadata

    alone = rove_cli()
    assert alone.returncode == common.EXIT_USAGE
    assert "run " in alone.stdout and "status " in alone.stdout, alone.stdout
    version = rove_cli("--version", check=True)
    assert version.stdout.strip() == f"rove {importlib.metadata.version('rove')}"
