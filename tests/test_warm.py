"""Warm start: workers forked from a server that imported torch once."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from rove.agent import warm
from rove.agent.torch_procs import PreformattedTraceback
from tests.support import rove_cli

SCRIPT = Path(__file__).parent / "scripts" / "how_started.py"
ROUNDS = Path(__file__).parent / "scripts" / "warm_rounds.py"


def test_entry_args_split_script_and_module_forms() -> None:
    assert warm.entry_args(["-u", "train.py", "--lr", "1"]) == ("script", "train.py", "--lr", "1")
    assert warm.entry_args(["-u", "-m", "pkg.train", "-x"]) == ("module", "pkg.train", "-x")
    assert warm.entry_args(["train.py"]) == ("script", "train.py")


def test_a_torch_traceback_is_formatted_before_torchs_formatter_sees_it() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    assert PreformattedTraceback().filter(record)
    assert record.exc_info is None
    assert record.exc_text is not None and "RuntimeError: boom" in record.exc_text


def test_torchs_teardown_lines_stay_off_the_console() -> None:
    from rove.agent import torch_procs

    torch_procs.quiet_torch_tracebacks()
    spawn = logging.getLogger("torch.multiprocessing.spawn")
    api = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    said = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    keep = Keep()
    spawn.addHandler(keep)
    api.addHandler(keep)
    try:
        spawn.warning("Terminating process %s via signal %s", 123, "SIGTERM")  # warm
        api.warning("Sending process %s closing signal %s", 124, "SIGTERM")  # fresh
        spawn.warning("something else")
        api.warning("Unable to shutdown process %s via %s", 125, "SIGTERM")
    finally:
        spawn.removeHandler(keep)
        api.removeHandler(keep)
    assert said == ["something else", "Unable to shutdown process 125 via SIGTERM"]


def _run(tmp_path: Path, *flags: str, script_args: tuple[str, ...] = ()) -> tuple[int, str]:
    out = rove_cli(
        "run",
        "--standalone",
        "--job",
        "warmjob",
        "--nproc-per-node",
        "2",
        *flags,
        str(SCRIPT),
        str(tmp_path),
        *script_args,
        timeout=180,
        env={"ROVE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "2"},
    )
    return out.returncode, out.stdout + out.stderr


def _reports(tmp_path: Path) -> dict[str, dict[str, object]]:
    return {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}


def _ended_as_an_interpreter_ends(tmp_path: Path, reports: dict[str, dict[str, object]]) -> None:
    """Each worker ran in a session of its own, ran its script's atexit handlers and
    flushed the file its script left open, as a fresh interpreter does."""
    for rank, r in reports.items():
        assert r["sid"] == r["pid"], "a session of its own, as torchrun's workers have"
        assert (tmp_path / f"{rank}.atexit").read_text() == "ran", "atexit handlers ran"
        assert (tmp_path / f"{rank}.unclosed").read_text() == "flushed at the end"


@pytest.mark.slow
def test_warm_workers_start_with_torch_imported_and_run_the_script_as_main(
    tmp_path: Path,
) -> None:
    # the script's own flags, spelled as rove's or abbreviating several of them
    mine = ("--a", "1", "--job", "x", "--nproc-per-node", "9", "-m", "--", "--max")
    code, log = _run(tmp_path, script_args=mine)  # warm start is the default
    assert code == 0, log[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == ["0", "1"]
    for r in reports.values():
        assert r["start_method"] == "fork", "the platform default, not the server's"
        assert r["torch_preloaded"] is True, "forked from the warm server"
        assert r["name"] == "__main__"
        assert r["argv"] == [str(SCRIPT), str(tmp_path), *mine]
        assert r["path0"] == str(SCRIPT.parent)
        assert r["threads"] == 2, "OMP_NUM_THREADS applied in the forked worker"
        assert f"-u {SCRIPT} {tmp_path}" in str(r["cmdline"]), "ps and pkill -f see the script"
    assert len({r["ppid"] for r in reports.values()}) == 1, "one server forked both"
    assert "rank 0 says hello" in log and "rank 1 says hello" in log
    _ended_as_an_interpreter_ends(tmp_path, reports)
    draws = [tuple(r["draws"]) for r in reports.values()]  # type: ignore[arg-type]
    assert all(len(set(d)) == 2 for d in zip(*draws, strict=True)), (
        "each worker draws its own torch seed and numpy numbers, as a fresh interpreter does"
    )


@pytest.mark.slow
def test_the_first_round_forks_from_the_quick_server_and_a_restart_from_the_one_that_learned(
    tmp_path: Path,
) -> None:
    from rove.agent import forkservers

    home = tmp_path / "home"
    # where the servers say they are ready: short, as the forkserver's AF_UNIX socket
    # lives there too (108 bytes at most; a pytest-xdist tmp_path is longer)
    scratch = Path(tempfile.mkdtemp(prefix="rv-"))
    lib = tmp_path / "lib" / "manymods"
    lib.mkdir(parents=True)
    many = forkservers.LEARN_AT_LEAST + 20
    for n in range(many):
        (lib / f"m{n}.py").write_text(f"VALUE = {n}\n")
    (lib / "__init__.py").write_text("".join(f"from manymods import m{n}\n" for n in range(many)))
    out = rove_cli(
        *("run", "--standalone", "--job", "rounds", "--nproc-per-node", "2"),
        *("--max-restarts", "1", str(ROUNDS), str(tmp_path)),
        timeout=300,
        env={"ROVE_HOME": str(home), "TMPDIR": str(scratch), "PYTHONPATH": str(lib.parent)},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == ["0-0", "0-1", "1-0", "1-1"]
    assert not any(r["launcher_main"] for r in reports.values()), (
        "a forked worker does not run the launcher's main module again"
    )
    first, second = ([reports[f"{restart}-{rank}"] for rank in (0, 1)] for restart in (0, 1))
    assert all(r["torch"] and not r["dynamo"] for r in first), "the quick server"
    assert all(r["torch"] and r["dynamo"] for r in second), "the full server, for restarts"
    assert not any(r["manymods"] for r in first)
    assert all(r["manymods"] for r in second), "the server for restarts learned their imports"
    assert len({r["ppid"] for r in first}) == len({r["ppid"] for r in second}) == 1
    assert first[0]["ppid"] != second[0]["ppid"], "two servers"
    assert "['torch', 'torch.distributed'" in second[0]["server"], (
        "the learned server was forked (from the full one, itself forked from the quick one), "
        f"not started afresh to import torch again: {second[0]['server'][:200]}"
    )
    # the servers' folders are gone, and torch's logs folder (torchelastic_*, which
    # torchrun leaves empty at each run) too: rove's logs are in the job's folder. (What
    # stays is torch's compile cache, torchinductor_<user>, one for every run.)
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == []
    shutil.rmtree(scratch, ignore_errors=True)


def test_a_warm_server_is_started_early_only_where_warm_start_is_wanted() -> None:
    from rove.agent import forkservers

    for argv in (
        ["--no-warm-start", "--standalone", "train.py"],
        ["--tf-ps", "train.py"],
        ["--no-python", "echo"],
        ["--auto-scale", "train.py"],
        ["--help"],
        ["--standalone"],  # no script: the parser will say so
    ):
        assert forkservers.early_start(argv) is False, argv
    assert forkservers.serving() is None


@pytest.mark.slow
def test_without_warm_start_workers_are_fresh_interpreters(tmp_path: Path) -> None:
    code, log = _run(tmp_path, "--no-warm-start")
    assert code == 0, log[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == ["0", "1"]
    for r in reports.values():
        assert r["torch_preloaded"] is False
        assert r["name"] == "__main__" and r["argv"] == [str(SCRIPT), str(tmp_path)]
        assert r["path0"] == str(SCRIPT.parent), "the script's folder, not the working one"
        assert f"-u {SCRIPT} {tmp_path}" in str(r["cmdline"]), "ps and pkill -f see the script"
    _ended_as_an_interpreter_ends(tmp_path, reports)


@pytest.mark.slow
def test_a_fresh_worker_that_raises_fails_with_its_own_traceback(tmp_path: Path) -> None:
    code, log = _run(tmp_path, "--no-warm-start", "--max-restarts", "0", script_args=("--raise",))
    _on_the_console_as_torchrun_and_a_root_cause(code, log)
    assert (tmp_path / "1.atexit").read_text() == "ran", "atexit handlers run after an error"


def _on_the_console_as_torchrun_and_a_root_cause(code: int, log: str) -> None:
    """The workers' output byte for byte (no `[default0]:` prefix, a carriage return
    kept), the failing rank's traceback as an interpreter prints it (none of rove's
    frames, none of torch's second copy), and a root-cause summary at the end."""
    assert code == 1, log[-3000:]
    assert "rank 1 at 1/2\rrank 1 at 2/2\n" in log, log[-3000:]
    assert "[default" not in log
    assert log.count("Traceback (most recent call last)") == 1, log[-3000:]
    traceback = log.split("Traceback (most recent call last):", 1)[1].split("\n")
    frames = [line for line in traceback[:8] if line.startswith("  File ")]
    assert frames == [f'  File "{SCRIPT}", line 51, in <module>'], traceback[:8]
    assert "ValueError: rank 1 refuses on purpose" in traceback[:8]
    summary = log[log.index("rove: root cause: ") :].splitlines()
    assert summary[0].startswith("rove: root cause: rank 1 (local rank 1, pid "), summary
    assert summary[0].endswith(", exit code 1"), summary
    assert summary[1] == "rove:   ValueError: rank 1 refuses on purpose"
    assert summary[2] == f"rove:   at {SCRIPT}:51"
    assert summary[3].startswith("rove:   its output: ") and summary[3].endswith("rank1.stderr")
    assert "/jobs/warmjob/logs/" in summary[3], "kept in the job's folder"
    assert "rank 1 at 2/2" in Path(summary[3].split("its output: ", 1)[1]).read_text()


@pytest.mark.slow
def test_a_warm_worker_that_raises_is_reported_with_its_error(tmp_path: Path) -> None:
    code, log = _run(tmp_path, "--warm-start", "--max-restarts", "0", script_args=("--raise",))
    _on_the_console_as_torchrun_and_a_root_cause(code, log)


@pytest.mark.slow
def test_run_path_runs_the_script_in_a_child_as_main_without_a_new_command(
    tmp_path: Path,
) -> None:
    code, log = _run(tmp_path, "--run-path")
    assert code == 0, log[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == ["0", "1"]
    for r in reports.values():
        assert r["name"] == "__main__" and r["argv"] == [str(SCRIPT), str(tmp_path)]


@pytest.mark.slow
def test_a_folder_with_a_main_runs_as_python_runs_it(tmp_path: Path) -> None:
    """`torchrun app/` runs `python app/`, which runs `app/__main__.py` with the folder
    first on `sys.path`: so do rove's warm workers."""
    app = tmp_path / "app"
    app.mkdir()
    shutil.copy(SCRIPT, app / "__main__.py")
    out = rove_cli(
        *("run", "--standalone", "--job", "folderjob", "--nproc-per-node", "2"),
        *(str(app), str(tmp_path)),
        timeout=180,
        env={"ROVE_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "2"},
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    reports = _reports(tmp_path)
    assert sorted(reports) == ["0", "1"]
    for r in reports.values():
        assert r["torch_preloaded"] is True, "a warm worker"
        assert r["name"] == "__main__" and r["argv"] == [str(app), str(tmp_path)]
        assert r["path0"] == str(app), "the folder first on sys.path, as python puts it"


def test_a_worker_forked_as_its_server_dies_does_not_train_as_an_orphan(tmp_path: Path) -> None:
    """The kernel kills a warm worker when its server (so its agent) dies, but only once
    the worker asked for it: a worker forked just before the server died would train on
    unsupervised. Here the worker's parent is not the server it was forked from."""
    import subprocess

    marker = tmp_path / "trained"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    code = (
        "from rove.agent import warm\n"
        "warm.SERVER_PID = -1  # the server this worker came from is gone\n"
        f"warm.run_script('script', {str(script)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert not marker.exists(), "the orphan ran the training script"
    ok = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("warm.SERVER_PID = -1", "import os; warm.SERVER_PID = os.getppid()"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and marker.read_text() == "yes", ok.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port", "29531"),
        ("--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29532", "--rdzv-id", "tut"),
        # torch elastic's quick start on one machine (it was refused: no --nats)
        ("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29533"),
    ],
)
def test_torchruns_one_node_command_lines_run_on_the_embedded_default(
    tmp_path: Path, flags: tuple[str, ...]
) -> None:
    """(They were refused: "no NATS server to meet the other nodes on".)"""
    out = rove_cli(
        "run",
        "--nproc-per-node",
        "2",
        *flags,
        str(SCRIPT),
        str(tmp_path),
        timeout=180,
        env={"ROVE_HOME": str(tmp_path / "home")},
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    said = (
        "rove: --nnodes 1:4 with its rendezvous at localhost:29533, on this machine, and no "
        "--nats: running as --standalone"
        if "1:4" in flags
        else "rove: one node and no --nats: running as --standalone"
    )
    assert said in log, "one human line"
    assert sorted(_reports(tmp_path)) == ["0", "1"]


def _starved_servers(monkeypatch: pytest.MonkeyPatch) -> Any:
    """forkservers with servers of stdlib modules and one preload that takes a minute to
    import, NICE_FOR_S 0.5 s; multiprocessing's module functions put back afterwards."""
    import multiprocessing.forkserver as mpfs

    from rove.agent import forkservers

    for name in ("_forkserver", "ensure_running", "get_inherited_fds", "connect_to_new_process"):
        monkeypatch.setattr(mpfs, name, getattr(mpfs, name))  # (put back afterwards)
    monkeypatch.setattr(mpfs, "set_forkserver_preload", mpfs.set_forkserver_preload)
    # (a forkserver of Python 3.11 does not take its parent's sys.path: PYTHONPATH)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent / "scripts"))
    monkeypatch.setattr(forkservers, "QUICK", ("json",))
    monkeypatch.setattr(forkservers, "FULL", ("json",))
    monkeypatch.setattr(forkservers, "NICE_FOR_S", 0.5)
    return forkservers


async def _niced_full_server(forkservers: Any) -> tuple[Any, int]:
    """A quick server, then the full one importing at nice 19, forked from the quick one
    once that is ready: (the full one, its pid)."""
    from tests.support import eventually

    assert forkservers.early_start(["train.py"])
    forkservers.start(["slow_import"])
    niced = await eventually(lambda: forkservers._servers.coming, timeout=60)
    assert niced is not None and niced.nice == forkservers.BACKGROUND_NICE
    assert niced.pid is not None
    return niced, niced.pid


def _stop_servers(forkservers: Any) -> None:
    forkservers.stop()
    serving = forkservers._servers.serving
    if serving is not None:
        serving.kill()
    forkservers._servers.serving = None


def _nice_of(pid: int, tid: int) -> int:
    stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[16])  # field 19, nice


async def test_a_full_server_starved_at_a_low_priority_imports_on_at_normal_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where training keeps every core busy a nice-19 import may never finish: after
    NICE_FOR_S the full server's import thread and its session are reniced to 0 in
    place (what it imported so far is kept), where raising a priority is allowed (root
    here); elsewhere it is replaced (the next test)."""
    from tests.support import eventually, pid_alive

    forkservers = _starved_servers(monkeypatch)
    monkeypatch.setattr(forkservers, "NICE_FOR_S", 3600.0)  # (escalated below, once known)
    try:
        niced, pid = await _niced_full_server(forkservers)
        await eventually(lambda: niced.importer_file.exists(), timeout=60)
        tid = int(niced.importer_file.read_text())
        assert _nice_of(pid, tid) == forkservers.BACKGROUND_NICE
        assert os.geteuid() == 0, "(this test needs root: it raises a priority)"
        assert forkservers.escalate() is True
        assert forkservers._servers.coming is niced and pid_alive(pid), "the same server"
        assert niced.nice == 0
        assert _nice_of(pid, tid) == 0, "its import thread imports on at normal priority"
        group = Path(f"/proc/{pid}/autogroup")
        if group.exists():
            assert group.read_text().split()[-1] == "0", group.read_text()
        assert forkservers.escalate() is False, "once"
    finally:
        _stop_servers(forkservers)


async def test_a_starved_full_server_that_may_not_be_reniced_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where rove may not raise a priority (no root, no CAP_SYS_NICE), the starved full
    server is replaced by one that imports at normal priority from the start."""
    from tests.support import eventually, pid_alive

    forkservers = _starved_servers(monkeypatch)
    monkeypatch.setattr(forkservers._Server, "hurry", lambda _self: False)  # (not allowed)
    try:
        niced, pid = await _niced_full_server(forkservers)
        await eventually(lambda: forkservers._servers.coming is not niced, timeout=30)
        now = forkservers._servers.coming
        assert now is not None and now.nice == 0 and now.preload == niced.preload
        assert not pid_alive(pid), "the starved server is gone"
        assert forkservers.escalate() is False, "once"
    finally:
        _stop_servers(forkservers)


def test_a_warm_server_whose_agent_is_gone_ends_quietly(tmp_path: Path) -> None:
    """A job shorter than its quick server's imports: the agent removed the server's
    folder before it could say it was ready. It printed a traceback on the console of
    the job that had ended; it now ends quietly."""
    gone = tmp_path / "gone" / "ready"
    code = "import rove.agent.warm_ready\nprint('went on')"
    env = {**os.environ, "ROVE_WARM_READY_FILE": str(gone)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def _tell_parent(queue: Any) -> None:
    """(In a worker forked from a server:) its parent, whether it found `decimal`
    imported, and the pid its parent stands as."""
    from rove.agent import warm as forked

    queue.put((os.getppid(), "decimal" in sys.modules, forked.SERVER_PID))


async def test_the_full_server_is_forked_from_the_ready_quick_one_and_serves_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The full server is a fork of the quick one once that one is ready (torch imported
    once per node, not twice: `rove.agent.server_fork`), imports what it adds, and goes
    on serving after the quick one is stopped: a worker forked from it finds what it
    added, and the pid it checks its parent against is the full server's."""
    import multiprocessing

    import psutil

    from tests.support import eventually, pid_alive

    forkservers = _starved_servers(monkeypatch)
    monkeypatch.setattr(forkservers, "NICE_FOR_S", 3600.0)
    monkeypatch.setattr(forkservers, "QUICK", ("json", "rove.agent.warm"))  # (as every server)
    try:
        assert forkservers.early_start(["train.py"])
        quick = forkservers._servers.serving
        quick_pid = quick.pid
        forkservers.start(["decimal"])
        full = await eventually(lambda: forkservers._servers.coming, timeout=60)
        assert quick.ready(), "forked once the quick one was ready, not started beside it"
        assert psutil.Process(full.pid).ppid() == quick_pid, "a fork of the quick server"
        await eventually(full.ready, timeout=60)
        assert "decimal" in full.modules()
        forkservers.promote()  # the full one serves; the quick one is stopped
        assert forkservers.serving() == ("full", full.pid)
        assert not pid_alive(quick_pid)
        ctx = multiprocessing.get_context("forkserver")
        queue = ctx.SimpleQueue()
        worker = ctx.Process(target=_tell_parent, args=(queue,))
        worker.start()
        worker.join(60)
        assert worker.exitcode == 0
        assert queue.get() == (full.pid, True, full.pid)
    finally:
        _stop_servers(forkservers)


async def test_with_rove_warm_fork_0_the_full_server_starts_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ROVE_WARM_FORK=0`: the full server is a fresh interpreter (the baseline of
    `benchmarks/warm_servers.py`, and a way out), and serves as one."""
    import psutil

    from tests.support import eventually

    forkservers = _starved_servers(monkeypatch)
    monkeypatch.setattr(forkservers, "NICE_FOR_S", 3600.0)
    monkeypatch.setenv("ROVE_WARM_FORK", "0")
    try:
        assert forkservers.early_start(["train.py"])
        quick_pid = forkservers._servers.serving.pid
        forkservers.start(["decimal"])
        full = await eventually(lambda: forkservers._servers.coming, timeout=60)
        assert psutil.Process(full.pid).ppid() == os.getpid() != quick_pid
        await eventually(full.ready, timeout=60)
        assert "decimal" in full.modules()
    finally:
        _stop_servers(forkservers)


@pytest.mark.slow
def test_a_preloaded_module_of_the_working_folder_is_imported_by_the_forked_full_server(
    tmp_path: Path,
) -> None:
    """`rove run --preload localmod` from the folder that holds `localmod.py`: a restart
    forks from the full server, which imported it. That server is a fork of the quick
    one, whose import path multiprocessing replaces with the agent's (the `rove`
    command's: no working folder in it); it takes the quick server's back, as a server
    started afresh has it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "localmod.py").write_text("VALUE = 1\n")
    scratch = Path(tempfile.mkdtemp(prefix="rv-"))  # (AF_UNIX paths are short)
    try:
        out = subprocess.run(
            [
                *(str(Path(sys.executable).parent / "rove"), "run", "--standalone"),
                *("--job", "preload", "--nproc-per-node", "2", "--max-restarts", "1"),
                *(
                    "--preload",
                    "localmod",
                    str(Path(__file__).parent / "scripts" / "preload_probe.py"),
                ),
                str(tmp_path),
            ],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "ROVE_HOME": str(tmp_path / "home"), "TMPDIR": str(scratch)},
        )
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        reports = _reports(tmp_path)
        assert sorted(reports) == ["0-0", "0-1", "1-0", "1-1"], out.stderr[-2000:]
        assert not reports["0-0"]["localmod"], "the first round forks from the quick server"
        assert reports["1-0"]["localmod"] and reports["1-1"]["localmod"], out.stderr[-2000:]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
