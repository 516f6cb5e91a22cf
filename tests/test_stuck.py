"""Workers that do not end: which look stuck (pure), and what their stacks say."""

from __future__ import annotations

from rove.agent import stacks
from rove.agent.exit_watch import Verdict
from rove.agent.stuck import Activity, Quiet


def busy(cpu: float, *, step: int = 5, io: int = 100, returned: float = 0.0) -> Activity:
    return Activity(cpu_s=cpu, io=io, step=step, returned_at=returned)


def test_a_worker_without_cpu_io_or_steps_for_the_timeout_is_examined_once_per_spell() -> None:
    q = Quiet(timeout_s=10)
    assert q.observe({0: busy(1.0)}, 0.0) == []
    assert q.observe({0: busy(1.05)}, 9.0) == [], "not quiet long enough yet"
    (suspect,) = q.observe({0: busy(1.07)}, 10.5)  # 0.7% of a core: a GIL waiter's wakeups
    assert suspect.local_rank == 0 and suspect.quiet_s == 10.5 and not suspect.after_return
    assert q.observe({0: busy(1.08)}, 15.0) == [], "not again within the same spell"
    assert [s.local_rank for s in q.observe({0: busy(1.09)}, 21.0)] == [0], "a timeout later"


def test_cpu_io_a_step_or_a_return_is_life_and_starts_the_spell_again() -> None:
    for lively in (busy(3.0), busy(1.0, io=101), busy(1.0, step=6), busy(1.0, returned=5.0)):
        q = Quiet(timeout_s=10)
        q.observe({0: busy(1.0)}, 0.0)
        assert q.observe({0: lively}, 8.0) == []
        assert q.observe({0: lively}, 12.0) == [], f"{lively} reset the quiet spell"
        assert q.observe({0: lively}, 18.5) != []


def test_a_suspect_knows_which_ranks_returned_even_those_that_exited() -> None:
    q = Quiet(timeout_s=10)
    gone = Activity(cpu_s=0, io=0, step=-1, returned_at=3.0, alive=False)
    q.observe({0: busy(1.0), 1: gone}, 0.0)
    (suspect,) = q.observe({0: busy(1.0), 1: gone}, 11.0)
    assert suspect.local_rank == 0 and suspect.returned == (1,) and suspect.after_return


def test_a_worker_whose_ending_is_over_only_waits_for_its_peers_and_is_never_suspected() -> None:
    q = Quiet(timeout_s=10)
    waiting = Activity(cpu_s=1, io=1, step=-1, returned_at=2.0, ended_at=2.5)
    q.observe({0: busy(1.0), 1: waiting}, 0.0)
    assert [s.local_rank for s in q.observe({0: busy(1.0), 1: waiting}, 11.0)] == [0]


# A trimmed `py-spy dump --native` of a rank caught in torch 2.13's gloo teardown deadlock.
DEADLOCK = """\
Process 5050: /usr/bin/python3 -u teardown_deadlock.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 5050 (idle): "MainThread"
    0x7fd4c20a3f16 (libc.so.6)
    std::thread::join (libstdc++.so.6.0.30)
    c10d::ProcessGroupGloo::~ProcessGroupGloo (libtorch_cpu.so)
    c10d::Reducer::~Reducer (libtorch_cpu.so)
    pybind11_object_dealloc (libtorch_python.so)
    main (teardown_deadlock.py:44)
    <module> (teardown_deadlock.py:55)
Thread 5063 (idle)
    pthread_cond_timedwait (libc.so.6)
    pybind11::gil_scoped_acquire::gil_scoped_acquire (libtorch_python.so)
    at::ThreadLocalState::~ThreadLocalState (libtorch_cpu.so)
    c10d::ProcessGroupGloo::AsyncWork::~AsyncWork (libtorch_cpu.so)
    c10d::ProcessGroupGloo::runLoop (libtorch_cpu.so)
"""

SLEEPING = """\
Process 77: /usr/bin/python3 -u train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 77 (idle): "MainThread"
    sleep (time.py:1)
    upload (train.py:30)
    <module> (train.py:40)
"""


def test_stacks_name_torchs_teardown_deadlock_or_the_innermost_python_frame() -> None:
    assert stacks.diagnose(DEADLOCK) == stacks.TEARDOWN_DEADLOCK
    assert stacks.diagnose(SLEEPING) == "in sleep at time.py:1"
    assert stacks.diagnose("(no stacks: py-spy is not installed)") == ""
    joined_only = DEADLOCK.split("Thread 5063")[0]
    assert stacks.diagnose(joined_only) == "in main at teardown_deadlock.py:44", (
        "a join alone is not the deadlock: the other thread must wait for the GIL"
    )
    drains = DEADLOCK.replace("std::thread::join", "std::condition_variable::wait")
    assert stacks.diagnose(drains) == stacks.TEARDOWN_DEADLOCK, "waiting for the queue"


def test_a_verdict_says_where_the_rank_is_stuck_and_after_whom() -> None:
    from pathlib import Path

    v = Verdict(
        round=2,
        local_rank=0,
        quiet_s=61.4,
        returned=(1, 2),
        where=stacks.TEARDOWN_DEADLOCK,
        stacks_path=Path("/x"),
        done=True,
    )
    line = v.describe(rank=4, first_rank=4)
    assert line.startswith("worker rank 4 is stuck in torch's gloo teardown deadlock")
    assert "61s without CPU, I/O or a step, after ranks 5, 6 returned" in line
