"""What a process the agent starts does to itself: it dies with its agent, and `ps`
shows the command it stands for (a warm worker, a TensorFlow spare become its task)."""

from __future__ import annotations

import ctypes
import os
import signal

import setproctitle

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the agent still stops its workers on every clean exit


def title(command: str) -> None:
    """`ps` and `pkill -f` see the command a fresh process would have, not the runner's.
    Written over the process's own command line only (`SPT_NOENV`: a longer title is cut,
    never spilled over the environment block, which `/proc/<pid>/environ` shows)."""
    os.environ["SPT_NOENV"] = "1"
    try:
        setproctitle.setproctitle(command)
    finally:
        del os.environ["SPT_NOENV"]
