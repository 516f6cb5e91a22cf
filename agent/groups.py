"""Keep every torch process group a worker creates alive: a workaround for a deadlock
in torch's gloo teardown (torch 2.13; docs/runtime.md, "Why workers hold their process
groups").

The deadlock: a gloo run-loop thread destroys a finished work while holding the
group's work mutex; the work holds Python objects (tensors, and since 2026 the
autograd context torch stashes in its thread-local state during every backward), so
the thread waits for the GIL. Meanwhile the main thread, holding the GIL, drops the
last reference to a process group that `destroy_process_group()` already released
(a DDP `Reducer` freed by the garbage collector, typically as the script ends), so
`~ProcessGroupGloo` runs under the GIL and joins that thread: neither moves again.
A job hangs after its last line of output. py-spy shows the main thread in
`c10d::ProcessGroupGloo::~ProcessGroupGloo` / `std::thread::join`, another in
`gil_scoped_acquire` under `AsyncWork::~AsyncWork`.

`hold()` removes the trigger rather than the odds: every group made by torch's
`distributed_c10d._new_process_group_helper` (the default group and every
`new_group`) is also kept in `HELD`, so no Python decref ever destroys a group and
its threads are never joined under the GIL. A group the script destroys keeps its
threads until the worker exits; the worker never tears them down (it ends with
`os._exit` once its script and atexit handlers are done: `rove.agent.script`).

It wraps a private torch function: where torch has none (a future version), it says
so once and changes nothing. `ROVE_HOLD_PROCESS_GROUPS=0` switches it off (the tests
use it to show the deadlock is still there in torch).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENV = "ROVE_HOLD_PROCESS_GROUPS"
MODULE = "torch.distributed.distributed_c10d"
HELPER = "_new_process_group_helper"

#: Every process group this worker created, kept until it exits.
HELD: list[Any] = []
#: Called after a process group was made (`rove.agent.imports`: most imports are done)
on_group: Callable[[], None] | None = None


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def hold() -> bool:
    """Keep every process group created from now on (idempotent). If torch's c10d is not
    imported yet it is wrapped as it is imported, so a script that never uses torch
    pays nothing. False when switched off."""
    if not enabled():
        return False
    module = sys.modules.get(MODULE)
    if module is not None:
        _wrap(module)
    elif not any(isinstance(f, _WrapOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WrapOnImport())
    return True


def _wrap(module: ModuleType) -> None:
    original = getattr(module, HELPER, None)
    if original is None:
        print(
            f"rove: {MODULE}.{HELPER} is gone in this torch; process groups are not held "
            "(the gloo teardown workaround is off; see docs/runtime.md)",
            file=sys.stderr,
            flush=True,
        )
        return
    if getattr(original, "_rove_holds", False):
        return

    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        made = original(*args, **kwargs)
        HELD.append(made[0] if isinstance(made, tuple) else made)
        if on_group is not None:
            on_group()
        return made

    helper._rove_holds = True  # type: ignore[attr-defined]
    setattr(module, HELPER, helper)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    """Wraps torch's c10d module right after it is executed, the first time it is
    imported (then steps out of the import system)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        sys.meta_path.remove(self)
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None:
            return None
        loader = spec.loader
        exec_module: Callable[[ModuleType], None] | None = getattr(loader, "exec_module", None)
        if loader is None or exec_module is None:
            return spec

        def exec_and_wrap(module: ModuleType) -> None:
            exec_module(module)
            _wrap(module)

        setattr(loader, "exec_module", exec_and_wrap)  # noqa: B010 - this loader only
        return spec
