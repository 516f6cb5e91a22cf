"""How a warm server (`rove.agent.forkservers`) is started afresh: multiprocessing's
forkserver spawned with what rove gives it (its variables, its main module's marker,
hangups ignored, a temporary folder named for this process). Standard library only:
`rove run` imports it first thing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from multiprocessing import process, spawn, util

from rove.control.process import tempdirs

#: How a server learns which main module it stands for (`rove.agent.warm_ready`).
MAIN_NAME_ENV = "ROVE_WARM_MAIN_NAME"
MAIN_PATH_ENV = "ROVE_WARM_MAIN_PATH"
#: The longest path of an AF_UNIX socket (Linux: 108 bytes with its terminating NUL).
_UNIX_PATH_MAX = 108


@contextlib.contextmanager
def deaf_to_hangups() -> Iterator[None]:
    """Processes started inside inherit SIGHUP and SIGQUIT ignored. A warm server and
    multiprocessing's resource tracker share `rove run`'s process group: a terminal that
    closes (SIGHUP to the whole group) or a Ctrl-\\ must reach the launcher alone,
    which stops the job cleanly and passes the signal on to the workers (the server died
    of it, and its workers with it; the tracker's relaunch printed tracebacks). They
    ignore SIGINT already. A worker forked from the server starts with the defaults
    (`warm._launcher_dispositions`). For the few milliseconds of a start, this process
    ignores them too; off the main thread (where no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGHUP, signal.SIGQUIT)}
    try:
        for sig in before:
            signal.signal(sig, signal.SIG_IGN)
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def own_mp_tempdir() -> None:
    """multiprocessing's temporary folder (where the servers' sockets are made) named for
    this process, as rove's own are (`rove.control.process.tempdirs`): multiprocessing's
    `pymp-*` is removed at a normal exit only, so every `rove run` killed with SIGKILL
    left one. Removed at a normal exit as multiprocessing's is. (Where that name makes
    a socket's path too long for AF_UNIX, a long TMPDIR, multiprocessing's own stays.)"""
    config = process.current_process()._config  # type: ignore[attr-defined]
    if config.get("tempdir") is None:
        path = str(tempdirs.make("rove-mp"))
        if len(path) + len("/listener-12345678") >= _UNIX_PATH_MAX:
            shutil.rmtree(path, ignore_errors=True)
            return
        util.Finalize(None, shutil.rmtree, args=(path, True), exitpriority=-100)
        config["tempdir"] = path


def main_marker() -> dict[str, str]:
    """How a child of a forkserver would find this process's main module (as
    multiprocessing computes it), for the server to stand for it."""
    data = spawn.get_preparation_data("rove-warm")
    if "init_main_from_name" in data:
        return {MAIN_NAME_ENV: str(data["init_main_from_name"])}
    if "init_main_from_path" in data:
        return {MAIN_PATH_ENV: str(data["init_main_from_path"])}
    return {}


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """`values` in this process's environment while a server is spawned (it inherits
    them; `rove.agent.warm_ready` takes them out of the server's own)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
