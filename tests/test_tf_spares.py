"""A TensorFlow round's tasks start from spares: processes that imported TensorFlow
before they were needed (`rove.agent.tf_spare`, kept by `rove.agent.tf_runtime`).

Real processes: the runtime runs a chief-only round of a small script, keeps a spare
once the chief reports a step, and hands the next round's chief to it. The script
then finds TensorFlow imported without importing it, and runs with its own
arguments, its round's `TF_CONFIG`, an empty stdin and the command line a fresh chief
shows, and the node's temporary folder (removed at `close()`); its exit status is the
task's. A spare that keeps ending before it has a task
is said, replaced by a fresh start, and given up after `SPARE_FAILURES`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from rove.agent import tf_runtime
from rove.agent.runtime import WorkersEnded
from rove.agent.tf_runtime import INDEX_ENV, ROLE_ENV, TfRuntime
from tests.support import eventually

CHIEF = r"""
import json, os, pathlib, sys, tempfile, time
from rove.agent import progress
out = pathlib.Path(os.environ["TEST_OUT"])
progress.report(1)  # at work: the runtime may start its spares now
out.write_text(json.dumps({
    "tf": "tensorflow" in sys.modules,
    "pid": os.getpid(),
    "argv": sys.argv,
    "config": os.environ["TF_CONFIG"],
    "stdin": sys.stdin.read(),
    "tmp": tempfile.gettempdir(),
}))
while not out.with_suffix(".go").exists():
    time.sleep(0.05)
sys.exit(int(os.environ["TEST_CODE"]))
"""


def chief_only(round_: int, out: Path, code: int) -> dict[int, dict[str, str]]:
    config = {
        "cluster": {"chief": [f"127.0.0.1:{40000 + round_}"]},
        "task": {"type": "chief", "index": 0},
        "rpc_layer": "grpc",
    }
    env = {ROLE_ENV: "chief", INDEX_ENV: "0", "TF_CONFIG": json.dumps(config)}
    return {0: {**env, "TEST_OUT": str(out), "TEST_CODE": str(code)}}


def runtime(tmp_path: Path, **kw: Any) -> TfRuntime:
    script = tmp_path / "chief.py"
    script.write_text(CHIEF)
    argv = [sys.executable, "-u", "-m", "rove.agent.child", "--run", "script", str(script), "x"]
    return TfRuntime(
        argv, tmp_path / "logs", tmp_path / "progress", max_restarts=0, echo=sys.stderr, **kw
    )


def spares() -> list[psutil.Process]:
    """This test's live spares (children of this process waiting for a task)."""
    found = []
    for p in psutil.Process().children():
        try:
            if "rove.agent.tf_spare" in " ".join(p.cmdline()) and p.status() != "zombie":
                found.append(p)
        except psutil.Error:
            continue
    return found


async def a_round(
    rt: TfRuntime, round_: int, tmp_path: Path, code: int, *, before_end: Any = None
) -> tuple[dict[str, Any], WorkersEnded]:
    """Run one chief-only round whose chief exits with `code`: what the chief saw, how
    the round ended."""
    out = tmp_path / f"round{round_}.json"
    rt.start(round_, chief_only(round_, out, code))
    waiting = asyncio.ensure_future(rt.wait())
    try:
        seen = json.loads(await eventually(lambda: out.exists() and out.read_text(), timeout=60))
        if before_end is not None:
            await before_end(seen)
        out.with_suffix(".go").touch()
        ended = await asyncio.wait_for(waiting, 60)
    finally:
        waiting.cancel()
        rt.stop()
    return seen, ended


@pytest.mark.slow
async def test_a_new_rounds_chief_starts_from_a_spare_that_imported_tensorflow(
    tmp_path: Path,
) -> None:
    rt = runtime(tmp_path)
    try:
        # round 1: no spare yet, a fresh chief; once it reports a step, one spare
        kept: list[psutil.Process] = []

        async def spare_kept(_: dict[str, Any]) -> None:
            kept.extend(await eventually(spares, timeout=30))

        first, ended = await a_round(rt, 1, tmp_path, 0, before_end=spare_kept)
        assert not first["tf"], "a fresh chief has imported nothing"
        # the node's own temporary folder, removed at close()
        tmp = Path(first["tmp"])
        assert tmp.name.startswith("rove-tf-") and tmp.is_dir(), tmp
        assert ended == WorkersEnded(1, None)
        assert len(kept) == 1

        # round 2: the spare becomes the chief, which exits 3
        refilled: list[psutil.Process] = []

        async def check(seen: dict[str, Any]) -> None:
            # what a fresh chief shows (`ps`, `pkill -f chief.py`)
            shown = " ".join(psutil.Process(seen["pid"]).cmdline()).split()
            assert shown == [sys.executable, "-u", str(tmp_path / "chief.py"), "x"], shown
            refilled.extend(await eventually(spares, timeout=30))

        second, ended = await a_round(rt, 2, tmp_path, 3, before_end=check)
        assert second["pid"] == kept[0].pid, "the spare became the chief"
        assert second["tf"], "TensorFlow was imported before the chief's script ran"
        assert second["argv"] == [str(tmp_path / "chief.py"), "x"]
        assert json.loads(second["config"])["cluster"] == {"chief": ["127.0.0.1:40002"]}
        assert second["stdin"] == "", "the hand-over's pipe is not the task's stdin"
        assert second["tmp"] == str(tmp), "a spare's temporary folder is a fresh task's"
        assert ended.failure is not None and ended.failure.exit_code == 3
        # a new spare replaced the one taken while the round ran; close() lets it go
        assert [p.pid for p in refilled] and [p.pid for p in refilled] != [kept[0].pid]
    finally:
        rt.stop()
        rt.close()
    assert spares() == [], "close() ends the spares"
    assert not tmp.exists(), "close() removes the tasks' temporary folder"


async def test_a_spare_that_ends_before_its_task_is_said_and_given_up_after_three(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tf_runtime, "SPARE_DELAY_S", 0.0)
    rt = runtime(tmp_path)
    rt.spare_argv = [sys.executable, "-c", "print('no TensorFlow here'); raise SystemExit(4)"]
    try:
        with capture_logs() as logs:
            for round_ in range(1, 5):
                seen, ended = await a_round(rt, round_, tmp_path, 0)
                assert not seen["tf"] and ended.failure is None, "a fresh start instead"
    finally:
        rt.stop()
        rt.close()
    said = [e["event"] for e in logs if "spare" in e["event"] and e["log_level"] == "warning"]
    assert len(said) == tf_runtime.SPARE_FAILURES, said
    assert all("ended before it had a task (code 4)" in s for s in said)
    assert "starts its tasks fresh from now on" in said[-1]
    assert next(e["output"] for e in logs if "output" in e) == ["no TensorFlow here"]
    assert not rt.keep_spares
