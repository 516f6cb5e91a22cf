"""The agent's side of learned imports (`rove.agent.imports`): it tells its warm workers
to watch what they import, reads their lists once every worker of the round wrote its
final one (or, `FINAL_WITHIN_S` into the round, the ones written as their process
groups were made: a script that reports no steps), and keeps handing what they name to
`rove.agent.forkservers.learn`, saying what that did: a server started that imports N
more modules, ready for the next restart; or a module refused, and why (the one line a
user sees: restarts import it afresh)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rove.agent import forkservers, imports, progress
from rove.control.domain.words import counted


class Learning:
    """One agent's learning of its workers' imports (warm start only)."""

    def __init__(self, on: bool, log: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self.on = on
        self.log = log
        self.clock = clock
        self._since = 0.0
        #: every name its workers imported so far, in order
        self.names: tuple[str, ...] = ()
        self._keys: tuple[str, ...] = ()
        self._files: list[Path] = []
        #: the names `forkservers.learn` had nothing more to do for
        self._settled: tuple[str, ...] = ()

    def prepare(self, envs: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
        """A round's workers are to start with `envs`: their watch is on (in `envs`), and
        the variables that differ from this process's are what a server must not read."""
        if self.on:
            for env in envs.values():
                env[imports.ENV] = "1"
            self._keys = tuple(
                sorted(
                    {k for env in envs.values() for k, v in env.items() if os.environ.get(k) != v}
                    | {progress.ENV}
                )
            )
        return envs

    def started(self, files: dict[int, Path]) -> None:
        """The round's workers started, their progress in `files`: read their lists next."""
        if self.on:
            self._files = [imports.path_for(f) for f in files.values()]
            self._since = self.clock()

    def tick(self) -> None:
        """Each duty tick: read the lists once all are there, and hand what they name on."""
        if not self.on:
            return
        if self._files:
            lists = [imports.read(f) for f in self._files]
            if all(listed is not None for listed in lists):
                final = all(listed.final for listed in lists if listed is not None)
                if final or self.clock() - self._since >= imports.FINAL_WITHIN_S:
                    # (past the wait, the lists written as the groups were made: until final)
                    named = [listed.modules for listed in lists if listed is not None]
                    self.names = imports.union([self.names, *named])
                if final:
                    self._files = []
        if not self.names or self._settled == self.names:
            return
        lesson = forkservers.learn(self.names, self._keys)
        if lesson.settled:
            self._settled = self.names
        if lesson.started:
            packages = imports.union([[imports.top(n) for n in lesson.new]])
            self.log.info(
                f"the warm server for restarts learns {counted(len(lesson.new), 'module')} "
                f"the workers imported ({_some(packages)}): a restarted worker will find them "
                "imported",
                modules=len(lesson.new),
            )
        if lesson.refused is not None:
            package, why = lesson.refused
            if package:
                self.log.warning(
                    f"the warm server does not keep {package} imported: it {why}; a "
                    f"restarted worker imports {package} itself",
                    say=True,
                )
            else:
                self.log.warning(
                    f"the warm server that learned the workers' imports failed: {why}; a "
                    "restarted worker imports them itself",
                    say=True,
                )


def _some(names: tuple[str, ...], most: int = 6) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
