"""Imported last by a warm server (`rove.agent.forkservers`), after everything it
preloads; anywhere else it does nothing.

1. A server started in the background (the full one) imports its modules here, in a
   thread at a low priority (`ROVE_WARM_NICE`: nice values are per thread on Linux),
   while its main thread, which forks the workers later, keeps its own. A module that
   cannot be imported is said on stderr and skipped, as multiprocessing skips it. A
   server that learns (`ROVE_WARM_LEARNED_FILE`) then imports what the workers
   imported, with care (`rove.agent.imports.take`); where it refuses a module it says
   which and why in the file beside, and never says it is ready.
2. The server's `__main__` is made to stand for the launcher's main module, so that a
   worker forked from it does not run that module again (multiprocessing runs a
   parent's main module in each child it cannot match with its own `__main__`; for the
   `rove` command that is 0.5 s of imports per worker, at every restart). The worker
   then runs its script as `__main__` (`rove.agent.script`).
3. The server says it is ready, in the file its agent named, with the names of the
   modules it imported (what a worker forked from it finds imported).
4. The server, once it ends (its agent gone), exits at once: its workers die with it.

The variables that carry all this are taken out of the server's environment, so no
worker inherits them.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.machinery
import json
import os
import sys
import threading
from pathlib import Path

from rove.control.errors import plain


def _import_in_background(
    names: list[str], nice: int, importer_file: str | None, learned_file: str | None
) -> bool:
    """Import `names` at `nice`: in a thread of that nice, in a session of this server's
    own whose scheduling group has that nice meanwhile (where the kernel groups tasks by
    session, "autogroup", a thread's nice only counts within its session). The thread's
    id goes to `importer_file`, for the agent to raise its priority in place where it may
    (`rove.agent.forkservers.escalate`). Then what `learned_file` names, with care: False
    when a module of it was refused (said in the file beside it)."""
    safe = [True]

    def run() -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        if importer_file:
            try:
                told = Path(importer_file)
                writing = told.with_suffix(".tmp")
                writing.write_text(str(tid))
                writing.replace(told)
            except OSError:
                pass  # then the agent replaces this server if it must, as it can anyway
        for name in names:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - said, and skipped as multiprocessing does
                print(
                    f"rove: the warm server could not import {name}: {plain(exc)}", file=sys.stderr
                )
        if learned_file:
            safe[0] = _learn(Path(learned_file))

    try:
        os.setsid()
    except OSError:
        pass  # a session leader already
    _autogroup(nice)
    worker = threading.Thread(target=run, name="warm-imports")
    worker.start()
    worker.join()
    _autogroup(0)  # (back to where its workers start: each makes a session of its own)
    return safe[0]


def _learn(told: Path) -> bool:
    """Import what the workers imported (`rove.agent.imports`); False where a module was
    refused, said in the file `refused` beside `told`."""
    from rove.agent import imports

    try:
        lesson = json.loads(told.read_text())
        names = [n for n in lesson["modules"] if isinstance(n, str) and imports.valid(n)]
        keys = [k for k in lesson["worker_keys"] if isinstance(k, str)]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        taken = imports.Taken(0, 0, "", f"its list could not be read: {plain(exc)}")
    else:
        taken = imports.take(names, keys)
    if taken.culprit is None:
        return True
    _write(told.with_name("refused"), {"culprit": taken.culprit, "why": taken.why})
    return False


def _write(path: Path, data: object) -> None:
    """`data` as JSON in `path`, whole (the agent reads it as soon as it is there)."""
    writing = path.with_name(path.name + ".tmp")
    writing.write_text(json.dumps(data))
    writing.replace(path)


def _autogroup(nice: int) -> None:
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroups here: the thread's own nice is what counts


def _exit_at_once_in(server: int) -> None:
    """The server ends (multiprocessing ends it when its agent's pipe closes: the agent
    is gone) at once, not after tearing down torch and the rest: its workers die with
    it, and until then they trained on unsupervised (0.5-1.2 s measured). Its workers
    inherit the handler and skip it: they end as an interpreter ends."""

    def exit_now() -> None:
        if os.getpid() != server:
            return
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    atexit.register(exit_now)


def serve(
    imports: list[str], nice: int, importer: str | None, learned: str | None, ready: str | None
) -> None:
    """Import `imports` (in the background at `nice`, then `learned` with care), then
    say this server is ready in `ready` with the modules it imported (not where a
    module was refused). What a fresh server reads from its environment below; a server
    forked from another is given it (`rove.agent.server_fork`)."""
    safe = True
    if imports:
        safe = _import_in_background([n for n in imports if n], nice, importer, learned)
    if ready:
        _exit_at_once_in(os.getpid())
        if safe:
            try:
                _write(Path(ready), {"modules": list(sys.modules)})
            except OSError as exc:
                if not Path(ready).parent.is_dir():
                    # its agent is gone, its folder with it (a job shorter than this
                    # server's imports): nobody waits for it. (It printed a traceback
                    # on the console of a job that had ended.)
                    os._exit(0)
                print(
                    f"rove: the warm server could not say it is ready: {plain(exc)}",
                    file=sys.stderr,
                )


#: The server's own import path, as its interpreter made it (a server forked from this
#: one takes it back: multiprocessing gave the fork its agent's).
SYS_PATH = list(sys.path)
_imports = os.environ.pop("ROVE_WARM_IMPORTS", None)
_nice = os.environ.pop("ROVE_WARM_NICE", "0")
_importer = os.environ.pop("ROVE_WARM_IMPORTER_FILE", None)
_learned = os.environ.pop("ROVE_WARM_LEARNED_FILE", None)
_main = sys.modules["__main__"]
_name = os.environ.pop("ROVE_WARM_MAIN_NAME", None)
_path = os.environ.pop("ROVE_WARM_MAIN_PATH", None)
if _name:
    _main.__spec__ = importlib.machinery.ModuleSpec(_name, None)
if _path:
    _main.__file__ = _path
serve(
    (_imports or "").split(","),
    int(_nice),
    _importer,
    _learned,
    os.environ.pop("ROVE_WARM_READY_FILE", None),
)
