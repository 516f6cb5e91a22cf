"""Which jobs write a checkpoint location now: a mark per job, refreshed while it runs.

Two jobs given one location at once remove each other's steps: each keeps only its own
newest committed steps (`Storage.commit`'s `keep`), and a job restored to a step drops
the steps newer than it as an abandoned lineage's (`Storage.discard_newer`). The second
job's end said "its last checkpoint is committed" of a step the first job had removed.

So each node's agent marks the location as its job's while the job runs (`writers/JOB`,
`WriterMark`: the job, the node, when), again every `MARK_EVERY_S`, and removes the
mark when the job ends; `rove run` claims the location (`claim`: its mark written, then
the marks read) and refuses to start a job on a location that another job's mark,
refreshed within `LIVE_S`, says was claimed first (`rove.agent.run_checks.check_writers`):
of jobs started at once, one goes on. A job killed without ending leaves a mark that
stops counting `LIVE_S` after its last refresh. A job started afterwards on the same
location (a fine-tuning from the first's checkpoint) goes on from its committed step.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from rove.checkpoint.storage import Storage, mark_name

#: How often a running job's agents write its mark again.
MARK_EVERY_S = 10.0
#: A mark written longer ago than this names a job that no longer writes (it was killed
#: without ending): several refreshes, and machines' clocks a few seconds apart.
LIVE_S = 45.0


class WriterMark(msgspec.Struct, frozen=True, kw_only=True):
    """A job writing the location: `at` is the wall-clock time of the last refresh,
    `since` of the job's first mark there (its claim; 0 in an older rove's mark)."""

    job: str
    node: str
    at: float
    since: float = 0.0

    @property
    def first(self) -> float:
        """When the job claimed the location."""
        return self.since or self.at


def encode(mark: WriterMark) -> bytes:
    return msgspec.json.encode(mark)


def decode(raw: bytes | bytearray) -> WriterMark | None:
    """None for a mark no rove wrote (unreadable: as none)."""
    try:
        return msgspec.json.decode(raw, type=WriterMark)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def live_others(
    marks: Iterable[WriterMark], job: str, now: float, live_s: float = LIVE_S
) -> list[WriterMark]:
    """The marks of jobs other than `job` refreshed within `live_s` of `now`, the newest
    first. (A mark dated ahead of `now`, another machine's clock, counts as live.)"""
    found = [m for m in marks if m.job != job and now - m.at < live_s]
    return sorted(found, key=lambda m: -m.at)


def read(storage: Storage) -> list[WriterMark]:
    """The marks on `storage`, those no rove wrote left out.

    Raises:
        StorageError: the location could not be listed or read.
    """
    return [m for raw in storage.marks() if (m := decode(raw)) is not None]


def mark(storage: Storage, job: str, node: str, now: float, since: float = 0.0) -> None:
    """Mark `storage` as written by `job`'s `node` at `now`, the job's claim dating from
    `since` (`now` by default).

    Raises:
        StorageError: the mark could not be written.
    """
    storage.put_mark(job, encode(WriterMark(job=job, node=node, at=now, since=since or now)))


def claimed_since(marks: Iterable[WriterMark], job: str, now: float) -> float:
    """When `job` claimed the location, by its live mark among `marks`; else `now`."""
    return min((m.first for m in marks if m.job == job and now - m.at < LIVE_S), default=now)


def claim(storage: Storage, job: str, node: str, now: float) -> list[WriterMark]:
    """Mark `storage` as `job`'s, then read which other live jobs claimed it first: []
    when `job` may write there, else those jobs (newest first), and the claim is taken
    back (unless the job's own nodes already held it). Each of two jobs started at once
    writes before it reads, and the claims are ordered by (`since`, job): of the two,
    the later one sees the earlier and gives way, whichever read first. (Machines whose
    clocks disagree by more than the moments between their starts may both go on: each
    agent still warns of the other at its next refresh.)

    Raises:
        StorageError: the location could not be read or the mark written.
    """
    before = read(storage)
    since = claimed_since(before, job, now)
    held = since < now
    mark(storage, job, node, now, since)
    first = [m for m in live_others(read(storage), job, now) if (m.first, m.job) < (since, job)]
    if first and not held:
        storage.drop_mark(job)
    return first


def refusal(location: str, job: str, others: list[WriterMark], now: float) -> str:
    """Why `job` may not start on `location` while the jobs of `others` write it."""
    first = others[0]
    ago = max(0.0, now - first.at)
    also = f" (and {', '.join(m.job for m in others[1:])})" if others[1:] else ""
    return (
        f"--checkpoint-dir {location} is being written by another job, {first.job}{also} "
        f"(its node {first.node} marked it {ago:.0f} s ago): two jobs that write one "
        f"location at once remove each other's steps. Give job {job} a --checkpoint-dir "
        f"of its own; to go on from {first.job}'s checkpoint, run {job} once {first.job} "
        f"has ended. (If {first.job} is gone, killed without ending, its mark "
        f"{storage_mark_path(location, first.job)} stops counting {LIVE_S:.0f} s after it "
        "was written.)"
    )


def storage_mark_path(location: str, job: str) -> str:
    """Where `job`'s mark is under `location`, for a person to read or remove."""
    return f"{location.rstrip('/')}/{mark_name(job)}"
