"""A console that goes away (`rove run ... 2>&1 | head`), or a log its disk refuses, does
not stop the job: rove points the console at /dev/null, drops the log's lines while the
disk refuses them, and goes on. (A line said to the closed pipe raised BrokenPipeError
in the agent's task, its supervisor's line about that raised too, and the node hung for
good, deaf to SIGTERM; a full log disk ended the agent.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rove.control.process.logs import KeptLog, SurvivingConsole
from tests.support import patience

ROVE = [sys.executable, "-m", "rove.control.cli.main"]


def test_a_console_whose_reader_left_is_pointed_at_dev_null() -> None:
    read, write = os.pipe()
    console = SurvivingConsole(os.fdopen(write, "w"))
    os.close(read)
    console.write("rove: round 1: started 2 workers\n")
    console.flush()  # EPIPE: the reader is gone
    assert console.gone
    assert str(Path(f"/proc/self/fd/{write}").readlink()) == os.devnull
    console.write("rove: job j finished\n")
    console.flush()
    console.stream.close()


def test_a_full_non_blocking_console_loses_a_line_not_the_console() -> None:
    """(A parent may hand rove a non-blocking pipe: a burst fills it, EAGAIN.)"""
    read, write = os.pipe()
    os.set_blocking(write, False)
    console = SurvivingConsole(os.fdopen(write, "w"))
    console.write("x" * (1 << 20))  # more than the pipe holds: EAGAIN
    console.flush()
    assert not console.gone
    assert str(Path(f"/proc/self/fd/{write}").readlink()).startswith("pipe:")
    os.close(read)
    with contextlib.suppress(OSError):
        console.stream.close()


@pytest.mark.parametrize("fails", [False, True], ids=["finishes", "fails"])
def test_a_job_whose_console_reader_left_after_its_first_line_runs_to_its_end(
    tmp_path: Path, fails: bool
) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "for i in range(20):\n"
        "    print('rank', os.environ['RANK'], 'line', i, flush=True)\n"
        "    time.sleep(0.05)\n"
        f"sys.exit('bad config on rank ' + os.environ['RANK'] if {fails} else 0)\n"
    )
    home = tmp_path / "home"
    proc = subprocess.Popen(
        [*ROVE, "run", "--standalone", "--job", "gone", "--nproc-per-node", "2", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "ROVE_HOME": str(home)},
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith(b"rove: "), first
    proc.stdout.close()  # as `| head -1` does
    log = home / "jobs" / "gone" / "logs"
    try:
        code = proc.wait(patience(120))
    except subprocess.TimeoutExpired:
        proc.kill()
        said = [p.read_text()[-3000:] for p in log.rglob("rove.log")]
        pytest.fail(f"rove run hung after its console went away: {said}")
    said = "".join(p.read_text() for p in log.rglob("rove.log"))
    if fails:
        assert code == 1, said[-3000:]
        assert "the last line it wrote: bad config on rank" in said
    else:
        assert code == 0, said[-3000:]
        assert '"phase": "finished"' in said, said[-3000:]
    # the workers' output is still kept, past the console's end
    kept = "".join(p.read_text() for p in log.rglob("rank0.stdout"))
    assert "rank 0 line 19" in kept


def test_a_log_the_disk_refuses_drops_its_lines_says_so_once_and_tries_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disk = Path("/dev/full").open("a", buffering=1, encoding="utf-8")  # noqa: SIM115
    full = KeptLog(disk, Path("rove.log"))
    for _ in range(3):
        full.write('{"event": "round 1: started 2 workers"}\n')  # ENOSPC
        full.flush()
    said = capsys.readouterr().err
    assert said.count("rove: cannot write rove's log rove.log (No space left on device") == 1
    assert "the job goes on" in said
    full.stream = (tmp_path / "rove.log").open("a", buffering=1, encoding="utf-8")  # room again
    full.write("back\n")
    full.flush()
    assert not full.refused and (tmp_path / "rove.log").read_text() == "back\n"


def test_a_job_whose_log_disk_is_full_trains_to_its_end(tmp_path: Path) -> None:
    """rove.log on a disk that refuses every line (`/dev/full`, ENOSPC): the job finishes,
    said once. (The first line's error ended the agent: a full log disk ended the job.)"""
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('rank', os.environ['RANK'], 'done')\n")
    home = tmp_path / "home"
    log = home / "jobs" / "full" / "logs" / "vm" / "rove.log"
    log.parent.mkdir(parents=True)
    log.symlink_to("/dev/full")
    out = subprocess.run(
        [*ROVE, "run", "--standalone", "--job", "full", *("--node-id", "vm"), str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "ROVE_HOME": str(home)},
        timeout=patience(120),
    )
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "rank 0 done" in said and "job full finished" in said, said[-3000:]
    assert said.count("cannot write rove's log") == 1, said[-3000:]
