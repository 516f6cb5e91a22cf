"""Which jobs write a checkpoint location now: a mark per job, refreshed while it runs.

Two jobs given one location at once remove each other's steps: each keeps only its own
newest committed steps (`Storage.commit`'s `keep`), and a job restored to a step drops
the steps newer than it as an abandoned lineage's (`Storage.discard_newer`). The second
job's end said "its last checkpoint is committed" of a step the first job had removed.

So each node's agent marks the location as its job's while the job runs (`writers/JOB`,
`WriterMark`: the job, the node, when), again every `MARK_EVERY_S`, and removes the
mark when the job ends; `rove run` refuses to start a job on a location that another
job's mark, refreshed within `LIVE_S`, says is being written
(`rove.agent.run_checks.check_writers`). A job killed without ending leaves a mark that
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
    """A job writing the location: `at` is the wall-clock time of the last refresh."""

    job: str
    node: str
    at: float


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


def mark(storage: Storage, job: str, node: str, now: float) -> None:
    """Mark `storage` as written by `job`'s `node` at `now`.

    Raises:
        StorageError: the mark could not be written.
    """
    storage.put_mark(job, encode(WriterMark(job=job, node=node, at=now)))


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
