"""`training_progress` facts: how far this node's workers got in a round.

The heartbeat says where the workers are now and keeps only the newest; these
facts go on the events stream, so the job's whole history can be replayed:
`rove goodput` reads from them when each round's training began, how far it
got, and how long it spent blocked in checkpoint saves, restoring and waiting
for data (see `rove.control.goodput`). One fact every `every_s` while steps
advance, and a last one when the round's workers end or are stopped, before
the fact that says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from rove.agent.facts import NodeFacts
from rove.agent.progress import Progress
from rove.control import events as ev
from rove.control import metrics

#: Seconds between two reports of a running round.
EVERY_S = 5.0


def summary(progress: Mapping[int, Progress]) -> dict[str, float | int] | None:
    """The fields of a `training_progress` fact for these local ranks' reports (pure):
    the slowest rank's step, the newest step's time, the latest first step (training
    began when every rank stepped), and each duration's most of any rank."""
    if not progress:
        return None
    ps = list(progress.values())
    return {
        "step": min(p.step for p in ps),
        "at": max(p.at for p in ps),
        "first_step": max(p.first_step for p in ps),
        "first_at": max(p.first_at for p in ps),
        "ckpt_block_s": max(p.ckpt_block_s for p in ps),
        "data_wait_s": max(p.data_wait_s for p in ps),
        "restore_s": max(p.restore_s for p in ps),
    }


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
        self._sent: dict[str, float | int] | None = None
        self._last = 0.0

    def start(self, rnd: int) -> None:
        """The workers of round `rnd` started (their progress files are new)."""
        self.round = rnd
        self._sent = None
        self._last = self.clock()

    def tick(self) -> None:
        """Report if `every_s` passed since the last report and the workers moved on."""
        if self.round is not None and self.clock() - self._last >= self.every_s:
            self._last = self.clock()
            self._send()

    def flush(self) -> None:
        """The round's workers ended or are being stopped: report where they got to."""
        if self.round is not None:
            self._send()
            self.round = None

    def _send(self) -> None:
        fields = summary(self.read())
        if fields is None or fields == self._sent or self.round is None:
            return
        before = float(self._sent["ckpt_block_s"]) if self._sent else 0.0
        metrics.CKPT_BLOCKING.labels(self.facts.job).inc(max(0.0, fields["ckpt_block_s"] - before))
        self._sent = fields
        self.facts.emit(
            ev.TrainingProgress(
                **self.facts.envelope(),
                round=self.round,
                step=int(fields["step"]),
                at=float(fields["at"]),
                first_step=int(fields["first_step"]),
                first_at=float(fields["first_at"]),
                ckpt_block_s=float(fields["ckpt_block_s"]),
                data_wait_s=float(fields["data_wait_s"]),
                restore_s=float(fields["restore_s"]),
            )
        )
