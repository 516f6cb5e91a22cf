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


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m rove.agent.child CMD [ARGS...]")
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not Linux: the agent still stops its workers on every clean exit
    if os.getppid() != parent:
        sys.exit(1)  # the agent died before the signal was armed
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
