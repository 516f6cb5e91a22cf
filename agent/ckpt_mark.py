"""The node's mark on its checkpoint location: this job writes it (`rove.checkpoint.writers`).

Written as the agent starts, again every `MARK_EVERY_S` while it runs (off the event
loop), and removed when the job ends here: `rove run` of another job refuses the
location while the mark is fresh. Each refresh also reads the other jobs' marks: a job
that started beside this one all the same (both were started at once, or its mark was
missed) is said on the console, once per job, as the harm it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog

from rove.checkpoint import writers
from rove.checkpoint.engine import CheckpointError
from rove.checkpoint.storage import Storage

#: How long removing the mark may take as the job ends, and a refresh under way before
#: it (a hung store: the mark stops counting `writers.LIVE_S` after its last refresh all
#: the same).
DROP_S = 5.0


class LocationMark:
    def __init__(self, storage: Storage, job: str, node: str, log: structlog.BoundLogger) -> None:
        self.storage = storage
        self.job, self.node = job, node
        self.log = log
        self._task: asyncio.Task[None] | None = None
        self._at = -writers.MARK_EVERY_S  # (monotonic) when the last refresh started
        self._stopped = False
        self._failing = False  # the last refresh failed (said once, at info)
        self._said: set[str] = set()  # other jobs said to write here too

    def tick(self) -> None:
        """Refresh the mark when it is due and no refresh is under way."""
        now = time.monotonic()
        busy = self._task is not None and not self._task.done()
        if self._stopped or busy or now - self._at < writers.MARK_EVERY_S:
            return
        self._at = now
        self._task = asyncio.create_task(self._refresh(), name="checkpoint location mark")

    async def _refresh(self) -> None:
        try:
            # (read first: the job's claim keeps the time its first node made it)
            marks = await asyncio.to_thread(writers.read, self.storage)
            now = time.time()
            since = writers.claimed_since(marks, self.job, now)
            await asyncio.to_thread(writers.mark, self.storage, self.job, self.node, now, since)
        except CheckpointError as exc:
            if not self._failing:  # (persists fail in turn, and say it louder)
                self.log.info(f"could not mark the checkpoint location as this job's: {exc}")
            self._failing = True
            return
        except Exception as exc:  # a bug: said with its traceback; the next tick tries again
            self.log.error("internal error marking the checkpoint location", exc_info=exc)
            return
        self._failing = False
        for other in writers.live_others(marks, self.job, time.time()):
            if other.job not in self._said:
                self._said.add(other.job)
                self.log.warning(
                    f"another job, {other.job}, writes checkpoints in "
                    f"{self.storage.location} too (its node {other.node}): two jobs that "
                    "write one location at once remove each other's steps; stop one of them "
                    "and run it again with a --checkpoint-dir of its own"
                )

    async def stop(self) -> None:
        """The job ended here: remove the mark (a refresh under way first)."""
        if self._stopped:
            return
        self._stopped = True
        if self._task is not None and not self._task.done():
            # (a refresh hung on a store that does not answer: not waited for long)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), DROP_S)
        try:
            await asyncio.wait_for(asyncio.to_thread(self.storage.drop_mark, self.job), DROP_S)
        except (TimeoutError, CheckpointError) as exc:
            reason = str(exc) or f"no answer in {DROP_S:.0f} s"
            self.log.info(
                f"could not remove this job's mark on the checkpoint location: {reason}; "
                f"it stops counting {writers.LIVE_S:.0f} s after it was written"
            )
