"""Run the user's training script in this worker process as `python -u SCRIPT ARGS`
would, and end the way a fresh interpreter ends.

Warm workers (forked from the warm server), `--run-path` workers and fresh
(`--no-warm-start`) workers all run their script through `run`:

* the script runs as `__main__` (`runpy`), with `sys.argv` as the command gave it;
* every process group it creates is held (`rove.agent.groups`: a torch deadlock at
  teardown is never triggered);
* when it returns (or exits with status 0), the worker records that in its
  progress file (the agent can then tell a rank stuck on its way out, its work
  done, from one at work); returned or raised, it ends as an interpreter does after
  its main module: it waits for the script's non-daemon
  threads, runs its `atexit` handlers, and lets go of what the script left (its
  unclosed files are flushed). What torch would tear down in the interpreter's own
  finalization (gloo's threads) is left to the process's exit.

`exit_status` turns how the script ended into the process's exit status and what a
fresh interpreter prints (a fresh worker then leaves with `os._exit`, skipping the
finalization that can deadlock or abort in torch's destructors).
"""

from __future__ import annotations

import atexit
import builtins
import gc
import importlib.machinery
import importlib.util
import io
import os
import runpy
import signal
import sys
import threading
import traceback
import types
import weakref
import zipfile
from collections.abc import Sequence
from pathlib import Path

from rove.agent import groups, progress
from rove.agent.self_process import title


def unrunnable(path: Path) -> str | None:
    """Why `python PATH` could not run `path`, said after its name (None: it can): a
    script file, a zip file or a folder holding a `__main__.py` are run."""
    if path.is_file():
        return None
    if path.is_dir():
        if (path / "__main__.py").is_file():
            return None
        return "is a folder without a __main__.py: give the script file in it"
    return "not found"


def syntax_error(path: Path) -> str | None:
    """Why a script file this Python would run does not compile, said after its name
    (None: it compiles, or is no source file: a zip, a folder, unreadable bytes, which
    the worker reports). Every worker would fail on it, and each restart again."""
    if not path.is_file() or zipfile.is_zipfile(path):
        return None
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        return (
            f"does not compile: {type(exc).__name__}: {exc.msg} (line {exc.lineno}); "
            "fix it and run again"
        )
    except (ValueError, OSError):
        return None
    return None


def refused(target: str, *, module: bool, no_python: bool) -> str | None:
    """Why `rove run` cannot start `target` (None: it can): a script not found or that
    does not compile, a module whose top-level package is nowhere on the path. The
    source is left to the workers' Python where another one runs them (`PYTHON_EXEC`)."""
    if no_python:
        return None
    if module:
        top = target.split(".", 1)[0]
        if not _findable(top):
            return (
                f"no module {top} to run with -m {target}, here ({Path.cwd()}) or on "
                "the Python path: run from the folder that holds it, or set PYTHONPATH"
            )
        return None
    why = unrunnable(Path(target))
    if not why and not os.environ.get("PYTHON_EXEC"):
        why = syntax_error(Path(target))
    return f"training script {target} {why}" if why else None


def _findable(top: str) -> bool:
    """Whether a worker's `python -m` finds the top-level module `top` (the working
    folder first, as a worker puts it); nothing is imported."""
    sys.path.insert(0, str(Path.cwd()))
    try:
        return bool(top) and importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path.pop(0)


def run(kind: str, target: str, argv: Sequence[str]) -> None:
    """Run `target` (a script path, or a module name when `kind` is "module") as
    `__main__` with `argv`; raises what the script raised, after the ending."""
    groups.hold()
    title(
        " ".join([sys.executable, *(["-u", "-m"] if kind == "module" else ["-u"]), target, *argv])
    )
    sys.argv = [target, *argv]
    main: types.ModuleType | None = None
    succeeded = False
    try:
        if kind == "module":
            sys.path.insert(0, str(Path.cwd()))
            _find_module(target)
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(target).resolve().parent))
            if Path(target).is_file():
                main = types.ModuleType("__main__")
                _run_file(main, target)
            else:  # a folder or a zip file with a __main__.py
                runpy.run_path(target, run_name="__main__")
        succeeded = True
    except SystemExit as exc:
        succeeded = exc.code in (None, 0)
        raise
    except BaseException as exc:
        _record_now(exc)
        raise
    finally:
        if succeeded:
            progress.script_returned()
        end(main)
        if succeeded:
            progress.script_ended()


def _find_module(name: str) -> None:
    """Exit as `python -m NAME` exits when there is no module NAME: one line and status
    1, not a traceback through runpy that ends "at <frozen runpy>:142"."""
    try:
        found = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError as exc:  # a package on its way is missing
        if not (exc.name and (name + ".").startswith(exc.name + ".")):
            raise
        found = False
    if not found:
        print(f"{sys.executable}: No module named {name}", file=sys.stderr, flush=True)
        raise SystemExit(1)


def _run_file(main: types.ModuleType, path: str) -> None:
    """Execute the script file at `path` in `main`, made `sys.modules["__main__"]` as
    `python PATH` makes it (and left there, as in an interpreter)."""
    absolute = str(Path(path).absolute())
    main.__file__ = absolute
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", absolute)
    sys.modules["__main__"] = main
    with io.open_code(absolute) as f:
        code = compile(f.read(), absolute, "exec", dont_inherit=True)
    exec(code, main.__dict__)


def _record_now(exc: BaseException) -> None:
    """Write torch's error file (`TORCHELASTIC_ERROR_FILE`, what `@record` writes) for
    the exception the script raised before the ending runs: a peer's failure may get this
    worker torn down during its ending, and the exception is what happened to it. (torch
    writes it again as the exception reaches its own `record`.)"""
    if not isinstance(exc, Exception) or "torch" not in sys.modules:
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
    except Exception:  # noqa: BLE001 - the error file is a help; the exception still propagates
        pass


def end(main: types.ModuleType | None = None) -> None:
    """What an interpreter does once its main module is done, short of tearing torch
    down: wait for non-daemon threads, run the atexit handlers, let go of the script's
    module (`main`, when the runner made it) and collect what it held (its unclosed
    files are flushed), flush the standard streams."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    if main is not None:
        if sys.modules.get("__main__") is main:
            del sys.modules["__main__"]
        held = weakref.ref(main)
        del main
        gc.collect()
        left = held()
        if left is not None:  # still referenced (a library kept `__main__`): as finalization does
            left.__dict__.clear()
            del left
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_status(exc: BaseException | None) -> int:
    """The exit status a fresh interpreter would end with after its main module ended
    with `exc` (None: returned), printing what it would print. A KeyboardInterrupt
    ends the process by SIGINT itself, as CPython does."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        print(code, file=sys.stderr, flush=True)
        return 1
    if isinstance(exc, KeyboardInterrupt):
        print_uncaught(exc)
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    print_uncaught(exc)
    return 1


def print_uncaught(exc: BaseException) -> None:
    """The traceback as the interpreter prints it, without rove's own frames."""
    tb = exc.__traceback__
    while tb is not None and _is_ours(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    whole = exc.__traceback__
    exc.__traceback__ = tb  # (CPython's hook prints the exception's own traceback)
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # noqa: BLE001 - a broken excepthook: print it plainly, as CPython does
        traceback.print_exception(type(exc), exc, tb)
    finally:
        exc.__traceback__ = whole
    sys.stderr.flush()


#: Files whose frames a script's traceback never shows: rove's runners and runpy.
_OURS = frozenset(
    {__file__, runpy.__file__, *(str(Path(__file__).with_name(n)) for n in ("child.py", "warm.py"))}
)


def _is_ours(filename: str) -> bool:
    return filename in _OURS
