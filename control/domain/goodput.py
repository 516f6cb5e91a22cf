"""Goodput: how much of a job's time trained the model it ends with, from its event log.

Pure: `Ledger.add` folds events in stream order, `Ledger.timeline` lays the job
out as labelled intervals and `report` sums them over any window. The log is
replayable, so the figures of any past interval can be computed again, exactly,
by anyone who can read the stream (`rove goodput`); the master keeps a ledger
too, for its `rove_goodput_ratio` metric.

Each rendezvous round is cut into:

* **start-up**: from the round's decision to the workers' first step (process
  start, imports, the first step itself), less the time spent restoring;
* **restore**: loading the checkpoint (`training_progress.restore_s`);
* **productive**: training whose steps the final model contains;
* **wasted progress**: training rolled back by a later restore;
* **checkpoint blocking** and **data waiting**: the time the workers report
  blocked in checkpoint saves and waiting for batches, taken out of the
  round's training time in proportion;
* **disruption**: from the round's last step to the failure being known (a
  worker's exit, a node lost after its heartbeat timeout);
* **rendezvous**: from then to the next round's decision (**pending nodes**
  when the scaler was waiting for a node meanwhile);
* **other**: after the last step of a round that ended without a failure
  (the job finishing, a round replaced to grow the job).

Before the first round the job is in start-up (or pending nodes) until a node
asks for a rendezvous, then in rendezvous. Which steps the final model contains
follows the lineage backwards: the last round's steps, then those of the round
that reached the step it restored, and so on; every other step was wasted.
Training times are placed on steps from the workers' reports, interpolated
between reports (`rove.agent.reports`: every few seconds, and at each round's
end).
"""

from __future__ import annotations

import bisect
import enum
import itertools
import math
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from rove.control.catalogue import events as ev

#: Said instead of a ratio where no worker reported a step (`Ledger.steps_reported`):
#: no second can then be told productive.
NOT_KNOWN = (
    "goodput not known: the workers reported no step (the job ended before their first, "
    "or the script does not call rove.agent.progress.report(step) in its training loop)"
)


class Bucket(enum.StrEnum):
    PRODUCTIVE = "productive"
    START_UP = "start-up"
    RENDEZVOUS = "rendezvous"
    RESTORE = "restore"
    CHECKPOINT = "checkpoint blocking"
    WASTED = "wasted progress"
    DATA = "data waiting"
    PENDING = "pending nodes"
    DISRUPTION = "disruption"
    OTHER = "other"


#: How much earlier than the job's first stored event a later one may say it happened
#: and still move the job's start: a node's facts buffered while the bus was away, a
#: clock a little behind. An older time (a clock far off, a forged event: the nemesis
#: once made a job last 57 years) does not move it.
SKEW_S = 120.0

#: A round keeps the points (step, time) it places steps in time by at least this far
#: apart: every node's report every few seconds would otherwise keep one each (a job
#: of 1,000 nodes: 200 a second, 2 GB a day in the master and in `rove goodput`).
POINT_GAP_S = 1.0
#: ... and at most about this many: past it every other one goes and the gap doubles,
#: so a round of a week costs what a round of hours does, at a coarser grain.
MAX_POINTS = 4096
#: The newest rounds that keep each node's latest report apart (the newest, and the one
#: before it, whose nodes report their last steps as the new round forms). An older
#: round is closed: its nodes' reports folded into one (`combined`), its points thinned
#: to about `CLOSED_POINTS`, so a job of many rounds does not keep nodes x rounds reports
#: (1,000 nodes, 200 rounds: 38 MiB in the master and 11 MB in each snapshot).
OPEN_ROUNDS = 2
CLOSED_POINTS = 256


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    bucket: Bucket
    round: int = 0
    #: parts of this interval that belong to other buckets (fractions), not placed in time
    carve: tuple[tuple[Bucket, float], ...] = ()


@dataclass(frozen=True)
class Failure:
    ts: float
    what: str
    node: str
    reason: str


class _Reported(Protocol):
    """A worker's progress file (`rove.agent.progress.Progress`) or a node's
    `training_progress` fact."""

    @property
    def step(self) -> int: ...
    @property
    def at(self) -> float: ...
    @property
    def first_step(self) -> int: ...
    @property
    def first_at(self) -> float: ...
    @property
    def ckpt_block_s(self) -> float: ...
    @property
    def data_wait_s(self) -> float: ...
    @property
    def restore_s(self) -> float: ...
    @property
    def restored_step(self) -> int | None: ...


def combined(reports: Sequence[_Reported]) -> dict[str, Any]:
    """Several workers' (or nodes') progress in one round as one: the slowest one's
    step, the newest step's time, the latest first step (training began when every
    one of them stepped), and each duration's most of any. The agent sums up its
    local ranks this way (`rove.agent.reports`), and the ledger its nodes."""
    return {
        "step": min(p.step for p in reports),
        "at": max(p.at for p in reports),
        "first_step": max(p.first_step for p in reports),
        "first_at": max(p.first_at for p in reports),
        "ckpt_block_s": max(p.ckpt_block_s for p in reports),
        "data_wait_s": max(p.data_wait_s for p in reports),
        "restore_s": max(p.restore_s for p in reports),
        # the ranks restore the same step (they agree on it); the oldest if they did not
        "restored_step": min(
            (p.restored_step for p in reports if p.restored_step is not None), default=None
        ),
    }


class Reported(msgspec.Struct, frozen=True, array_like=True):
    """What goodput keeps of a node's latest `training_progress` in a round (the
    fields `combined` reads; not the whole event: a job of 25,000 nodes kept 13 MB of
    them per two rounds, in every snapshot of its master)."""

    step: int
    at: float
    first_step: int
    first_at: float
    ckpt_block_s: float = 0.0
    data_wait_s: float = 0.0
    restore_s: float = 0.0
    restored_step: int | None = None


#: A report's figures, read from a `training_progress` event by `Reported`'s own field
#: names (C-level, as quick as naming them: the fold runs once per event)
_figures = operator.attrgetter(*Reported.__struct_fields__)


@dataclass
class _Round:
    round: int
    ts: float
    #: the step it named to restore, or the older one its workers say they restored
    restore_step: int | None
    #: where its ranks restored from (`RestoreSource`; "": a fresh start)
    restore_source: str = ""
    started: float | None = None
    #: each node's latest report (until the round is closed)
    latest: dict[str, Reported] = field(default_factory=dict)
    #: whether it is closed (`close`): no longer one of the newest rounds
    closed: bool = False
    #: once closed: every node's latest report as one, and the reports that arrived
    #: later folded into it
    folded: Reported | None = None
    #: (step, time) from the reports, for placing steps in time (`add_point`)
    points: list[tuple[int, float]] = field(default_factory=list)
    #: how far apart the points kept are (0: every report's; grows with `max_points`)
    gap_s: float = POINT_GAP_S
    #: at most about this many points (0: no bound)
    max_points: int = MAX_POINTS

    def add_point(self, step: int, at: float) -> None:
        """Keep (step, at) as a point. Points stay at least `gap_s` apart, except the
        newest one: a report within `gap_s` of the point before the newest replaces the
        newest (so the round's latest step is always a point). Past `max_points`,
        every other point goes and `gap_s` doubles."""
        pts = self.points
        if len(pts) >= 2 and at >= pts[-1][1] and at - pts[-2][1] < self.gap_s:
            pts[-1] = (step, at)
            return
        if pts and abs(at - pts[-1][1]) < self.gap_s and at < pts[-1][1]:
            return  # a report arriving late, within the gap of the newest: nothing new
        pts.append((step, at))
        if self.max_points and len(pts) > self.max_points:
            self._halve()

    def _halve(self) -> None:
        """Every other point goes (the newest stays one) and the gap doubles."""
        self.points = [*self.points[:-1:2], self.points[-1]]
        self.gap_s = max(self.gap_s, POINT_GAP_S) * 2

    def report(self, node: str, reported: Reported) -> None:
        """A node's newest report: kept apart while the round is open; once it is
        closed, folded into the rest (it can then raise the round's step only where it
        was not the slowest node's)."""
        if not self.closed:
            self.latest[node] = reported
        elif self.folded is None:
            self.folded = reported
        else:
            self.folded = Reported(**combined([self.folded, reported]))

    def close(self, max_points: int) -> None:
        """Fold the nodes' reports into one and thin the points to about `max_points`
        (0: keep them): the round is no longer one of the newest."""
        self.folded, self.latest, self.closed = self.progress(), {}, True
        while max_points and len(self.points) > max(max_points, 2):
            self._halve()

    def progress(self) -> Reported | None:
        """The round's progress over all its nodes (`combined`)."""
        reports = list(self.latest.values())
        if self.folded is not None:
            reports.append(self.folded)
        if not reports:
            return None
        return Reported(**combined(reports))

    def time_of(self, step: int) -> float:
        """When this round reached `step` (interpolated between reports)."""
        pts = sorted(self.points)
        steps = [s for s, _ in pts]
        i = bisect.bisect_left(steps, step)
        if i >= len(pts):
            return pts[-1][1]
        if i == 0 or pts[i][0] == step:
            return pts[i][1]
        (s0, t0), (s1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (step - s0) / (s1 - s0)


@dataclass
class Ledger:
    """What goodput needs from a job's events, folded in stream order."""

    job: str = ""
    first_ts: float | None = None
    ended_ts: float | None = None
    ended: str = ""
    epoch: int = 0
    rounds: dict[int, _Round] = field(default_factory=dict)
    #: when nodes asked for the first round (the first ask ends the job's start-up;
    #: later rounds' asks are not kept: 25,000 nodes ask again every round)
    rdzv_asks: list[float] = field(default_factory=list)
    pending: list[float] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    last_ts: float = 0.0
    #: each round's points: how far apart, and how many at most (`_Round.add_point`)
    point_gap_s: float = POINT_GAP_S
    max_points: int = MAX_POINTS
    #: how many of the newest rounds stay open (0: every round, as before rounds closed),
    #: and how many points a closed one keeps (`_Round.close`)
    open_rounds: int = OPEN_ROUNDS
    closed_points: int = CLOSED_POINTS

    def add(self, e: ev.Event) -> None:
        """Fold `e` (cheap for the many events goodput ignores: a master folds every
        event through here)."""
        ts = e.ts
        if self.first_ts is None:
            self.first_ts, self.job = ts, e.job
        elif self.first_ts - SKEW_S <= ts < self.first_ts:
            self.first_ts = ts  # (a node's fact stored late, or its clock a little behind)
        if ts > self.last_ts:
            self.last_ts = ts
        fold = _FOLDS.get(type(e))
        if fold is None:
            return
        if isinstance(e, ev.Decision):
            if e.epoch < self.epoch:
                return  # a deposed master's decision
            self.epoch = e.epoch
        fold(self, e)

    @property
    def steps_reported(self) -> bool:
        """Whether the workers reported any step (`rove.agent.progress.report`): without
        one, no time can be told productive."""
        return any(r.points for r in self.rounds.values())

    def _round_completed(self, e: ev.RoundCompleted) -> None:
        self.rounds[e.round] = _Round(
            e.round,
            e.ts,
            e.restore_step,
            e.restore_source.value,
            gap_s=self.point_gap_s,
            max_points=self.max_points,
        )
        if self.open_rounds:
            # the rounds that just stopped being among the newest (rounds are kept in
            # the order they formed), back to the first one closed before: one a round,
            # or all of them once for a ledger from before rounds closed
            for older in itertools.islice(reversed(self.rounds.values()), self.open_rounds, None):
                if older.closed:
                    break
                older.close(self.closed_points)

    def _workers_started(self, e: ev.WorkersStarted) -> None:
        r = self.rounds.get(e.round)
        if r is not None:
            r.started = max(r.started or e.ts, e.ts)

    def _progress(self, e: ev.TrainingProgress) -> None:
        r = self.rounds.get(e.round)
        if r is None:
            return
        r.report(e.node, Reported(*_figures(e)))
        named, loaded = r.restore_step, e.restored_step
        if named is not None and loaded is not None and loaded < named:  # named unreadable
            r.restore_step, r.restore_source = loaded, "storage"
        if not r.points:
            r.points.append((e.first_step, e.first_at))
        r.add_point(e.step, e.at)

    def _rdzv_joined(self, e: ev.RdzvJoined) -> None:
        if not self.rounds:
            self.rdzv_asks.append(e.ts)

    def _pending(self, e: ev.NodePending) -> None:
        self.pending.append(e.ts)

    def _task_restarted(self, e: ev.TaskRestarted) -> None:
        self.failures.append(Failure(e.ts, "task_restarted", e.node, e.reason))

    def _failed(self, e: ev.WorkerExited | ev.NodeLost | ev.NodeExcluded | ev.NodeGone) -> None:
        self.failures.append(Failure(e.ts, ev.kind(e), e.node, getattr(e, "reason", "") or ""))

    def _ended(self, e: ev.JobEnded) -> None:
        self.ended_ts = e.ts
        self.ended = e.phase.value

    def _elected(self, e: ev.MasterElected) -> None:
        pass  # its epoch, taken in `add`

    def end(self, now: float) -> float:
        """When the job ended, or `now` while it runs."""
        return self.ended_ts if self.ended_ts is not None else max(now, self.last_ts)

    def survivors(self) -> dict[int, int | None]:
        """Round → the last of its steps the final model contains (None: none of them)."""
        out: dict[int, int | None] = {}
        s = math.inf
        for n in sorted(self.rounds, reverse=True):
            r = self.rounds[n]
            p = r.progress()
            start = _start_step(r, p)
            if p is None or s <= start:
                out[n] = None
                continue
            out[n] = int(min(s, p.step))
            s = start
        return out

    def timeline(self, now: float) -> list[Interval]:
        """The job from its first event to its end (or `now`), as labelled intervals."""
        if self.first_ts is None:
            return []
        end = self.end(now)
        out: list[Interval] = []
        rounds = [self.rounds[n] for n in sorted(self.rounds)]
        first_round = rounds[0].ts if rounds else end
        asked = next((t for t in self.rdzv_asks if t <= first_round), first_round)
        before = Bucket.PENDING if any(t < asked for t in self.pending) else Bucket.START_UP
        _put(out, self.first_ts, asked, before, 0)
        _put(out, asked, first_round, self._waiting(asked, first_round), 0)
        survive = self.survivors()
        for i, r in enumerate(rounds):
            until = rounds[i + 1].ts if i + 1 < len(rounds) else end
            out.extend(self._round(r, until, survive.get(r.round)))
        return [iv for iv in out if iv.end > iv.start]

    def _waiting(self, start: float, end: float) -> Bucket:
        return Bucket.PENDING if any(start <= t < end for t in self.pending) else Bucket.RENDEZVOUS

    def _failure_after(self, t: float, until: float) -> float | None:
        return next(
            (f.ts for f in self.failures if t <= f.ts < until and f.what != "task_restarted"),
            None,
        )

    def _round(self, r: _Round, until: float, survive: int | None) -> list[Interval]:
        out: list[Interval] = []
        n = r.round
        if r.started is None:
            _put(out, r.ts, until, Bucket.RENDEZVOUS, n)
            return out
        started = min(r.started, until)
        _put(out, r.ts, started, Bucket.START_UP, n)
        p = r.progress()
        if p is None:  # no step at all: a crash on start, or stopped before one
            failed = self._failure_after(started, until)
            cut = until if failed is None else failed
            _put(out, started, cut, Bucket.START_UP, n)
            _put(out, cut, until, self._waiting(cut, until), n)
            return out
        first = min(max(p.first_at, started), until)
        restore = min(p.restore_s, first - started)
        _put(out, started, first - restore, Bucket.START_UP, n)
        _put(out, first - restore, first, Bucket.RESTORE, n)
        last_at = min(max(p.at, first), until)
        span = last_at - first
        carve: tuple[tuple[Bucket, float], ...] = ()
        if span > 0:
            ckpt = min(1.0, p.ckpt_block_s / span)
            data = min(1.0 - ckpt, p.data_wait_s / span)
            carve = tuple((b, f) for b, f in ((Bucket.CHECKPOINT, ckpt), (Bucket.DATA, data)) if f)
        kept = first if survive is None else min(max(r.time_of(survive), first), last_at)
        out.append(Interval(first, kept, Bucket.PRODUCTIVE, n, carve))
        out.append(Interval(kept, last_at, Bucket.WASTED, n, carve))
        failed = self._failure_after(last_at, until)
        if failed is None:
            _put(out, last_at, until, Bucket.OTHER, n)
        else:
            _put(out, last_at, failed, Bucket.DISRUPTION, n)
            _put(out, failed, until, self._waiting(failed, until), n)
        return out


#: The events goodput reads, by type (everything else only moves the job's ends).
_FOLDS: dict[type[ev.Event], Callable[[Ledger, Any], None]] = {
    ev.RoundCompleted: Ledger._round_completed,
    ev.WorkersStarted: Ledger._workers_started,
    ev.TrainingProgress: Ledger._progress,
    ev.RdzvJoined: Ledger._rdzv_joined,
    ev.NodePending: Ledger._pending,
    ev.TaskRestarted: Ledger._task_restarted,
    ev.WorkerExited: Ledger._failed,
    ev.NodeLost: Ledger._failed,
    ev.NodeExcluded: Ledger._failed,
    ev.NodeGone: Ledger._failed,
    ev.JobEnded: Ledger._ended,
    ev.MasterElected: Ledger._elected,
}


def _start_step(r: _Round, p: Reported | None) -> float:
    """The step round `r` started after: the step it restored, else the one before its
    first report (a fresh start: nothing earlier survives)."""
    if r.restore_step is not None:
        return r.restore_step
    if p is None:
        return -math.inf
    return p.first_step - 1 if p.first_step > 1 else -math.inf


def _put(out: list[Interval], start: float, end: float, bucket: Bucket, rnd: int) -> None:
    if end > start:
        out.append(Interval(start, end, bucket, rnd))


@dataclass(frozen=True)
class Report:
    job: str
    start: float
    end: float
    seconds: Mapping[Bucket, float]
    rounds: int
    failures: tuple[Failure, ...]
    ended: str
    #: rounds that restored a checkpoint, by where from (memory, peer, storage)
    restores: Mapping[str, int] = field(default_factory=dict)
    #: the job's whole timeline (not only the window), for pictures
    intervals: tuple[Interval, ...] = ()

    @property
    def total_s(self) -> float:
        return self.end - self.start

    @property
    def goodput(self) -> float:
        total = self.total_s
        return self.seconds.get(Bucket.PRODUCTIVE, 0.0) / total if total > 0 else 0.0

    def badput(self) -> dict[Bucket, float]:
        return {b: s for b, s in self.seconds.items() if b is not Bucket.PRODUCTIVE}


def sum_buckets(
    intervals: Iterable[Interval], since: float = -math.inf, until: float = math.inf
) -> dict[Bucket, float]:
    """Seconds per bucket of the parts of `intervals` inside [since, until]."""
    out = dict.fromkeys(Bucket, 0.0)
    for iv in intervals:
        length = min(iv.end, until) - max(iv.start, since)
        if length <= 0:
            continue
        rest = 1.0
        for bucket, frac in iv.carve:
            out[bucket] += length * frac
            rest -= frac
        out[iv.bucket] += length * max(0.0, rest)
    return out


def report(
    ledger: Ledger, now: float, since: float | None = None, until: float | None = None
) -> Report:
    """Goodput and badput of the job over [since, until] (default: its whole life)."""
    intervals = ledger.timeline(now)
    start = now if ledger.first_ts is None else ledger.first_ts
    end = ledger.end(now)
    lo = start if since is None else max(start, since)
    hi = end if until is None else min(end, until)
    hi = max(hi, lo)
    return Report(
        job=ledger.job,
        start=lo,
        end=hi,
        seconds=sum_buckets(intervals, lo, hi),
        rounds=sum(1 for r in ledger.rounds.values() if lo <= r.ts <= hi),
        failures=tuple(f for f in ledger.failures if lo <= f.ts <= hi),
        ended=ledger.ended,
        restores=dict(
            Counter(
                r.restore_source
                for r in ledger.rounds.values()
                if lo <= r.ts <= hi and r.restore_source and r.restore_step is not None
            )
        ),
        intervals=tuple(intervals),
    )


_ledger_enc = msgspec.msgpack.Encoder()
_ledger_dec = msgspec.msgpack.Decoder(Ledger)


def encode(ledger: Ledger) -> bytes:
    """The ledger as bytes, for a master's snapshot (`decode` gives it back)."""
    return _ledger_enc.encode(ledger)


def decode(data: bytes | memoryview) -> Ledger:
    """A ledger from `encode`'s bytes.

    Raises:
        msgspec.DecodeError, msgspec.ValidationError: they are not a ledger's.
    """
    return _ledger_dec.decode(data)


def of_events(events: Iterable[ev.Event]) -> Ledger:
    ledger = Ledger()
    for e in events:
        ledger.add(e)
    return ledger
