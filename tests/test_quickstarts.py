"""The quick starts of docs/tensorflow.md and docs/streaming.md, followed as written,
through the failures their pages describe: only this machine's paths, the Kafka
address the producer prints and the script's length of training are put in (and,
for the stream, `--inject-fault` to kill a worker mid-stream: a warm-started worker's
rank cannot be told from outside it).

TensorFlow: a worker killed is restarted in place (its default budget needs no flag)
and a parameter server killed restarts the round (the command's `--max-restarts 3`);
the job finishes, rc 0. The stream: rank 1 killed, the job restores from memory and
trains every record it was asked for; `rove status` answers while it runs.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.support import patience

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent


def commands(doc: str, title: str) -> list[list[str]]:
    """The shell commands of the section `title` of docs/`doc`: each ```bash block's
    lines, continuations joined, comments cut, split as a shell would."""
    text = (ROOT / "docs" / doc).read_text()
    start = text.index(f"{title}\n")
    end = text.find("\n#", start + len(title) + 1)
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text[start : end if end >= 0 else None], re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip():
                out.append(shlex.split(line.split("  #")[0]))
    return out


def until(what: Callable[[], bool], timeout: float, said: Callable[[], str]) -> None:
    deadline = time.monotonic() + patience(timeout)
    while not what():
        assert time.monotonic() < deadline, said()
        time.sleep(0.2)


def descendants_with(root: int, name: str, value: str) -> list[psutil.Process]:
    """The processes under `root` started with `name=value` in their environment."""
    found = []
    for p in psutil.Process(root).children(recursive=True):
        try:
            if p.environ().get(name) == value:
                found.append(p)
        except psutil.Error:
            continue
    return found


class Job:
    """A command of the docs run as a process, its console in a file."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.path = cwd / f"{Path(argv[0]).name}-{argv[1]}.log"
        with self.path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def said(self) -> str:
        return self.path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def environment(tmp_path: Path) -> dict[str, str]:
    return {
        # (as a user runs it: no TensorFlow log level of the suite's)
        **{
            k: v for k, v in os.environ.items() if k not in {"ROVE_VERBOSE", "TF_CPP_MIN_LOG_LEVEL"}
        },
        "ROVE_HOME": str(tmp_path / "home"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }


def test_the_tensorflow_quick_start_rides_out_a_worker_and_a_parameter_server(
    tmp_path: Path,
) -> None:
    first = commands("tensorflow.md", "## Running a job")[0]
    assert first[:3] == ["rove", "run", "--standalone"] and "--max-restarts" in first, first
    argv = [
        str(BIN / "rove"),
        *(
            a.replace("/tmp/tf-ckpt", str(tmp_path / "tf-ckpt")).replace(
                "examples/", f"{ROOT}/examples/"
            )
            for a in first[1:]
        ),
    ]
    job = Job(argv, tmp_path, environment(tmp_path))
    try:

        def steps() -> int:
            return max(map(int, re.findall(r"^\[chief\] step (\d+) ", job.said(), re.M)), default=0)

        until(lambda: steps() >= 8, 300, job.said)
        (worker, *_) = descendants_with(job.proc.pid, "ROVE_TF_ROLE", "worker")
        worker.kill()
        at = steps()
        until(lambda: steps() > at, 300, job.said)
        (ps,) = descendants_with(job.proc.pid, "ROVE_TF_ROLE", "ps")
        ps.kill()
        assert job.proc.wait(patience(300)) == 0, job.said()[-4000:]
    finally:
        job.stop()
    said = job.said()
    assert "done at step 79" in said, said[-3000:]  # 20,000 samples in shards of 256
    assert re.search(r"coordinator up in [\d.]+s, restored step [1-9]", said), said[-3000:]
    assert re.search(r"rove: worker \d ended \(killed by SIGKILL\); starting it again", said)
    # TensorFlow's saver retraces at every save by design; its "tracing is expensive"
    # warning, twice a save from the fifth on, is kept off the console (checkpoint.tf)
    assert "tf_function_save" not in said, said[-3000:]
    # TensorFlow's INFO lines are not on the console as the quick start is run (with no
    # TF_CPP_MIN_LOG_LEVEL of the user's: one "Ignoring error status" a step, and more)
    # (but for the oneDNN notice, logged as TensorFlow loads, before it reads the level)
    info = [
        line
        for line in re.findall(r"^\[\w+\] I0000 .*$", said, re.M)
        if "oneDNN custom operations" not in line
    ]
    assert not info and "Ignoring error status" not in said, info[:3]


def test_the_streaming_quick_start_rides_out_a_killed_worker(tmp_path: Path) -> None:
    produce, run, status = commands("streaming.md", "### The online-learning example")
    assert produce[:3] == ["python", "examples/online.py", "produce"], produce
    assert run[:3] == ["rove", "run", "--standalone"] and "--max-restarts" in run, run
    assert status[:2] == ["rove", "status"], status
    env = environment(tmp_path)
    producer = subprocess.Popen(
        [sys.executable, str(ROOT / produce[1]), *produce[2:]],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    job: Job | None = None
    try:
        assert producer.stdout is not None
        address = producer.stdout.readline().strip()
        assert re.fullmatch(r"[\d.]+:\d+(,[\d.]+:\d+)*", address), address
        argv = [str(BIN / "rove"), "run", "--inject-fault", "kill:1@20"]
        for a in run[2:]:
            a = a.replace("127.0.0.1:PORT", address).replace("/tmp/", f"{tmp_path}/")
            argv.append(a.replace("examples/", f"{ROOT}/examples/"))
        job = Job([*argv, "--records", "1500"], tmp_path, env)
        until(lambda: "watch it with: rove status" in job.said(), 120, job.said)
        found = re.search(r"rove: job (\S+), node", job.said())
        assert found is not None, job.said()
        asked = [a.replace("JOB", found.group(1)) for a in status]
        out = subprocess.run(
            [str(BIN / "rove"), *asked[1:]], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0 and out.stdout.startswith(f"job {found.group(1)}"), out
        assert job.proc.wait(patience(400)) == 0, job.said()[-4000:]
    finally:
        producer.kill()
        producer.wait()
        if job is not None:
            job.stop()
    said = job.said()
    assert "rove: worker rank 1 failed: killed" in said, said[-3000:]
    assert re.search(r"online training on 2 workers from step [1-9]\d*, \d+ records trained", said)
    done = re.search(r"done at step \d+: (\d+) records trained", said)
    assert done is not None and int(done.group(1)) >= 1500, said[-3000:]
