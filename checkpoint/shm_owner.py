"""A run's slot files in shared memory (their names), and those nobody holds any more,
reclaimed.

A run's flash slots outlive an agent killed with SIGKILL, on purpose: an agent of the
same run started again restores from them (a warm restore). But a job named afresh at
each start (`rove run --standalone` names it `<script>-<random>`) never comes back for
them, and they stayed in /dev/shm, twice the state of every rank, until the machine
restarted.

So every agent holding a run's slots holds a shared `flock` on `rove-ckpt-<run>.lock`
beside them (`Holder`) and touches the file while it runs (`Holder.touch`, at most
every `TOUCH_S`). As an agent takes up a run, it reclaims the slots of every other run
whose lock no process holds and that nobody touched for `grace_s()` (`reclaim`):
`ROVE_SHM_GRACE_S`, default 600 s, long enough for a restarted agent of that run to
find its memory, short enough that dead runs do not pile up. Slots of a run that has
no lock file (written by rove before this) are reclaimed once no process maps any
of them (`/proc/*/maps`) and none was created or resized within the grace (written
through a mapping, a file keeps its time: the mapping tells a live one).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import re
import time
from pathlib import Path

from rove.checkpoint import shm
from rove.control.process import logs

log = logs.get("rove.checkpoint")

PREFIX = "rove-ckpt-"
#: Seconds a dead run's slots are kept for an agent of it started again (env
#: ROVE_SHM_GRACE_S).
GRACE_S = 600.0
#: A holder touches its lock file at most this often.
TOUCH_S = 30.0


def grace_s() -> float:
    raw = os.environ.get("ROVE_SHM_GRACE_S", "")
    try:
        value = float(raw) if raw else GRACE_S
    except ValueError:
        value = -1.0
    if value < 0:
        log.warning(
            f"ROVE_SHM_GRACE_S={raw!r} is not a number of seconds (0 or more); "
            f"keeping dead runs' shared memory for {GRACE_S:.0f} s"
        )
        return GRACE_S
    return value


def lock_path(directory: Path, run: str) -> Path:
    return directory / f"{PREFIX}{run}.lock"


def slot_path(directory: Path, run: str, rank: int, slot: int) -> Path:
    """The file of `rank`'s `slot` of `run` (`rove.checkpoint.engine.namespace`)."""
    return directory / f"{PREFIX}{run}-r{rank}-s{slot}"


#: a slot file's name (`slot_path`): its run and its rank
_SLOT = re.compile(rf"{re.escape(PREFIX)}(.+)-r(\d+)-s\d+")


def slot_files(directory: Path, run: str) -> list[tuple[int, Path]]:
    """The slot files of `run` in `directory`, each with its rank."""
    return [
        (int(m[2]), path)
        for path in directory.glob(f"{glob.escape(PREFIX + run)}-r*")
        if (m := _SLOT.fullmatch(path.name)) and m[1] == run
    ]


class Holder:
    """This process holds `run`'s slots in `directory` while it lives: a shared lock on
    the run's lock file (several agents of one run on a machine share it)."""

    def __init__(self, directory: Path, run: str) -> None:
        self.path = lock_path(directory, run)
        self._fd = -1
        self._touched = 0.0
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a reclaim removes the run
            try:
                same = os.fstat(fd).st_ino == self.path.stat().st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the file was reclaimed as it was opened: a new one
        self._fd = fd
        self.touch(force=True)

    def touch(self, *, force: bool = False) -> None:
        """The run is alive: its slots are kept `grace_s()` from now should it die."""
        now = time.monotonic()
        if self._fd >= 0 and (force or now - self._touched >= TOUCH_S):
            os.utime(self._fd)
            self._touched = now

    def release(self, *, remove: bool = False) -> None:
        """Let go (`remove`: the run's slots are freed too, so is its lock file)."""
        if self._fd < 0:
            return
        if remove:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def reclaim(
    directory: Path, grace: float, keep: frozenset[str], now: float | None = None
) -> list[tuple[str, int]]:
    """Remove the slots (and lock files) of the runs in `directory`, other than `keep`,
    whose lock nobody holds and that nobody touched for `grace` seconds: each run, and
    the bytes of its slots."""
    now = time.time() if now is None else now
    gone = []
    for lock in sorted(directory.glob(f"{PREFIX}*.lock")):
        run = lock.name[len(PREFIX) : -len(".lock")]
        try:
            if run in keep or now - lock.stat().st_mtime < grace:
                continue
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # an agent of the run holds it
            freed = _free([path for _, path in slot_files(directory, run)])
            lock.unlink(missing_ok=True)
            gone.append((run, freed))
        finally:
            os.close(fd)
    return gone + _reclaim_unlocked(directory, grace, keep, now)


def _reclaim_unlocked(
    directory: Path, grace: float, keep: frozenset[str], now: float
) -> list[tuple[str, int]]:
    """The runs whose slots have no lock file (rove before the locks): removed when no
    process maps one of their slots and none has a file time within `grace`."""
    runs: dict[str, list[Path]] = {}
    for path in directory.glob(f"{PREFIX}*-r*-s*"):
        m = _SLOT.fullmatch(path.name)
        if m and m[1] not in keep and not lock_path(directory, m[1]).exists():
            runs.setdefault(m[1], []).append(path)
    stale = {}
    for run, paths in runs.items():
        with contextlib.suppress(FileNotFoundError):
            if all(now - p.stat().st_mtime >= grace for p in paths):
                stale[run] = paths
    if not stale:
        return []
    mapped = _mapped({name for paths in stale.values() for name in _names(paths)})
    gone = []
    for run, paths in sorted(stale.items()):
        if mapped & _names(paths):
            continue  # a live process (an agent or a worker of that run) uses it
        gone.append((run, _free(paths)))
    return gone


def _free(paths: list[Path]) -> int:
    """Remove the slot files `paths` (and the files on disk of those that spilled); the
    bytes they held."""
    return sum(shm.remove(path) for path in paths)


def reclaim_spilled(spill: Path, directory: Path, grace: float, now: float | None = None) -> int:
    """Remove the spilled slot files in `spill` that no slot of `directory` links to
    any more and that are older than `grace` (a machine's restart empties its shared
    memory, not its disk); the bytes they held."""
    now = time.time() if now is None else now
    freed = 0
    for path in spill.glob(f"{PREFIX}*-r*-s*"):  # (a reservation a kill cut short too)
        slot = directory / path.name
        if slot.is_symlink() and os.path.realpath(slot) == os.path.realpath(path):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            if now - st.st_mtime >= grace:
                path.unlink()
                freed += st.st_size
    return freed


def _names(paths: list[Path]) -> set[str]:
    """The names a process's mappings may give `paths` by: their own, and the files on
    disk of the slots that spilled (a mapping names the file, not the link)."""
    return {str(p) for p in paths} | {os.path.realpath(p) for p in paths}


def _mapped(paths: set[str]) -> set[str]:
    """Which of `paths` some process of this machine maps now (those whose maps this
    user may read: another user's processes cannot map this user's slots anyway)."""
    found: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            with maps.open(encoding="utf-8", errors="replace") as f:
                for line in f:
                    name = line.rstrip("\n").split(maxsplit=5)[5:]
                    if name and (path := name[0].removesuffix(" (deleted)")) in paths:
                        found.add(path)
        except OSError:
            continue  # gone meanwhile, or not ours to read
    return found
