"""A round's forked workers (`rove.agent.procs.Forked`): how their ends are reported."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
import structlog.testing

from rove.agent import procs
from rove.agent.workers import root_failure
from tests.support import patience


def _ignores_sigterm_or_fails(local_rank: int, folder: str) -> None:
    ready = Path(folder) / "ignoring"
    if local_rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a handler that does not exit
        ready.write_text("")
        time.sleep(120)
    while not ready.exists():
        time.sleep(0.01)
    sys.exit(3)


def test_the_worker_that_failed_is_the_cause_not_the_peer_killed_at_the_graces_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # rank 1 exits 3; rank 0 ignores the teardown's SIGTERM and is killed when the grace
    # ends, seconds later. Once both were stamped after the teardown, alike, and rank 0
    # was said as the root cause ("killed by SIGKILL"), rank 1's exit nowhere.
    monkeypatch.setattr(procs, "TEARDOWN_GRACE_S", 1.0)
    args = {lr: (lr, str(tmp_path)) for lr in (0, 1)}
    forked = procs.Forked(_ignores_sigterm_or_fails, args, {0: {}, 1: {}}, {}, "fork")
    deadline = time.monotonic() + patience(60)
    with structlog.testing.capture_logs() as said:
        while (result := forked.poll()) is None:
            assert time.monotonic() < deadline, "the workers never ended"
            time.sleep(0.05)
    assert [e["event"] for e in said] == [
        "worker 0 has not exited 1s after SIGTERM: killing it (SIGKILL)"
    ], "the wait said, as torchrun says it"
    assert result.failures[1].exitcode == 3
    assert result.failures[0].exitcode == -signal.SIGKILL
    root = root_failure(result, kept=lambda *_: None)
    assert root is not None and (root.local_rank, root.exit_code) == (1, 3)


def _returns_on_sigusr1(local_rank: int, folder: str) -> None:
    def saved(_signum: int, _frame: object) -> None:
        sys.exit(0)  # (a script that saves on SLURM's warning, then returns)

    signal.signal(signal.SIGUSR1, saved)
    (Path(folder) / f"ready{local_rank}").write_text("")
    time.sleep(120)


def test_a_worker_that_returns_on_the_stop_signal_exits_and_is_not_killed(
    tmp_path: Path,
) -> None:
    # a worker's return waits until its value is read, and a round being closed never
    # read it: a worker that returned on `rove run --signals-to-handle SIGUSR1`'s signal
    # waited out the shutdown timeout and was killed with SIGKILL
    args = {lr: (lr, str(tmp_path)) for lr in (0, 1)}
    forked = procs.Forked(_returns_on_sigusr1, args, {0: {}, 1: {}}, {}, "fork")
    deadline = time.monotonic() + patience(60)
    while len(list(tmp_path.glob("ready*"))) < 2:
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.05)
    with structlog.testing.capture_logs() as said:
        forked.close(signal.SIGUSR1, timeout=patience(60))
    assert not said, said
    assert [p.exitcode for p in forked.processes] == [0, 0], "returned, not killed"


def _returns(local_rank: int) -> dict[str, int]:
    return {"rank": local_rank}


def test_a_rounds_workers_return_through_pipes_and_make_no_named_semaphore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # under the forkserver (the warm server's way) a multiprocessing queue or event is
    # named semaphores in /dev/shm, unlinked by the resource tracker: a node killed with
    # its tracker (SIGKILL to its process group) left them there for good
    import multiprocessing.resource_tracker

    registered: list[tuple[str, str]] = []
    real = multiprocessing.resource_tracker.register

    def register(name: str, rtype: str) -> None:
        registered.append((name, rtype))
        real(name, rtype)

    monkeypatch.setattr(multiprocessing.resource_tracker, "register", register)
    args = {lr: (lr,) for lr in (0, 1)}
    forked = procs.Forked(_returns, args, {0: {}, 1: {}}, {}, "forkserver")
    deadline = time.monotonic() + patience(60)
    while (result := forked.poll()) is None:
        assert time.monotonic() < deadline, "the workers never returned"
        time.sleep(0.05)
    assert result.return_values == {0: {"rank": 0}, 1: {"rank": 1}}
    assert not result.failures
    assert [p.exitcode for p in forked.processes] == [0, 0], "they exit once both were read"
    assert [r for r in registered if r[1] == "semaphore"] == []
