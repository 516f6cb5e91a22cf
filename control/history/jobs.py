"""The jobs run on this machine, and which of their folders to keep (pure but for
reading the folders' listings and their small files).

Every `--standalone` job has a folder, `ROVE_HOME/jobs/<job>/`: its stored event
stream, its credentials, its workers' output. `rove jobs` lists them; retention
removes the oldest, by one rule shared by `rove jobs --prune` and the launcher (which
prunes as a job starts):

    keep the newest `keep` folders (by last use), every job still running, and every
    job pinned with `rove jobs --keep J`; remove the rest.

A job's one-line summary is computed from its events (`summarize`) and cached in its
folder as `summary.json` once it has ended (a rerun of the name removes it).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rove.control.bus import embedded, stored
from rove.control.domain import goodput as gp
from rove.control.domain import words
from rove.control.errors import ConfigError
from rove.control.master.state import JobState

#: how many job folders retention keeps by default (env ROVE_KEEP_JOBS)
KEEP_DEFAULT = 20
PIN = "pinned"
SUMMARY = "summary.json"
#: The version of `summarize` a cached summary was made by: raise it whenever what
#: `summarize` says of the same events changes, so that the summaries cached by an
#: older rove are read again from their events instead of shown as they were (those
#: cached before it said `-` for a job whose workers reported no step kept `0%`)
SUMMARY_VERSION = 2


#: The state of a job whose events are on a server this machine did not reach.
ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class Summary:
    """What `rove jobs` says about one job."""

    job: str
    state: str  # running, finished, failed, stopped, ... (the job's phase)
    start: float | None
    seconds: float
    rounds: int
    restarts: int
    last_failure: str
    goodput: float | None

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Summary:
        return cls(**data)  # type: ignore[arg-type]


def summarize(state: JobState, report: gp.Report, known: bool = True) -> Summary:
    """The summary of a job from its folded state and its goodput report (pure);
    `known`: whether its workers reported any step (`Ledger.steps_reported`): without
    one, its goodput is not known (None, `-`), as `rove goodput` says, not 0 %."""
    failure = state.rdzv.failure or state.rdzv.last_failure
    return Summary(
        job=state.job,
        state=state.phase.value,
        start=report.start if report.total_s > 0 else None,
        seconds=round(report.total_s, 1),
        rounds=report.rounds,
        restarts=state.rdzv.restarts,
        last_failure=(
            f"rank {failure.rank} on {failure.node}: "
            f"{words.failure(failure.kind.value, failure.reason)}"
            if failure is not None
            else ""
        ),
        goodput=round(report.goodput, 4) if known and report.total_s > 0 else None,
    )


@dataclass(frozen=True)
class Folder:
    """A job's folder as retention sees it."""

    job: str
    last_used: float
    running: bool
    pinned: bool


def to_prune(folders: Iterable[Folder], keep: int) -> list[str]:
    """The jobs whose folders retention removes: all but the `keep` newest, never a
    running or pinned one (pure)."""
    newest_first = sorted(folders, key=lambda f: f.last_used, reverse=True)
    return [f.job for f in newest_first[keep:] if not f.running and not f.pinned]


def keep_from_env() -> int:
    """How many job folders retention keeps: ROVE_KEEP_JOBS, else KEEP_DEFAULT."""
    text = os.environ.get("ROVE_KEEP_JOBS", "").strip()
    if not text:
        return KEEP_DEFAULT
    if not text.isdigit():
        raise ConfigError(f"ROVE_KEEP_JOBS must be a whole number of jobs, got {text!r}")
    return int(text)


def prune(keep: int, *, besides: str | None = None) -> list[str]:
    """Remove the job folders retention does not keep (`besides`: the job starting now,
    never removed); returns the jobs removed."""
    folders = [
        folder_of(job, job == besides or stored.running_url(job) is not None) for job in names()
    ]
    removed = to_prune(folders, keep)
    for job in removed:
        shutil.rmtree(embedded.job_dir(job), ignore_errors=True)
    return removed


def root() -> Path:
    return embedded.rove_home() / "jobs"


def names() -> list[str]:
    """The jobs with a folder on this machine, newest first."""
    here = root()
    if not here.is_dir():
        return []
    folders = [p for p in here.iterdir() if p.is_dir()]
    return [p.name for p in sorted(folders, key=_last_used, reverse=True)]


def folder_of(job: str, running: bool) -> Folder:
    path = embedded.job_dir(job)
    return Folder(job, _last_used(path), running, (path / PIN).exists())


def _last_used(path: Path) -> float:
    """When a job last ran here: the newest change to its server's folders (a run writes
    and removes its ports file) or its log folders (a round adds one), not to the
    folder itself (its cached summary and pin are written there by readers)."""
    times = []
    logs = path / "logs"
    nodes = list(logs.iterdir()) if logs.is_dir() else []
    for part in (path / "nats", path / "nats" / "ports", logs, *nodes):
        try:
            times.append(part.stat().st_mtime)
        except OSError:
            continue
    if times:
        return max(times)
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def cached(job: str) -> Summary | None:
    """The job's cached summary; None if there is none, it is unreadable, or an older
    `summarize` made it (`SUMMARY_VERSION`)."""
    try:
        data = json.loads((embedded.job_dir(job) / SUMMARY).read_text())
        if data.pop("version", None) != SUMMARY_VERSION:
            return None
        return Summary.from_json(data)
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def cache(summary: Summary) -> None:
    """Keep an ended job's summary in its folder (written whole or not at all)."""
    path = embedded.job_dir(summary.job) / SUMMARY
    partial = path.with_suffix(".partial")
    try:
        partial.write_text(json.dumps({"version": SUMMARY_VERSION, **summary.to_json()}))
        partial.replace(path)
    except OSError:
        partial.unlink(missing_ok=True)


def forget_summary(job: str) -> None:
    """A rerun of the name: its summary is stale."""
    (embedded.job_dir(job) / SUMMARY).unlink(missing_ok=True)


def pin(job: str, on: bool = True) -> None:
    marker = embedded.job_dir(job) / PIN
    if on:
        marker.write_text("kept by `rove jobs --keep`\n")
    else:
        marker.unlink(missing_ok=True)


def render(rows: Sequence[Summary], pinned: set[str]) -> str:
    """The table `rove jobs` prints (pure)."""
    header = (
        f"{'JOB':<24} {'STATE':<9} {'STARTED':<19} {'TOOK':>8} {'ROUNDS':>6} "
        f"{'RESTARTS':>8} {'GOODPUT':>7}  LAST FAILURE"
    )
    lines = [header]
    for r in rows:
        started = words.local_time(r.start) if r.start else "-"
        known = r.state != ELSEWHERE  # (its events were not read: nothing to count)
        took = _took(r.seconds) if known else "-"
        rounds, restarts = (r.rounds, r.restarts) if known else ("-", "-")
        good = f"{r.goodput:.0%}" if r.goodput is not None else "-"
        name = r.job + (" *" if r.job in pinned else "")
        failure = r.last_failure if len(r.last_failure) <= 60 else r.last_failure[:59] + "…"
        lines.append(
            f"{name:<24} {r.state:<9} {started:<19} {took:>8} {rounds:>6} "
            f"{restarts:>8} {good:>7}  {failure or '-'}"
        )
    if pinned & {r.job for r in rows}:
        lines.append("(* kept: pinned with rove jobs --keep)")
    return "\n".join(lines) + "\n"


def _took(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"
