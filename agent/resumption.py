"""How long a node's training stood still after an interruption, said once its
workers train again: "round 2: training again 0.6s after the interruption, at step
151 (restored step 150 from memory)".

An interruption is this node's own worker failing or hanging, or a new round taking
its running workers away (another node's failure, a new size). The sentence comes the
first time every local rank of the next round has reported a step, so it covers the
whole stop: the decision, the new round, the restore and the first step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rove.agent.progress import Progress
from rove.control.catalogue import events as ev


class Resumption:
    def __init__(self, say: Callable[..., Any], clock: Callable[[], float]) -> None:
        """`say(text, **context)`: where the sentence goes (a logger's info)."""
        self.say = say
        self.clock = clock
        self._since: float | None = None
        self._waiting: tuple[float, ev.RoundCompleted] | None = None

    def interrupted(self) -> None:
        """The workers were stopped or failed (the first such moment counts)."""
        if self._since is None:
            self._since = self.clock()

    def round_started(self, r: ev.RoundCompleted) -> None:
        """Round `r`'s workers were started here."""
        if self._waiting is not None:
            # the round before never trained a step here: this one resumes instead,
            # counting from the first interruption
            self._waiting = (self._waiting[0], r)
        elif r.cause not in (ev.RoundCause.FORMED, ev.RoundCause.SCALE_UP):
            self._waiting = (self._since or self.clock(), r)
        self._since = None

    @property
    def waiting(self) -> bool:
        return self._waiting is not None

    def progress(self, reported: Mapping[int, Progress]) -> None:
        """The local ranks' newest reports: say it once all of them trained a step."""
        if self._waiting is None or not reported:
            return
        if any(p.first_step == 0 for p in reported.values()):
            return
        since, r = self._waiting
        self._waiting = None
        step = min(p.step for p in reported.values())
        first = min(p.first_step for p in reported.values())
        loaded = [p.restored_step for p in reported.values() if p.restored_step is not None]
        self.say(
            f"round {r.round}: training again {self.clock() - since:.1f}s after the "
            f"interruption, at step {step} ({restored(r, first, min(loaded, default=None))})",
            round=r.round,
        )


def _named(r: ev.RoundCompleted) -> str | None:
    """The step round `r` names to restore and where from ("step 30 from storage"), or
    None for a fresh start."""
    if r.restore_step is not None and r.restore_source is not ev.RestoreSource.NONE:
        return f"step {r.restore_step} from {r.restore_source.value}"
    return None


def restored(r: ev.RoundCompleted, first: int, loaded: int | None = None) -> str:
    """Where round `r`'s ranks restored from, as a clause; `first`: the first step they
    trained, `loaded`: the step their checkpointer says they restored, if it says (older
    than the named one: they fell back to an older step, the named one unreadable on
    some rank)."""
    named = _named(r)
    if named is None:
        return "no checkpoint to restore: trained from the start"
    assert r.restore_step is not None
    if loaded is not None and loaded < r.restore_step:
        return f"{named} could not be read: the ranks restored step {loaded} from storage"
    if first < r.restore_step:
        return f"{named} could not be read: the ranks went back to an older step"
    return f"restored {named}"


def restoring(r: ev.RoundCompleted) -> str:
    """What round `r`'s workers restore, as the tail of the sentence that starts them."""
    named = _named(r)
    return "" if named is None else f"; they restore {named}"
