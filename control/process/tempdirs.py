"""Temporary folders that outlive a killed process no longer than until the next one.
(Standard library only: the checkpoint package, which imports nothing else of the
control plane, uses it too.)

A rove process removes the temporary folders it makes as it ends (a warm server's, a
TensorFlow node's, a reader's copy of a stored job), but one killed with SIGKILL, or by
a signal it does not handle (a terminal closed under `rove status`), cannot; nor can a
worker killed while it holds a Hugging Face checkpoint written out for its Trainer (in
/dev/shm: memory). `make` names each folder for its process,
`<prefix>-<pid namespace>.<pid>-<random>`, and a process's first `make` in a directory
first sweeps it: a `rove-*` folder named so is removed once its process is gone, if it
belongs to this user and to this PID namespace (a process of another one could have the
same pid). A pid in use again by another process keeps its folder until
that one ends.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

#: `<prefix>-<pid namespace>.<pid>-<mkdtemp's random part>`
_MARK = re.compile(r"-(\d+)\.(\d+)-[a-z0-9_]+$")


#: (pid, root) of the sweeps `make` did: once a process, for each root
_swept: set[tuple[int, str]] = set()


def make(prefix: str, root: Path | None = None) -> Path:
    """A new temporary folder named for this process (see the module), in `root` (the
    temporary directory by default), once the folders there of processes that are gone
    are swept: at this process's first `make` there (`rove run` makes three as it starts,
    and a sweep reads the whole directory)."""
    swept = (os.getpid(), str(root or tempfile.gettempdir()))
    if swept not in _swept:
        sweep(root)
        _swept.add(swept)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-{_namespace()}.{os.getpid()}-", dir=root))


def sweep(root: Path | None = None) -> list[str]:
    """Remove the `rove-*` folders `make` made for processes of this PID namespace and
    this user that are gone; returns their names."""
    namespace, uid = _namespace(), os.getuid()
    removed: list[str] = []
    try:
        entries = list(os.scandir(root or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        mark = _MARK.search(entry.name) if entry.name.startswith("rove-") else None
        if mark is None or int(mark[1]) != namespace:
            continue
        pid = int(mark[2])
        try:
            if (
                pid == os.getpid()
                or _alive(pid)
                or not entry.is_dir(follow_symlinks=False)
                or entry.stat(follow_symlinks=False).st_uid != uid
            ):
                continue
        except OSError:
            continue  # (gone meanwhile: another process swept it)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _namespace() -> int:
    """This process's PID namespace (the inode of /proc/self/ns/pid; 0 where there is
    none to read)."""
    try:
        return Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        return 0
