"""Start a worker command so that it dies with its agent.

`python -m rove.agent.child CMD ARGS...` asks the kernel to SIGKILL it when
its parent (the agent) dies, then execs CMD in place (same pid, same open
files, same environment). Without this, a worker of an agent killed with -9
lives on, still wired into a round that no longer exists.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the agent still stops its workers on every clean exit


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m rove.agent.child CMD [ARGS...]")
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:
        sys.exit(1)  # the agent died before the signal was armed
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
