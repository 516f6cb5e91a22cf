"""SIGINT and SIGTERM (and a terminal's SIGHUP) stop `rove run` at every stage of a
job and leave no process behind; the workers get the signal rove received; a second
signal ends it at once; under `nohup` a hangup is ignored.
Out-of-range numbers are refused before anything starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from rove.control.bus.embedded import EmbeddedServer
from tests.support import (
    TRAIN,
    MasterProc,
    RunProc,
    free_port,
    nats_without_jetstream,
    patience,
    rove_cli,
)

SCRIPTS = Path(__file__).parent / "scripts"
WORKER = SCRIPTS / "signal_worker.py"


class Watched:
    """A `rove run` started in a session of its own (as from a terminal), and every
    process it started, kept as it runs: after it ends, none may be left."""

    def __init__(
        self,
        tmp_path: Path,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] = os.setsid,
    ):
        self.run = RunProc(tmp_path, name, *args, env=env, preexec=preexec)
        self.seen: dict[int, psutil.Process] = {}

    def look(self) -> None:
        try:
            top = psutil.Process(self.run.proc.pid)
            for proc in [top, *top.children(recursive=True)]:
                self.seen.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def wait_for(self, check: object, timeout: float = 120) -> None:
        deadline = time.monotonic() + patience(timeout)
        while time.monotonic() < deadline:
            self.look()
            if callable(check) and check():
                return
            assert self.run.proc.poll() is None, self.run.log()[-3000:]
            time.sleep(0.1)
        pytest.fail(f"not reached within {timeout}s:\n{self.run.log()[-3000:]}")

    def signal(self, sig: int, *, group: bool = False) -> None:
        self.look()
        if group:  # as a terminal's Ctrl-C: the whole foreground process group
            os.killpg(self.run.proc.pid, sig)
        else:
            self.run.proc.send_signal(sig)

    def ended(self, within: float) -> int:
        code = self.run.wait(within)
        deadline = time.monotonic() + patience(10)
        left: list[str] = []
        while time.monotonic() < deadline:
            left = [_described(p) for p in self.seen.values() if _running(p)]
            left = [d for d in left if d]
            if not left:
                return code
            time.sleep(0.1)
        pytest.fail("processes left behind:\n" + "\n".join(left))


def _connected_to(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except psutil.Error:
        return False
    return any(c.raddr and c.raddr.port == port and c.status == "ESTABLISHED" for c in conns)


def _described(proc: psutil.Process) -> str:
    """`pid command...`, or '' when it ended meanwhile (a zombie has no command line)."""
    try:
        return f"{proc.pid} {' '.join(proc.cmdline()[:4])}"
    except psutil.Error:
        return ""


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _started(out: Path, n: int = 2) -> bool:
    return len(list(out.glob("*.started"))) == n


@pytest.mark.slow
@pytest.mark.parametrize("start", ["warm", "fresh"])
def test_ctrl_c_while_training_reaches_the_workers_once_and_lets_them_clean_up(
    tmp_path: Path, start: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    flags = () if start == "warm" else ("--no-warm-start",)
    job = Watched(
        tmp_path, "ctrlc", "--standalone", "--nproc-per-node", "2", *flags, str(WORKER), str(out)
    )
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGINT, group=True)
    assert job.ended(within=60) == 128 + signal.SIGINT
    for rank in ("0", "1"):
        assert (out / f"{rank}.signal").read_text() == "SIGINT", "the signal rove received"
        assert (out / f"{rank}.cleaned").read_text() == "yes", "its clean-up was not cut short"
    assert "received SIGINT; passing it to the workers" in job.run.log()


@pytest.mark.slow
def test_sigterm_while_training_is_passed_to_the_workers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = Watched(tmp_path, "term", "--standalone", "--nproc-per-node", "2", str(WORKER), str(out))
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGTERM)
    assert job.ended(within=60) == 128 + signal.SIGTERM
    assert {(out / f"{r}.signal").read_text() for r in "01"} == {"SIGTERM"}


@pytest.mark.slow
def test_a_terminal_that_closes_stops_the_job_as_ctrl_c_does(tmp_path: Path) -> None:
    """Its SIGHUP, to the whole foreground group: the workers get SIGHUP, the job ends
    `stopped`, nothing is left. (It killed `rove run` at once: a standalone job cut
    off, its workers ended by their parent-death signal.)"""
    out = tmp_path / "out"
    out.mkdir()
    job = Watched(tmp_path, "hup", "--standalone", "--nproc-per-node", "2", str(WORKER), str(out))
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGHUP, group=True)
    assert job.ended(within=60) == 128 + signal.SIGHUP, job.run.log()[-3000:]
    assert {(out / f"{r}.signal").read_text() for r in "01"} == {"SIGHUP"}
    said = job.run.log()
    assert "stopped: rove run received SIGHUP" in said, said[-3000:]
    assert "Traceback" not in said and "died unexpectedly" not in said, said[-3000:]


@pytest.mark.slow
def test_a_signal_named_by_signals_to_handle_stops_the_job_and_reaches_the_workers(
    tmp_path: Path,
) -> None:
    """torchrun's `--signals-to-handle` (SLURM warns a job with SIGUSR1 before its time
    is up): the workers get SIGUSR1, they save and return, and the job ends stopped.
    (The flag was ignored: SIGUSR1 killed `rove run` at once, the job cut off.)"""
    out = tmp_path / "out"
    out.mkdir()
    handled = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    args = ("--standalone", "--nproc-per-node", "2", "--signals-to-handle", handled)
    job = Watched(tmp_path, "usr1", *args, str(WORKER), str(out))
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGUSR1)
    assert job.ended(within=60) == 128 + signal.SIGUSR1, job.run.log()[-3000:]
    assert {(out / f"{r}.signal").read_text() for r in "01"} == {"SIGUSR1"}
    said = job.run.log()
    assert "stopped: rove run received SIGUSR1" in said, said[-3000:]
    assert "has not exited" not in said, "they returned on it: none was killed"


@pytest.mark.parametrize(
    ("value", "why"),
    [("SIGTERM,SIGKILL", "SIGKILL cannot stop the job"), ("SIGTERM,SIGFOO", "SIGFOO is not")],
)
def test_a_signal_that_cannot_stop_the_job_is_refused_before_anything_starts(
    tmp_path: Path, value: str, why: str
) -> None:
    out = rove_cli("run", "--standalone", "--signals-to-handle", value, str(WORKER), "x")
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("rove run:")]
    assert len(lines) == 1 and why in lines[0], out.stderr
    assert not (tmp_path / "rove-home" / "jobs").exists(), "nothing was started"


@pytest.mark.slow
def test_a_job_paused_whole_past_its_node_timeout_trains_on_in_the_same_round(
    tmp_path: Path,
) -> None:
    """Ctrl-Z, then `fg`: the terminal stops `rove run`'s process group (its agent and
    master, its NATS server) for longer than the node timeout, then continues it. The
    master woke, took its node's silence for a lost node (the silence was its own pause),
    and the job began a new round, its workers killed and restarted."""
    args = ("--standalone", "--job", "paused", "--nproc-per-node", "1", "--node-timeout", "3")
    job = Watched(tmp_path, "paused", *args, str(TRAIN), "--steps", "120", "--step-sleep", "0.03")
    job.wait_for(lambda: "step 20/" in job.run.log())
    os.killpg(job.run.proc.pid, signal.SIGSTOP)
    time.sleep(6)  # (real seconds: the pause must outlast the node timeout twice)
    os.killpg(job.run.proc.pid, signal.SIGCONT)
    assert job.ended(within=180) == 0, job.run.log()[-3000:]
    events = rove_cli("events", "--job", "paused", "--json", check=True).stdout
    kinds = [json.loads(line)["type"] for line in events.splitlines()]
    assert "node_lost" not in kinds and kinds.count("round_completed") == 1, kinds


def _nohup() -> None:
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as `nohup` starts its command


@pytest.mark.slow
def test_under_nohup_a_hangup_is_ignored_and_the_job_trains_on(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    args = ("--standalone", "--nproc-per-node", "2", "--no-warm-start", str(WORKER), str(out))
    job = Watched(tmp_path, "nohup", *args, preexec=_nohup)
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGHUP, group=True)
    time.sleep(2)  # (a clean stop takes a second: it would have begun)
    assert job.run.proc.poll() is None, job.run.log()[-3000:]
    assert not list(out.glob("*.signal")), "the workers got nothing"
    job.signal(signal.SIGTERM)
    assert job.ended(within=60) == 128 + signal.SIGTERM
    assert {(out / f"{r}.signal").read_text() for r in "01"} == {"SIGTERM"}


@pytest.mark.slow
def test_a_standalone_job_stopped_by_ctrl_c_ends_stopped_and_a_rerun_goes_on_from_its_save(
    tmp_path: Path,
) -> None:
    """Its one node gone, nobody else could go on with the job: it ends `stopped`, with
    the step its breakpoint persisted committed (it used to stay `running` in its stored
    history for good, the step persisted but never recorded as committed, and a rerun
    under its name joined that run or started afresh beside the saved step)."""
    ckpt = tmp_path / "ckpt"
    args = ("--standalone", "--job", "cc", "--nproc-per-node", "1", "--checkpoint-dir", str(ckpt))
    train = (str(TRAIN), "--data", "generated", "--ckpt-every", "5", "--log-every", "10")
    job = Watched(
        tmp_path,
        "cc1",
        *args,
        "--save-at-breakpoint",
        *train,
        "--steps",
        "100000",
        *("--step-sleep", "0.02"),
    )
    job.wait_for(lambda: "step 20/" in job.run.log())
    follower = subprocess.Popen(  # `rove events --follow` ends as the job does
        [sys.executable, "-m", "rove.control.cli.main", "events", "--job", "cc", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # (following once it printed: one that attaches to a standalone job's server in
    # the server's last moment waits for it without end, a race left to the product)
    assert follower.stdout is not None
    printed, deadline = b"", time.monotonic() + patience(60)
    while b"\n" not in printed and time.monotonic() < deadline:  # (from the pipe itself:
        if select.select([follower.stdout], [], [], 1.0)[0]:  # communicate reads it so)
            printed += os.read(follower.stdout.fileno(), 65536) or b"\n"
    first = printed.decode()
    assert first.strip(), "rove events --follow printed nothing"
    job.signal(signal.SIGINT, group=True)
    assert job.ended(within=60) == 128 + signal.SIGINT
    try:
        rest, unsaid = follower.communicate(timeout=patience(30))
    finally:
        follower.kill()
    followed = first + rest
    assert follower.returncode == 0, unsaid
    assert unsaid.startswith("rove events: job cc has ended (stopped"), unsaid
    assert unsaid.endswith("): nothing more will come\n") and unsaid.count("\n") == 1, unsaid
    assert "job_ended" in followed and "phase=stopped" in followed, followed[-2000:]
    said = re.search(
        r"rove: job cc stopped: rove run received SIGINT; its last checkpoint, step (\d+), "
        r"is committed to storage",
        job.run.log(),
    )
    assert said is not None, job.run.log()[-3000:]
    saved = int(said[1])
    assert saved >= 20
    status = rove_cli("status", "--job", "cc", check=True).stdout
    assert status.startswith("job cc: stopped (rove run received SIGINT"), status
    rerun_at = time.time()
    again = RunProc(tmp_path, "cc2", *args, *train, "--steps", str(saved + 10))
    assert again.wait(120) == 0, again.log()[-3000:]
    log = again.log()
    assert f"found step {saved} committed in {ckpt}" in log
    assert f"restored step {saved} from storage" in log, log[-3000:]
    assert "rove: job cc finished" in log
    (row,) = [
        json.loads(line) for line in rove_cli("jobs", "--json", check=True).stdout.splitlines()
    ]
    assert (row["state"], row["rounds"]) == ("finished", 1), "the newest run's"
    assert row["start"] >= rerun_at, "the newest run's start, not the first run's"


@pytest.mark.slow
def test_a_second_signal_ends_a_job_whose_workers_ignore_the_first_at_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    job = Watched(
        tmp_path,
        "stubborn",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "600",  # the workers would get ten minutes to stop
        str(WORKER),
        str(out),
        "ignore-term",
    )
    job.wait_for(lambda: _started(out))
    job.signal(signal.SIGTERM)
    job.wait_for(lambda: "passing it to the workers" in job.run.log())
    job.signal(signal.SIGTERM)
    assert job.ended(within=30) == 128 + signal.SIGTERM
    assert "SIGTERM again: killing the workers and leaving at once" in job.run.log()


@pytest.mark.slow
def test_a_signal_while_the_warm_server_imports_stops_the_job_at_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # the warm servers take a minute to start (sitecustomize): the round waits for one
    slow = SCRIPTS / "slow_servers"
    job = Watched(
        tmp_path,
        "importing",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(WORKER),
        str(out),
        env={"PYTHONPATH": os.pathsep.join([str(slow), os.environ.get("PYTHONPATH", "")])},
    )
    job.wait_for(lambda: "decided round_completed" in job.run.log())
    time.sleep(0.5)
    job.signal(signal.SIGINT)
    assert job.ended(within=20) == 128 + signal.SIGINT
    assert not list(out.glob("*.started")), "no worker was started after the signal"
    # (the thread waiting for the server printed its EOFError once the server was stopped)
    assert "Traceback" not in job.run.log(), job.run.log()[-3000:]


@pytest.mark.slow
def test_a_signal_before_the_round_forms_stops_the_node(
    nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    assert nats_server.url is not None
    master = MasterProc(nats_server.url, "waits", "m1", tmp_path)
    job = Watched(
        tmp_path,
        "waiting",
        *("--nats", nats_server.url, "--job", "waits", "--node-id", "n1", "--nnodes", "2"),
        str(WORKER),
        str(tmp_path),
    )
    job.wait_for(lambda: "waiting for a rendezvous round" in job.run.log())
    job.signal(signal.SIGTERM)
    assert job.ended(within=30) == 128 + signal.SIGTERM
    master.stop()


@pytest.mark.slow
@pytest.mark.parametrize("bus", ["nothing listens", "no JetStream"])
def test_a_signal_while_the_node_waits_for_its_bus_stops_it_at_once(
    tmp_path: Path, bus: str
) -> None:
    """A node waits for a bus that is not there (yet) however long, saying so once a
    minute; the first Ctrl-C ends that wait (it used to be ignored until a second one)."""
    with contextlib.ExitStack() as stack:
        if bus == "no JetStream":  # it connects, then waits for JetStream's streams
            port = stack.enter_context(nats_without_jetstream())
        else:
            port = free_port()
        job = Watched(
            tmp_path,
            "nobus",
            *("--nats", f"nats://127.0.0.1:{port}", "--job", "nobus", "--nnodes", "1"),
            str(WORKER),
            str(tmp_path),
        )
        if bus == "nothing listens":
            job.wait_for(lambda: "waiting for the bus" in job.run.log())
        else:  # connected: waiting for JetStream (said after the first 30 s of tries)
            job.wait_for(lambda: _connected_to(job.run.proc.pid, port))
        job.signal(signal.SIGINT, group=True)
        assert job.ended(within=20) == 128 + signal.SIGINT
        assert "SIGINT before the job started: stopping" in job.run.log()
        assert "again" not in job.run.log(), "one signal was enough"


@pytest.mark.parametrize(
    ("command", "who"),
    [
        (("master", "--job", "j1", "--id", "m1"), "master m1"),
        (("scaler", "--job", "j1", "--id", "s1"), "scaler s1"),
        (("agent", "--pool", "p1", "--id", "a1"), "pool agent a1"),
    ],
)
def test_a_daemon_waiting_for_its_bus_stops_at_the_first_signal(
    tmp_path: Path, command: tuple[str, ...], who: str
) -> None:
    """As `rove run`'s node above: a daemon waits for its bus however long, and the
    first signal ends the wait, with the status a signal gives (128 + its number)."""
    err = tmp_path / "stderr"
    with err.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rove.control.cli.main",
                *command,
                "--nats",
                f"nats://127.0.0.1:{free_port()}",
            ],
            stderr=out,
            env={**os.environ, "ROVE_HOME": str(tmp_path / "home")},
        )
    try:
        deadline = time.monotonic() + patience(60)
        while "waiting for the bus" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # (Ctrl-C: it used to be ignored here)
        assert proc.wait(patience(20)) == 128 + signal.SIGINT, err.read_text()
        assert f"rove: SIGINT before {who} started: stopping" in err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--nproc-per-node", "0"),
        ("--nproc-per-node", "-1"),
        ("--nproc-per-node", "two"),
        ("--max-restarts", "-1"),
        ("--persist-every", "0"),
        ("--keep-checkpoints", "0"),
        ("--shutdown-timeout", "-5"),
        ("--node-unit", "0"),
    ],
)
def test_an_out_of_range_number_is_refused_before_anything_starts(
    tmp_path: Path, flag: str, value: str
) -> None:
    out = rove_cli("run", "--standalone", flag, value, str(WORKER), str(tmp_path))
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("rove run:")]
    assert len(lines) == 1 and flag in lines[0], out.stderr
    assert not (tmp_path / "rove-home" / "jobs").exists(), "nothing was started"
