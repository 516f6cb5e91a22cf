"""The storage fence: a node the master may have given up on writes no checkpoint.

A node cut off from the bus but not from the checkpoint storage (a shared file
system, an object store) keeps training the round it has: nothing tells its workers
otherwise. Once the master has given up on it (no heartbeat for the job's node
timeout), a round without it restores an older step and saves the same step numbers
again: a new lineage. Were the cut-off node to go on persisting its own steps, it
would write files of an abandoned lineage under the numbers the new one commits, and
a later restore from storage would load them: samples trained twice or never.

So the agent persists only while the fence is open:

- its newest heartbeat reached the bus less than half the node timeout ago (the
  master gives up on a node only after a whole timeout without one), and
- after a time without one, once it has acted on every decision the master had made
  by the time it was heard again (it may have been dropped from the round, or the
  job may have gone on without it): `catch_up` names that decision, the agent's
  actor says how far it got (`handled`).

Memory saves go on behind a closed fence; persisting resumes from the newest step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import nats.errors
import structlog

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.errors import RoveError

log = structlog.get_logger("rove.agent")


class StorageFence:
    def __init__(
        self, *, node_timeout_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        self.clock = clock
        self.lease_s = node_timeout_s / 2
        self._heard = clock()  # (the agent starts in touch: it joins a new round)
        self._ever_heard = False
        self._out_of_touch = False
        #: the newest decision to act on before persisting again (None: none to wait for)
        self._target: int | None = None
        self._handled = 0
        self._probing = False
        self._changed = asyncio.Event()  # (set by what may open it)

    def set_node_timeout(self, node_timeout_s: float) -> None:
        """The job's node timeout (its `job_configured`)."""
        self.lease_s = node_timeout_s / 2

    def heard(self) -> None:
        """A heartbeat of this node reached the bus."""
        now = self.clock()
        # (its first heartbeat: before it the node was in no round to be given up on,
        # however long it took to start)
        if self._ever_heard and now - self._heard > self.lease_s:
            self._out_of_touch = True  # until it has caught up with what was decided
            self._target = None
        self._heard, self._ever_heard = now, True
        self._changed.set()

    @property
    def needs_catch_up(self) -> bool:
        """Heard again after a time out of touch, and the decision to reach not yet named."""
        return (
            self._out_of_touch
            and self._target is None
            and not self._probing
            and not self._lease_over()
        )

    async def probe(self, bus: Bus, job: str) -> None:
        """Ask the bus for the decision to catch up to (the stream sequence of the job's
        newest); a failure leaves it to the next try."""
        self._probing = True
        try:
            self.catch_up(await bus.last_seq(subjects.EVENTS_STREAM, subjects.master(job, ">")))
        except (RoveError, nats.errors.Error, TimeoutError) as exc:  # (asked again next tick)
            log.info(
                "could not read the job's newest decision", error=str(exc) or type(exc).__name__
            )
        finally:
            self._probing = False

    def catch_up(self, newest_decision: int) -> None:
        """The stream's newest decision of the job when the node was heard again."""
        self._target = newest_decision
        self._check()

    def handled(self, seq: int) -> None:
        """The agent acted on the decision stored at `seq`."""
        self._handled = max(self._handled, seq)
        self._check()

    def _check(self) -> None:
        if self._target is not None and self._handled >= self._target:
            self._out_of_touch, self._target = False, None
            self._changed.set()

    def _lease_over(self) -> bool:
        return self.clock() - self._heard > self.lease_s

    async def opened(self) -> None:
        """Return once the fence is open (a heartbeat stored, a decision acted on)."""
        while self.closed() is not None:
            self._changed.clear()
            await self._changed.wait()

    def closed(self) -> str | None:
        """Why this node may not persist now, or None."""
        if self._lease_over():
            return (
                f"this node has not reached the bus for {self.clock() - self._heard:.0f}s "
                "and the master may go on without it"
            )
        if self._out_of_touch:
            return "this node is catching up with what the master decided while it was cut off"
        return None
