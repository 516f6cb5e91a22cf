"""Learned imports: what a warm worker imported beyond its server's modules, imported
by the next warm server, so that a restarted worker finds it imported.

The warm servers (`rove.agent.forkservers`) import torch and rove's modules, and what
`--preload` names. A real script imports much more before its first step (an HF
`Trainer` script: `transformers`, `accelerate`, `safetensors` and their dependencies,
about 550 modules and 2.4 s here), and every restarted worker paid for it again. So:

1. *In each warm worker* (`watch`, started by `rove.agent.warm.run_script`): as its
   first process group is made, and once its imports have settled (its
   `FINAL_AFTER_STEPS`-th step reported, or its script's end), it writes the modules it
   imported that its server had not (`learnable`:
   installed packages, and modules from outside the script's folder and the working
   directory, so the user's own code is always imported afresh) beside its progress
   file, in its own thread (a script sees no thread it would not have under torchrun).
2. *The agent* (`read`, `union`) hands the lists of its workers to
   `rove.agent.forkservers.learn`, which starts a warm server that imports them too (in
   the background, at the lowest priority) and makes it the one restarts fork from.
3. *That server* imports them carefully (`take`): one by one, each failure skipped, the
   output and warnings of the imports kept off the console, and a module that does at
   import what a server must not do is refused by name: one that starts a thread or a
   process (a fork takes neither along), initialises CUDA (a forked child cannot use
   it), or reads an environment variable whose value each worker has its own of
   (`RANK`, `LOCAL_RANK`, `MASTER_PORT`, ...: the server would keep the agent's). A
   server that refused a module never serves; the agent says which module and why,
   and learns again without that module's package.

This module is stdlib-only: the warm servers and the workers import it before torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import json
import os
import site
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

#: A worker's imports have settled once it reported this many steps (a training loop's
#: lazy imports come with its first forward, backward and optimizer step).
FINAL_AFTER_STEPS = 5
#: How long the agent waits for every worker's final list before it learns from the
#: lists written as their process groups were made (a script that reports no steps).
FINAL_WITHIN_S = 30.0
#: The most modules one worker's list names (an HF script: about 550).
MAX_MODULES = 20_000
#: The workers are told to watch their imports (the agent learns: `--learn-imports`).
ENV = "ROVE_LEARN_IMPORTS"
SUFFIX = ".imports"


def path_for(progress_file: str | os.PathLike[str]) -> Path:
    """Where the worker of `progress_file` writes what it imported."""
    return Path(os.fspath(progress_file) + SUFFIX)


def top(name: str) -> str:
    """The package a module belongs to: `transformers` of `transformers.trainer`."""
    return name.partition(".")[0]


def _origin(module: object) -> str | None:
    file = getattr(module, "__file__", None)
    return file if isinstance(file, str) and Path(file).is_absolute() else None


def _under(path: str, folder: str) -> bool:
    folder = folder.rstrip(os.sep)
    return bool(folder) and (path == folder or path.startswith(folder + os.sep))


def valid(name: str) -> bool:
    """A dotted module name (what `importlib.import_module` is given, from a file)."""
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def learnable(
    modules: Mapping[str, object],
    had: Iterable[str],
    own_dirs: Sequence[str],
    installed_dirs: Sequence[str] = (),
) -> list[str]:
    """The modules of `modules` (a copy of `sys.modules`) a server should import: not in
    `had` (the server's), under their own name (`os.path` is `posixpath`: skipped, the
    real name comes too), loaded from a file, and installed (under `installed_dirs`:
    site-packages, the standard library; a virtual environment in the project's folder
    too) or at least outside `own_dirs` (the script's folder, the working directory:
    the user's own code, imported afresh by every worker). Built-in modules and
    namespace packages cost nothing to import: left out."""
    had = set(had)
    own = [os.path.realpath(d) for d in own_dirs if d]
    installed = [os.path.realpath(d) for d in installed_dirs if d]
    out: list[str] = []
    for name, module in modules.items():
        if name in had or name.startswith("__") or not valid(name):
            continue
        try:  # (a lazy module's attributes may import, or raise anything)
            own_name, origin = getattr(module, "__name__", None), _origin(module)
        except Exception:  # noqa: BLE001 - not learned
            continue
        if own_name != name:
            continue
        if origin is None:
            continue
        file = Path(origin)
        real = str(Path(_real(str(file.parent))) / file.name)
        mine = any(_under(real, d) or _under(origin, d) for d in own)
        if mine and not any(_under(real, d) for d in installed):
            continue
        out.append(name)
        if len(out) >= MAX_MODULES:
            break
    return out


@functools.lru_cache(maxsize=4096)
def _real(folder: str) -> str:
    return os.path.realpath(folder)


def installed_dirs() -> list[str]:
    """Where this interpreter's installed modules are: its standard library and its
    site-packages (a virtual environment's too), wherever they lie."""
    paths = sysconfig.get_paths()
    found = [paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    with contextlib.suppress(AttributeError):  # (a virtualenv's old `site` lacks them)
        found += site.getsitepackages()
        found.append(site.getusersitepackages())
    found += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return list(dict.fromkeys(found))


def union(lists: Iterable[Sequence[str]]) -> tuple[str, ...]:
    """Every name of `lists`, once, in the order first seen."""
    return tuple(dict.fromkeys(name for names in lists for name in names))


# ------------------------------------------------------------------ the worker


class Watch:
    """A warm worker's watch of its imports, without a thread of its own (a script sees
    no thread it would not have under torchrun): its list is written in the script's
    own thread as its first process group is made (most imports are done by then),
    again, final, as it reports its FINAL_AFTER_STEPS-th step (`rove.agent.progress`),
    and as its script ends, if not final yet."""

    def __init__(self, had: frozenset[str], own: list[str], progress_file: str) -> None:
        self.had = had
        self.own = own
        self.path = path_for(progress_file)
        self.steps = 0
        self.final = False

    def start(self) -> Watch:
        from rove.agent import groups, progress  # (stdlib-only too)

        progress.on_step = self.stepped
        groups.on_group = self.grouped
        return self

    def stepped(self) -> None:
        """A step was reported."""
        self.steps += 1
        if self.steps >= FINAL_AFTER_STEPS:
            self.settle()

    def grouped(self) -> None:
        """A process group was made."""
        from rove.agent import groups

        groups.on_group = None
        self.write(final=False)

    def settle(self) -> None:
        """Write the final list now, unless it was written."""
        from rove.agent import groups, progress

        progress.on_step = groups.on_group = None
        self.write(final=True)

    def write(self, final: bool) -> None:
        """Write the list as it is now (never raises: it runs inside the user's script)."""
        if self.final:
            return
        self.final = final
        try:
            names = learnable(sys.modules.copy(), self.had, self.own, installed_dirs())
            write(self.path, names, final=final)
        except OSError:
            pass  # (the round is over, its folder gone: moot)
        except Exception as exc:  # noqa: BLE001 - a restart imports afresh; the script goes on
            from rove.control.errors import plain

            print(f"rove: could not list this worker's imports: {plain(exc)}", file=sys.stderr)


def watch(had: frozenset[str], script: str | None) -> Watch | None:
    """In a warm worker, before its script runs: watch what it imports beyond `had`
    (None when the agent does not learn)."""
    progress_file = os.environ.get("ROVE_PROGRESS_FILE")
    if os.environ.get(ENV) != "1" or not progress_file:
        return None
    own = [str(Path.cwd())]
    if script:
        own.append(str(Path(script).absolute().parent))
    return Watch(had, own, progress_file).start()


class Listed(NamedTuple):
    """What a worker wrote: the modules, and whether its imports had settled."""

    modules: tuple[str, ...]
    final: bool


def write(path: Path, names: Sequence[str], *, final: bool = True) -> None:
    """Write `names` to `path` whole (a reader never sees half of it)."""
    writing = path.with_name(path.name + ".tmp")
    writing.write_text(json.dumps({"modules": list(names), "final": final}))
    writing.replace(path)


def read(path: Path) -> Listed | None:
    """What a worker wrote to `path`; None until it wrote it. A file that is not such a
    list (written by something else) reads as a final empty list: nothing to learn."""
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        data = json.loads(text)
        names, final = data["modules"], data.get("final", True)
    except (ValueError, TypeError, KeyError, AttributeError):
        return Listed((), True)
    if not isinstance(names, list):
        return Listed((), True)
    modules = tuple(n for n in names[:MAX_MODULES] if isinstance(n, str) and valid(n))
    return Listed(modules, final is not False)


# ------------------------------------------------------------------ the server


@dataclass(frozen=True)
class Taken:
    """What a server made of a learned list."""

    imported: int
    failed: int
    #: the package refused, and why (None: every module it imported is safe to fork with)
    culprit: str | None = None
    why: str = ""


def take(names: Sequence[str], worker_keys: Iterable[str]) -> Taken:
    """Import `names` in this (server) process, one by one, and stop at the first that
    does at import what a process forked for workers must not have done (see the
    module's docstring); `worker_keys`: the environment variables whose value differs
    in the workers. A module that cannot be imported is counted and skipped; what the
    imports print, and their warnings, are kept off the console."""
    keys = frozenset(worker_keys)
    threads, children = _threads(), _children()
    read_keys: list[tuple[str, str | None]] = []
    imported = failed = 0
    environ_class: Any = type(os.environ)
    getitem = environ_class.__getitem__

    def spy(self: Any, key: str) -> Any:
        if key in keys:
            read_keys.append((key, _reader()))
        return getitem(self, key)

    environ_class.__getitem__ = spy
    try:
        with (
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
            warnings.catch_warnings(),
        ):
            warnings.simplefilter("ignore")
            for name in names:
                if name in sys.modules:
                    continue
                try:
                    importlib.import_module(name)
                except (Exception, SystemExit):  # noqa: BLE001 - counted and skipped
                    failed += 1  # (what it did before it failed is judged all the same)
                else:
                    imported += 1
                why = _harm(threads, children, read_keys)
                if why is not None:
                    culprit = read_keys[0][1] if read_keys and read_keys[0][1] else name
                    return Taken(imported, failed, top(culprit), why)
    finally:
        environ_class.__getitem__ = getitem
    return Taken(imported, failed)


#: The modules between a read of the environment and the code that reads it.
_PLUMBING = frozenset({"os", "_collections_abc", "collections.abc"})


def _reader() -> str | None:
    """The module whose code reads the environment (past os's and the ABCs' frames)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in _PLUMBING:
        frame = frame.f_back  # type: ignore[assignment]
    name = frame.f_globals.get("__name__") if frame is not None else None
    return name if isinstance(name, str) and valid(name) else None


def _threads() -> int:
    try:
        return len(list(Path("/proc/self/task").iterdir()))
    except OSError:
        return threading.active_count()


def _children() -> int:
    count = 0
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError):
                count += len((task / "children").read_text().split())
    return count


def _harm(threads: int, children: int, read_keys: list[tuple[str, str | None]]) -> str | None:
    if read_keys:
        return (
            f"reads {read_keys[0][0]} as it is imported (each worker has its own value; the "
            "server would keep the agent's)"
        )
    if _threads() > threads:
        return "starts a thread as it is imported (a forked worker would not have it)"
    if _children() > children:
        return "starts a process as it is imported"
    torch: ModuleType | None = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "initialises CUDA as it is imported (a forked worker could not use it)"
    return None
