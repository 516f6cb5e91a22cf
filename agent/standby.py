"""A node made ready before it is needed: `python -m rove.agent.standby`.

A pool agent (`rove agent --pool`) keeps one standby process while it is idle. The
standby does, before any job wants it, what a new `rove run` spends its first
seconds on: it imports the launcher (torch among it) and starts the *full* warm
server (torch, DDP's `torch._dynamo`, the checkpoint API: `rove.agent.forkservers`),
then waits. When a scaler assigns the agent a node, the agent hands the standby the
node's `rove run` arguments on its standard input, one JSON line (`Assignment`),
and the standby becomes that node
(`rove.control.scaler.standby`): it moves to the workload's folder, takes the
node's memory limit (its cgroup, or `RLIMIT_AS` on itself and on its warm server),
writes to the node's log and runs `rove run` with those arguments in this process.
Its first round forks from a server that imported everything, so a replacement node
trains about as soon as it joins (`benchmarks/relaunch.py`).

Standard input closed without an assignment (the agent stopped): the standby leaves.
"""

from __future__ import annotations

import os
import resource
import select
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec

from rove.control.scaler.standby import READY_ENV, Assignment, decode


def become(a: Assignment, warm_server: int | None) -> None:
    """This process (and its warm server, `warm_server`) take the node's place, its
    limits and its log."""
    if a.cwd:
        os.chdir(a.cwd)
    if a.cgroup is not None:
        procs = Path(a.cgroup) / "cgroup.procs"
        for pid in (os.getpid(), warm_server):
            if pid is not None:
                procs.write_text(str(pid))
    elif a.memory:
        limit = (a.memory, a.memory)
        resource.setrlimit(resource.RLIMIT_AS, limit)
        if warm_server is not None:
            resource.prlimit(warm_server, resource.RLIMIT_AS, limit)
    if a.log is not None:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        fd = os.open(a.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _assignment(ready: Callable[[], bool], ready_file: str) -> bytes:
    """The line on standard input (b"" at its end); once `ready()`, `ready_file` is
    created meanwhile (the pool agent tells scalers it has a warm node to offer)."""
    said = not ready_file
    while not said:
        waiting, _, _ = select.select([sys.stdin.buffer], [], [], 0.05)
        if waiting:
            break
        if ready():
            Path(ready_file).touch()
            said = True
    return sys.stdin.buffer.readline()


def main() -> int:
    # What `rove run` imports, and the server its rounds fork from, before any job.
    from rove.agent import forkservers, launcher

    forkservers.start()  # no quick server here: the full one, at once
    print(
        f"rove standby {os.getpid()}: waiting for a node (its warm server imports)",
        file=sys.stderr,
        flush=True,
    )
    line = _assignment(forkservers.serving_ready, os.environ.pop(READY_ENV, ""))
    if not line.strip():
        forkservers.stop()
        return 0  # the pool agent stopped before it needed us
    try:
        a = decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        forkservers.stop()
        print(f"rove standby: a bad assignment ({exc}): {line[:200]!r}", file=sys.stderr)
        return 2
    served = forkservers.serving()
    become(a, served[1] if served else None)
    launcher.leave(launcher.main(list(a.argv)))


if __name__ == "__main__":
    sys.exit(main())
