"""The runs of a job, as `rove events`, `rove status` and `rove goodput` read them.

A job name can be run again, as torchrun runs an `--rdzv-id` again: a node that
joins an ended job starts its next run (the master decides `run_started`; its fold
leaves everything of the earlier runs behind). The events of all runs stay in the
job's stream, so an earlier run stays readable: run N is the stretch of the stream
from the join that started it (run 1: from the beginning) up to that of run N+1.
"""

from __future__ import annotations

import msgspec

from rove.control.bus import records
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain import goodput as gp
from rove.control.domain.words import counted
from rove.control.errors import ConfigError


async def starts(bus: Bus, job: str) -> dict[int, int]:
    """Run number -> the stream sequence it starts at: run 1 at 0, each later run at the
    join that started it (`RunStarted.since`; what the nodes of the run before said after
    its end, their leaving, is that run's). A run recorded without `since` starts right
    after the end of the one before."""
    ends: list[int] = []
    found = {1: 0}

    def add(rec: records.Recorded) -> None:
        e = rec.event
        if isinstance(e, ev.JobEnded):
            ends.append(rec.seq)
        elif isinstance(e, ev.RunStarted) and e.run not in found:
            after_end = max((s for s in ends if s < rec.seq), default=rec.seq - 1) + 1
            found[e.run] = e.since if after_end <= e.since < rec.seq else after_end

    await bus.read(subjects.EVENTS_STREAM, subjects.master(job, "*"), add)
    return found


def end_after(event: ev.Event, end: ev.JobEnded | None) -> ev.JobEnded | None:
    """The end of the job's newest run once `event` is read, `end` before it (pure): its
    `job_ended` if that is the newest of those and `run_started`, else None."""
    if isinstance(event, ev.JobEnded):
        return event
    return None if isinstance(event, ev.RunStarted) else end


async def newest_end(bus: Bus, job: str) -> ev.JobEnded | None:
    """The end of the job's newest run (`end_after`, over its stored events): None while
    it runs, or if it was cut off."""
    end: list[ev.JobEnded | None] = [None]

    def add(rec: records.Recorded) -> None:
        end[0] = end_after(rec.event, end[0])

    await bus.read(subjects.EVENTS_STREAM, subjects.master(job, "*"), add)
    return end[0]


#: what `rove status`, `rove jobs` and `rove goodput` call a newest run that never ended
CUT_OFF = "cut off"

#: why nothing more will come to it, as they say it
CUT_OFF_WHY = (
    "its rove run stopped without recording an end: killed, a second Ctrl-C, or its "
    "machine went down"
)


def cut_off(stored: bool, ended: bool) -> bool:
    """Whether the job's newest run was cut off (pure): its events are read from their
    store on this machine, no rove run keeps its server, and they record no end. Nothing
    more will come to it, until the job's name is run again: that goes on with this run,
    from the newest step its nodes find (in memory, or on storage)."""
    return stored and not ended


async def last_heard(bus: Bus, job: str) -> float | None:
    """When the newest of the job's events was recorded (None: none, or unreadable)."""
    seq, data = await bus.last_message(subjects.EVENTS_STREAM, subjects.job_events(job))
    if not seq:
        return None
    try:
        return ev.decode(data).ts
    except msgspec.DecodeError:
        return None


def span(found: dict[int, int], run: int | None) -> tuple[int, int | None]:
    """(first stream sequence of `run`, first sequence after it or None) from
    `starts`; `run` None is the newest run (pure).

    Raises:
        ConfigError: no such run.
    """
    newest = max(found)
    run = newest if run is None else run
    if run not in found:
        raise ConfigError(
            f"--run {run}: the job has run {counted(newest, 'time')} "
            + ("(run 1 only)" if newest == 1 else f"(runs 1-{newest})")
        )
    return found[run], found.get(run + 1)


def within(seq: int, bounds: tuple[int, int | None]) -> bool:
    lo, hi = bounds
    return seq >= lo and (hi is None or seq < hi)


async def ledger(bus: Bus, job: str, run: int | None = None) -> gp.Ledger:
    """The goodput ledger of `run` of `job` (None: the newest), folded from its events."""
    folded = gp.Ledger()
    bounds = span(await starts(bus, job), run)

    def add(rec: records.Recorded) -> None:
        if within(rec.seq, bounds):
            folded.add(rec.event)

    await bus.read(subjects.EVENTS_STREAM, subjects.job_events(job), add)
    return folded
