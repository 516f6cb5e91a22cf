"""`rove.control.process.stalls`: a daemon's event loop held for seconds is said, with
where; a process that only got no CPU is not blamed on its code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rove.control.process.stalls import Frame, Said, not_running, thread_state, where
from tests.support import patience

IDLE = [Frame("selectors", "/usr/lib/python3.11/selectors.py", 468, "select")]
IN_TORCH = [
    Frame("torch", "/venv/site-packages/torch/__init__.py", 2080, "<module>"),
    Frame("importlib._bootstrap", "<frozen importlib._bootstrap>", 241, "_call_with_frames"),
    Frame("rove.checkpoint.shm", "/src/checkpoint/shm.py", 133, "ensure"),
    Frame("rove.checkpoint.engine", "/src/checkpoint/engine.py", 96, "_open_slot"),
]


def test_where_names_the_innermost_frame_and_what_of_roves_called_it() -> None:
    assert where(IN_TORCH) == (
        "<module> (torch/__init__.py:2080), called from rove.checkpoint.shm.ensure (line 133)"
    )
    assert where(IN_TORCH[2:]) == "ensure (checkpoint/shm.py:133)"
    assert where(None).startswith("a place not seen")


def test_a_loop_in_its_selector_or_not_scheduled_with_little_cpu_was_not_running() -> None:
    assert not_running(IDLE, "S", cpu_s=2.0, held_s=3.0)  # waiting for I/O: not held
    assert not_running(None, "", cpu_s=0.05, held_s=3.0)  # unseen, no CPU: paused
    assert not_running(IN_TORCH, "R", cpu_s=0.05, held_s=3.0)  # runnable, got no CPU
    assert not not_running(IN_TORCH, "R", cpu_s=2.5, held_s=3.0)  # computing: held
    assert not not_running(IN_TORCH, "S", cpu_s=0.0, held_s=3.0)  # blocked in a call: held
    assert not not_running(None, "", cpu_s=2.9, held_s=3.0)  # held the GIL throughout


def test_one_place_is_said_at_most_once_a_minute_with_how_often_since() -> None:
    said = Said(repeat_s=60.0)
    assert said.due("a", now=0.0) == 0
    assert said.due("a", now=10.0) is None
    assert said.due("b", now=11.0) == 0  # another place is said at once
    assert said.due("a", now=30.0) is None
    assert said.due("a", now=61.0) == 2


def test_the_state_of_a_thread_of_this_process_is_read_from_the_kernel() -> None:
    import threading

    assert thread_state(threading.get_native_id()) == "R"  # this one runs
    assert thread_state(0) == ""


PROBE = """
import asyncio, os, sys, time
from rove.control.process import aio, logs

logs.configure()

def hold_the_loop(seconds):
    time.sleep(seconds)  # a blocking call on the loop, as a careless import or copy is

async def main():
    await asyncio.sleep(0.5)
    if sys.argv[1] == "hold":
        hold_the_loop(3.0)
    else:
        print("ready", flush=True)
        await asyncio.sleep(float(sys.argv[2]))
    await asyncio.sleep(0.6)  # the loop runs again, and says it

aio.run(main(), watch="the probe")
"""


def _probe(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ROVE_LOG_FORMAT": "console"},
    )


def test_a_loop_held_by_a_call_is_said_with_the_call_and_how_long(tmp_path: Path) -> None:
    proc = _probe(tmp_path, "hold")
    _, err = proc.communicate(timeout=patience(60))
    assert proc.returncode == 0, err
    said = [line for line in err.splitlines() if "was held for" in line]
    assert len(said) == 1, err
    assert "the event loop of the probe was held for" in said[0], said
    assert "in hold_the_loop (" in said[0] and "probe.py" in said[0], said
    assert "called from" not in said[0], said  # (rove's loop runner says nothing of it)
    held = float(said[0].split("held for ")[1].split(" s")[0])
    assert held >= 2.5, said


def test_a_paused_process_is_said_to_have_got_no_cpu_not_to_have_held_its_loop(
    tmp_path: Path,
) -> None:
    proc = _probe(tmp_path, "pause", "6")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(proc.pid, signal.SIGCONT)
    _, err = proc.communicate(timeout=patience(60))
    assert proc.returncode == 0, err
    assert "was held for" not in err, err
    assert "the probe got no CPU for" in err, err
