"""`training_progress` facts: how far this node's workers got in a round.

The heartbeat says where the workers are now and keeps only the newest; these
facts go on the events stream, so the job's whole history can be replayed:
`rove goodput` reads from them when each round's training began, how far it
got, and how long it spent blocked in checkpoint saves, restoring and waiting
for data (see `rove.control.domain.goodput`). One fact every `every_s` while steps
advance (and one at once when a restoring round's workers first say the step they
restored), and a last one when the round's workers end or are stopped, before the
fact that says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from rove.agent.facts import NodeFacts
from rove.agent.progress import Progress
from rove.control.catalogue import events as ev
from rove.control.domain import goodput
from rove.control.process import metrics

#: Seconds between two reports of a running round.
EVERY_S = 5.0


def summary(progress: Mapping[int, Progress]) -> dict[str, Any] | None:
    """The fields of a `training_progress` fact for these local ranks' reports (pure,
    `rove.control.domain.goodput.combined`)."""
    return goodput.combined(list(progress.values())) if progress else None


class ProgressReports:
    """Sends the `training_progress` facts of the round whose workers run here."""

    def __init__(
        self,
        facts: NodeFacts,
        read: Callable[[], Mapping[int, Progress]],
        *,
        every_s: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.facts = facts
        self.read = read
        self.every_s = every_s
        self.clock = clock
        self.round: int | None = None
        self._sent: dict[str, Any] | None = None
        self._last = 0.0
        self._awaiting_restore = False

    def start(self, rnd: int, restoring: bool = False) -> None:
        """The workers of round `rnd` started (their progress files are new);
        `restoring`: the round named a step to restore."""
        self.round = rnd
        self._sent = None
        self._last = self.clock()
        self._awaiting_restore = restoring

    def tick(self) -> None:
        """Report if `every_s` passed since the last report and the workers moved on,
        and, in a round that restores, at once the first time they say the step they
        restored: when it is older than the one the round named, the master's lineage
        starts there, best before the new lineage's checkpoints are reported (the agent
        ticks this first)."""
        if self.round is None:
            return
        news = self._restore_news() if self._awaiting_restore else None
        if news is not None or self.clock() - self._last >= self.every_s:
            self._last = self.clock()
            self._send(news)

    def _restore_news(self) -> dict[str, Any] | None:
        """The report's fields once the workers say the step they restored, else None."""
        fields = summary(self.read())
        return None if fields is None or fields["restored_step"] is None else fields

    def flush(self) -> None:
        """The round's workers ended or are being stopped: report where they got to."""
        if self.round is not None:
            self._send()
            self.round = None

    def _send(self, fields: dict[str, Any] | None = None) -> None:
        """Report the workers' progress (`fields`: as just read, else read now)."""
        fields = fields if fields is not None else summary(self.read())
        if fields is None or fields == self._sent or self.round is None:
            return
        before = float(self._sent["ckpt_block_s"]) if self._sent else 0.0
        metrics.CKPT_BLOCKING.labels(self.facts.job).inc(max(0.0, fields["ckpt_block_s"] - before))
        self._sent = fields
        if fields["restored_step"] is not None:
            self._awaiting_restore = False  # said: no longer looked for
        self.facts.emit(ev.TrainingProgress(**self.facts.envelope(), round=self.round, **fields))
