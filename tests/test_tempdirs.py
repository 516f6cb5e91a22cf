"""Temporary folders named for their process (`rove.control.process.tempdirs`): a
killed process's are removed by the next `make`, and nothing else is, with real
processes (one killed with SIGKILL, one alive)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rove.control.process import tempdirs

MAKE = (
    "from rove.control.process import tempdirs; print(tempdirs.make('rove-warm-quick'), flush=True)"
)


def made_by_child(tmp: Path, *, then: str = "") -> tuple[subprocess.Popen[str], Path]:
    """A process that makes its folder in `tmp` (then runs `then`): it and the folder."""
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKE + "\n" + then],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_processs_folder_goes_at_the_next_make_and_a_live_ones_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, its = made_by_child(tmp_path, then="import time; time.sleep(600)")
    (its / "ready").touch()  # (what a warm server leaves in it)
    assert its.is_dir() and its.name.startswith(f"rove-warm-quick-{tempdirs._namespace()}.")
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert its.is_dir(), "a process killed with SIGKILL leaves its folder"
    unmarked = tmp_path / "rove-warm-quick-abc123"  # (made before names carried a pid)
    unmarked.mkdir()
    elsewhere = tmp_path / f"rove-tf-{tempdirs._namespace() + 1}.{killed.pid}-x1y2"
    elsewhere.mkdir()  # another PID namespace's: its pid says nothing here
    alive, theirs = made_by_child(tmp_path, then="import sys; sys.stdin.read()")
    try:
        assert not its.exists(), "the next process's make swept the killed one's folder"
        mine = tempdirs.make("rove-tf")
        assert mine.name.startswith(f"rove-tf-{tempdirs._namespace()}.{os.getpid()}-")
        assert theirs.is_dir(), "a live process's folder stays"
        assert unmarked.is_dir() and elsewhere.is_dir()
        assert tempdirs.sweep() == [], "nothing more to sweep; this process's own stays"
        assert mine.is_dir()
    finally:
        alive.kill()
        alive.wait(30)
    assert tempdirs.sweep() == [theirs.name], "once that process is gone, its folder goes"
