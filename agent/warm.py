"""Warm start (`rove run --warm-start`): workers forked from a process that imported torch.

A restarted worker used to pay for a fresh interpreter and `import torch`
(about 1.4 s of a 2.5 s restart on a 2-core machine) before it could rejoin.
With warm start, every round's workers are forked from a multiprocessing
*forkserver* that imported torch once (`rove.agent.forkservers`: a quick one that
`rove run` starts before anything else, then a full one for restarts), as torch's
`start_processes` forks a function entrypoint (`rove.agent.procs`, or torch's own
with torch's logs), so log redirection, tee and the `@record` error file behave as
they do for torchrun's function entrypoints.

In the forked worker, `run_script` does what `python -u SCRIPT ARGS` (or
`python -u -m MODULE ARGS`) would: `sys.argv`, `sys.path[0]`, unbuffered
output, `__name__ == "__main__"`, a session of its own, and the ending of an
interpreter (threads joined, atexit handlers run: `rove.agent.script`). What
differs from a fresh interpreter: modules imported by the server are already
imported (with the environment `rove run` had when it started), and OpenMP reads
`OMP_NUM_THREADS` only once, so the worker applies it with
`torch.set_num_threads`.

Workers die with their agent: a server exits when the agent does (its
alive-pipe closes), and each worker asks the kernel for SIGKILL when its server
dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Sequence

from rove.agent import echo, forkservers, imports, script, server_fork
from rove.agent.self_process import die_with_parent
from rove.control.errors import RoveError, plain
from rove.control.process import aio

#: The warm server's pid, as every worker forked from it inherits it: this module is
#: imported by the server itself before it forks (it is in every server's preload). (If
#: the server could not preload it, a worker imports it itself and this is its own pid.)
SERVER_PID = os.getpid()


def start(extra: Sequence[str] = ()) -> None:
    """The agent starts: make sure a server will be there to fork from (it imports in
    the background); `extra`: `--preload` modules. Idempotent."""
    forkservers.start(extra)


def stop() -> None:
    """Kill the warm servers now, if this process started any (a second signal: there
    is nothing left to fork; they would end by themselves once this process exits)."""
    forkservers.stop()


async def ready(interrupted: asyncio.Event) -> bool:
    """Before a round forks its workers: the full server serves from now on if it is
    ready (`rove.agent.forkservers.promote`). Wait for the serving server's imports
    (seconds on a busy machine; forking waits for them too) in a thread of its own, so
    the event loop goes on (heartbeats) and a signal is not kept waiting, nor is the
    process's exit (the thread is a daemon). False when `interrupted` was set first."""
    forkservers.promote()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def finish(failed: BaseException | None) -> None:
        if done.done():
            return  # (cancelled: a signal came first)
        if failed is None:
            done.set_result(None)
        else:
            done.set_exception(failed)

    def wait() -> None:
        failed = None
        try:
            wait_ready()
        except (EOFError, OSError) as exc:  # the server ended: stopped as we leave, or died
            failed = exc  # (a thread's exception would be printed as a traceback)
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
            loop.call_soon_threadsafe(finish, failed)

    threading.Thread(target=wait, name="warm-ready", daemon=True).start()
    try:
        await aio.unless(interrupted, done)
    except aio.Stopped:
        return False
    except (EOFError, OSError) as exc:
        if interrupted.is_set():
            return False
        raise RoveError(
            f"the warm server ended before it had imported what it preloads "
            f"({plain(exc)}); run with --no-warm-start if it happens again"
        ) from exc
    return not interrupted.is_set()


def wait_ready() -> None:
    """Block until the warm server has imported what it preloads: fork one process
    from it that does nothing. (Forking workers blocks until then too; an agent calls
    this in a thread first, so its heartbeats go on while torch is being imported.)"""
    process = multiprocessing.get_context("forkserver").Process(target=_nothing)
    process.start()
    process.join()


def _nothing() -> None:
    pass


def entry_args(cmd_args: list[str]) -> tuple[str, ...]:
    """`run_script`'s arguments for the interpreter arguments `-u [-m] TARGET ARGS...`."""
    args = list(cmd_args)
    while args and args[0] == "-u":
        args.pop(0)
    if args and args[0] == "-m":
        return ("module", *args[1:])
    return ("script", *args)


def run_script(kind: str, target: str, *argv: str) -> None:
    """Run the training script or module in this (forked) process as `__main__`."""
    die_with_parent()  # the server's death; it dies with the agent
    server_fork.let_the_server_go()  # (the server outlives no agent through its workers)
    echo.redirect_to_pipes()  # before anything is printed (rove.agent.echo)
    # A session of its own, as torchrun's workers have: a terminal's Ctrl-C reaches the
    # launcher alone, which forwards it (workers shared the launcher's group before).
    os.setsid()
    _launcher_dispositions()
    if os.getpid() != SERVER_PID and os.getppid() != SERVER_PID:
        # The server (so the agent) died between the fork and the line above: the signal
        # was armed too late and would never come. An orphan must not train on.
        os._exit(1)
    # Forked from a forkserver, this process inherited "forkserver" as its start
    # method; a fresh interpreter has the platform's default (what DataLoader
    # workers and the script's own processes expect).
    multiprocessing.set_start_method(None, force=True)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=True)
    _fresh_randomness()
    # what the script imports beyond the server's modules, for the next server to import
    watch = imports.watch(frozenset(sys.modules), target if kind == "script" else None)
    try:
        script.run(kind, target, argv)
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise
        # a return: torch's `@record` takes sys.exit(0) for one, but not sys.exit(),
        # whose worker then exited without a value and its round never ended
    except Exception as exc:
        # on the worker's stderr, as a fresh interpreter prints it (torch's own report of
        # it, in the agent, is left out: the agent says what failed, diagnosed)
        script.print_uncaught(exc)
        raise
    finally:
        if watch is not None:
            watch.settle()  # (a script that ended before its imports settled)


def _launcher_dispositions() -> None:
    """The signal dispositions of a worker its launcher started fresh: the launcher
    handles SIGINT, SIGTERM, SIGHUP and SIGQUIT (torch's does), so an exec'd worker
    starts with their defaults (Python's KeyboardInterrupt for SIGINT) even where the
    launcher inherited them ignored (`nohup`, a shell script's background job). A fork
    inherits the server's, which the launcher's were before it handled any. Other
    inherited dispositions (an ignored SIGUSR1) pass on, as they do through exec."""
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh_randomness() -> None:
    """Draw new seeds, as a fresh interpreter does: a fork inherits the server's random
    state, so every worker (and every restart) would share torch's and numpy's draws
    (Python's `random` is reseeded at fork by CPython itself)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
