"""Start a worker command so that it dies with its agent.

`python -m rove.agent.child CMD ARGS...` asks the kernel to SIGKILL it when
its parent (the agent) dies, then execs CMD in place (same pid, same open
files, same environment). Without this, a worker of an agent killed with -9
lives on, still wired into a round that no longer exists.

`python -u -m rove.agent.child --run script|module TARGET ARGS...` runs a Python
training script in this very interpreter instead (`rove.agent.script`: as
`python -u TARGET ARGS` would, its process groups held, ending as a fresh
interpreter ends) and leaves with the status that interpreter would have.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from rove.agent.self_process import die_with_parent

#: The first argument that runs a Python script here instead of exec'ing a command.
RUN = "--run"


def kill_trees(pids: list[int]) -> None:
    """SIGKILL these processes and every process below them, now (a second signal)."""
    import psutil

    procs = []
    for pid in pids:
        try:
            top = psutil.Process(pid)
            procs += [top, *top.children(recursive=True)]
        except psutil.Error:
            continue
    for proc in procs:
        try:
            proc.kill()  # psutil checks the pid still names the same process
        except psutil.Error:
            continue


def main() -> None:
    argv = sys.argv[1:]
    if not argv or (argv[0] == RUN and len(argv) < 3):
        sys.exit(
            "usage: python -m rove.agent.child CMD [ARGS...]\n"
            "       python -m rove.agent.child --run script|module TARGET [ARGS...]"
        )
    parent = os.getppid()
    die_with_parent()
    if os.getppid() != parent:
        sys.exit(1)  # the agent died before the signal was armed
    if argv[0] == RUN:
        _run(argv[1], argv[2], argv[3:])
    os.execvp(argv[0], argv)


def _run(kind: str, target: str, argv: list[str]) -> NoReturn:
    from rove.agent import script

    del sys.path[0]  # `-m` put the working directory there; the script's folder goes instead
    caught: BaseException | None = None
    try:
        script.run(kind, target, argv)
    except BaseException as exc:  # noqa: BLE001 - the script's own ending, whatever it was
        caught = exc
    os._exit(script.exit_status(caught))


if __name__ == "__main__":
    main()
