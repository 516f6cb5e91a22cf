"""Imported last by a warm server (`rove.agent.forkservers`), after everything it
preloads; anywhere else it does nothing.

1. The server's `__main__` is made to stand for the launcher's main module, so that a
   worker forked from it does not run that module again (multiprocessing runs a
   parent's main module in each child it cannot match with its own `__main__`; for the
   `rove` command that is 0.5 s of imports per worker, at every restart). The worker
   then runs its script as `__main__` (`rove.agent.script`).
2. The server says it is ready, in the file its agent named.

The variables that carry both are taken out of the server's environment, so no worker
inherits them.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_main = sys.modules["__main__"]
_name = os.environ.pop("ROVE_WARM_MAIN_NAME", None)
_path = os.environ.pop("ROVE_WARM_MAIN_PATH", None)
if _name:
    _main.__spec__ = importlib.machinery.ModuleSpec(_name, None)
if _path:
    _main.__file__ = _path
_ready = os.environ.pop("ROVE_WARM_READY_FILE", None)
if _ready:
    with open(_ready, "w"):
        pass
