"""The worker runtime port's contract, run against each way torch workers start.

`fresh`: a new interpreter per worker (`python -u -m rove.agent.child --run script SCRIPT`);
`warm`: a function entrypoint forked from the warm server, through torch's process
context (torch's logs: `--tee`); `warm-echoed`: the same through rove's own
(`rove.agent.procs`, rove's logs: the default of `rove run`). A TensorFlow runtime
will pass the same suite.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

from rove.agent import warm
from rove.agent.echo import EchoedLogs
from rove.agent.runtime import WorkerRuntime
from rove.agent.workers import TorchRuntime
from rove.control.catalogue.events import FailureKind
from tests.support import eventually, patience, pid_alive

pytestmark = pytest.mark.slow

SCRIPT = """
import os, sys, time
from rove.agent.progress import report
rank = int(os.environ["LOCAL_RANK"])
report(int(os.environ.get("STEP", "1")), samples=8)
time.sleep(float(os.environ.get("SLEEP", "0")))
if os.environ.get("FAIL_RANK") == str(rank):
    raise SystemExit(int(os.environ.get("CODE", "3")))
if os.environ.get("RAISE_RANK") == str(rank):
    raise ValueError("rank refuses")
if os.environ.get("EXIT0_RANK") == str(rank):
    sys.exit(0 if rank else None)
if os.environ.get("SEGV_RANK") == str(rank):
    import signal
    os.kill(os.getpid(), signal.SIGSEGV)
if os.environ.get("LINGER_RANK") == str(rank):  # returns, then never exits
    import threading
    threading.Thread(target=time.sleep, args=(3600,)).start()
"""


@pytest.fixture(params=["fresh", "warm", "warm-echoed"])
def runtime(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[WorkerRuntime]:
    made = _runtime(request.param, tmp_path)
    yield made
    # a failed test may leave workers (and torch's threads that tee their logs) behind
    made.stop(signal.SIGKILL, 1.0)


def _runtime(kind: str, tmp_path: Path) -> WorkerRuntime:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    # as `rove run` sets them: stderr on the console and in a file, for the diagnosis
    logs = DefaultLogsSpecs(log_dir=str(tmp_path / "logs"), redirects=Std.NONE, tee=Std.ERR)
    if kind.startswith("warm"):
        warm.start(())
        return TorchRuntime(
            warm.run_script,
            ["script", str(script)],
            EchoedLogs(tmp_path / "logs") if kind == "warm-echoed" else logs,
            tmp_path / "progress",
            start_method="forkserver",
        )
    return TorchRuntime(
        sys.executable,
        ["-u", "-m", "rove.agent.child", "--run", "script", str(script)],
        logs,
        tmp_path / "progress",
    )


def envs(n: int, **extra: str) -> dict[int, dict[str, str]]:
    base = {"WORLD_SIZE": str(n), "PYTHONPATH": os.pathsep.join(sys.path)}
    return {lr: {**base, "RANK": str(lr), "LOCAL_RANK": str(lr), **extra} for lr in range(n)}


async def test_workers_that_all_exit_0_end_the_round_without_a_failure(
    runtime: WorkerRuntime,
) -> None:
    pids = runtime.start(1, envs(2))
    assert sorted(pids) == [0, 1] and runtime.running and runtime.round == 1
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.round == 1 and ended.failure is None
    assert not runtime.running


async def test_a_failed_worker_is_the_rounds_failure_and_the_others_are_torn_down(
    runtime: WorkerRuntime,
) -> None:
    runtime.start(2, envs(2, FAIL_RANK="1", CODE="3", SLEEP="0.2"))
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.failure is not None
    assert ended.failure.local_rank == 1 and ended.failure.exit_code == 3
    assert not runtime.running


async def test_a_script_that_exits_0_has_returned(runtime: WorkerRuntime) -> None:
    runtime.start(1, envs(2, EXIT0_RANK="0"))  # sys.exit(None) in rank 0
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.failure is None
    runtime.start(2, envs(2, EXIT0_RANK="1"))  # sys.exit(0) in rank 1
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.failure is None


async def test_a_python_error_is_diagnosed_from_the_log(runtime: WorkerRuntime) -> None:
    runtime.start(1, envs(1, RAISE_RANK="0"))
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.failure is not None
    assert ended.failure.diagnosis.kind is FailureKind.USER_ERROR
    assert "ValueError: rank refuses" in ended.failure.diagnosis.reason


async def test_waiting_uses_the_processes_not_a_polling_loop(
    runtime: WorkerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    polls = 0
    real_poll = runtime._poll  # type: ignore[attr-defined]

    def counted() -> object:
        nonlocal polls
        polls += 1
        return real_poll()

    monkeypatch.setattr(runtime, "_poll", counted)
    runtime.start(1, envs(2, SLEEP="2"))
    ended = await asyncio.wait_for(runtime.wait(), patience(120))
    assert ended.failure is None
    # once at the start, once per worker's return and exit (a few more on a loaded
    # machine, whose wakes come apart: CI saw 9): not every 0.1 s for 2 s (20 or more)
    assert polls <= 12, polls


async def test_a_cancelled_wait_leaves_the_workers_running_and_stop_ends_them(
    runtime: WorkerRuntime,
) -> None:
    pids = runtime.start(1, envs(2, SLEEP="60"))
    waiter = asyncio.create_task(runtime.wait())
    await asyncio.sleep(0.5)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert runtime.running and all(pid_alive(p) for p in pids.values())
    await asyncio.to_thread(runtime.stop, signal.SIGTERM, 10.0)
    assert not runtime.running
    assert not any(pid_alive(p) for p in pids.values())


async def test_progress_reports_each_ranks_step(runtime: WorkerRuntime) -> None:
    runtime.start(1, envs(2, STEP="7", SLEEP="60"))
    try:
        for _ in range(600):
            if len(runtime.progress()) == 2:
                break
            await asyncio.sleep(0.1)
        steps = {lr: p.step for lr, p in runtime.progress().items()}
        assert steps == {0: 7, 1: 7}
    finally:
        await asyncio.to_thread(runtime.stop, signal.SIGTERM, 10.0)


async def test_a_worker_stuck_after_its_script_returned_is_seen_and_ended_as_done(
    runtime: WorkerRuntime,
) -> None:
    """A script that returns with a thread that never ends keeps its process alive, as
    in a fresh interpreter: the runtime shows it returned but not ended, and a worker
    the agent ends then counts as done (`rove.agent.exit_watch`)."""
    pids = runtime.start(1, envs(2, LINGER_RANK="1"))

    def lingering() -> bool:
        a = runtime.activity()
        done = 0 not in a or not a[0].alive or a[0].ended_at > 0  # warm: waits for rank 1
        return 1 in a and a[1].returned_at > 0 and done

    await eventually(lingering, timeout=60)
    stuck = runtime.activity()[1]
    assert stuck.alive and stuck.ended_at == 0, "its ending waits for the thread"
    assert stuck.step == 1
    await asyncio.to_thread(runtime.end, 1)
    ended = await asyncio.wait_for(runtime.wait(), patience(60))
    assert ended.failure is None, "its work was done: the round succeeded"
    assert not runtime.running
    assert not any(pid_alive(p) for p in pids.values())


@pytest.mark.parametrize("kind", ["warm", "warm-echoed"])
async def test_a_warm_worker_killed_by_a_fatal_signal_prints_its_python_stacks(
    tmp_path: Path, kind: str
) -> None:
    """As torch's `@record` does for a function entrypoint: faulthandler is on."""
    runtime = _runtime(kind, tmp_path)
    try:
        runtime.start(1, envs(1, SEGV_RANK="0"))
        ended = await asyncio.wait_for(runtime.wait(), patience(120))
    finally:
        runtime.stop(signal.SIGKILL, 1.0)
    assert ended.failure is not None and ended.failure.exit_code == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in ended.failure.log_tail


def test_a_cut_error_file_of_a_terminated_worker_does_not_break_the_diagnosis(
    tmp_path: Path,
) -> None:
    from rove.agent.procs import Failure

    cut = tmp_path / "error.json"
    cut.write_text('{"message": {"mess')
    failure = Failure(1, 4242, -15, str(cut))
    assert (failure.local_rank, failure.exitcode) == (1, -15)
    assert failure.error_file == "<N/A>", "read as no error file (torch's placeholder)"
    whole = tmp_path / "whole.json"
    whole.write_text('{"message": {"message": "ValueError: x", "extraInfo": {"timestamp": "1"}}}')
    assert Failure(0, 1, 1, str(whole)).error_file == str(whole)


@pytest.mark.parametrize(
    "content",
    [
        None,
        {"message": {"message": "ValueError: x", "extraInfo": {"timestamp": "17"}}},
        {"message": "RuntimeError: y", "timestamp": 23},
    ],
)
def test_a_failure_reads_its_error_file_as_torch_does(tmp_path: Path, content: object) -> None:
    import json

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from rove.agent.procs import Failure

    path = tmp_path / "error.json"
    if content is not None:
        path.write_text(json.dumps(content))
    ours, theirs = Failure(0, 1, -9, str(path)), ProcessFailure(0, 1, -9, str(path))
    assert ours.error_file == theirs.error_file
    if content is None:  # (torch adds to its shared placeholder dict as it goes)
        assert ours.error_file_data["message"] == theirs.error_file_data["message"]
    else:
        assert ours.error_file_data == theirs.error_file_data
        assert ours.timestamp == theirs.timestamp
