"""The job metrics (`rove.control.process.metrics`), from the events a master folds.

`JobMetrics.observe` is called with each event and the state it led to, so it is
kept cheap: most events only reach the goodput ledger. The gauges that describe
the state (job phase, leases outstanding, goodput and badput) are computed from
the newest state and the master's `rove.control.domain.goodput.Ledger` when Prometheus
scrapes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp
from rove.control.master.state import JobState
from rove.control.process.metrics import (
    CKPT_COMMITTED,
    CKPT_FAILED,
    DETECT,
    MASTER_LEADER,
    RECOVERY,
    RESTARTS,
    ROUNDS,
    SCALE_PLANS,
    SHARDS_REQUEUED,
    WORKER_FAILURES,
)

#: The events that move a counter or a histogram.
_COUNTED = frozenset(
    {
        ev.RoundCompleted,
        ev.TaskRestarted,
        ev.WorkerExited,
        ev.NodeLost,
        ev.NodeGone,
        ev.NodeExcluded,
        ev.TrainingProgress,
        ev.CkptCommitted,
        ev.CkptFailed,
        ev.ShardRequeued,
        ev.ScalePlan,
    }
)


@dataclass
class JobMetrics:
    """Updates the job metrics from each event a master folds (`observe`)."""

    job: str
    ledger: gp.Ledger = field(default_factory=gp.Ledger)
    state: JobState | None = None
    _failed_at: float | None = None
    _failed_round: int = 0
    _failure_kind: str = ""
    _last_step_at: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        JOBS.jobs[self.job] = self

    def close(self) -> None:
        JOBS.jobs.pop(self.job, None)

    def leader(self, leads: bool) -> None:
        MASTER_LEADER.labels(self.job).set(1 if leads else 0)

    def observe(self, e: ev.Event, state: JobState) -> None:
        self.ledger.add(e)
        self.state = state
        if type(e) in _COUNTED:
            self._count(e, state)

    def _count(self, e: ev.Event, state: JobState) -> None:
        match e:
            case ev.RoundCompleted():
                ROUNDS.labels(self.job, e.cause.value).inc()
                if e.cause is ev.RoundCause.RESTART:
                    RESTARTS.labels(self.job, "job", self._failure_kind or "unknown").inc()
            case ev.TaskRestarted():
                RESTARTS.labels(self.job, "process", e.kind.value).inc()
                self._failed(e.ts, e.round)
            case ev.WorkerExited():
                WORKER_FAILURES.labels(self.job, e.kind.value).inc()
                if self._failed_at is None:  # the disruption's cause, not its symptoms
                    self._failure_kind = e.kind.value
                self._failed(e.ts, e.round)
            case ev.NodeLost() | ev.NodeGone() | ev.NodeExcluded():
                reason = {ev.NodeLost: "heartbeat_timeout", ev.NodeGone: "gone"}.get(
                    type(e), "excluded"
                )
                RESTARTS.labels(self.job, "node", reason).inc()
                self._failed(e.ts, state.rdzv.round)
            case ev.TrainingProgress():
                self._last_step_at[e.round] = max(self._last_step_at.get(e.round, 0.0), e.at)
                if self._failed_at is not None and (
                    e.round > self._failed_round or e.first_at > self._failed_at
                ):
                    RECOVERY.labels(self.job).observe(max(0.0, e.first_at - self._failed_at))
                    self._failed_at = None
            case ev.CkptCommitted():
                CKPT_COMMITTED.labels(self.job).inc()
            case ev.CkptFailed():
                CKPT_FAILED.labels(self.job).inc()
            case ev.ShardRequeued():
                SHARDS_REQUEUED.labels(self.job, e.reason.value).inc(len(e.shards))
            case ev.ScalePlan():
                cause = e.cause.split(":", 1)[0][:32] or "none"
                SCALE_PLANS.labels(self.job, e.rule.value, cause).inc()
            case _:
                pass

    def _failed(self, ts: float, rnd: int) -> None:
        if self._failed_at is not None:
            return  # the same disruption: its first sign counts
        self._failed_at, self._failed_round = ts, rnd
        last = self._last_step_at.get(rnd)
        if last is not None and last <= ts:
            DETECT.labels(self.job).observe(ts - last)


class _JobGauges(Collector):
    """The gauges of each job's newest state, computed when scraped: `rove_job_state`,
    `rove_shard_leases_outstanding`, `rove_goodput_ratio`, `rove_badput_seconds`."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobMetrics] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        phase = GaugeMetricFamily(
            "rove_job_state",
            "1 for the job's current phase, 0 for the others",
            labels=["job", "state"],
        )
        leases = GaugeMetricFamily(
            "rove_shard_leases_outstanding",
            "Data shards leased and not yet done",
            labels=["job", "dataset"],
        )
        ratio = GaugeMetricFamily(
            "rove_goodput_ratio",
            "Share of the job's time (as this master replayed it) that trained the model "
            "it ends with",
            labels=["job"],
        )
        badput = GaugeMetricFamily(
            "rove_badput_seconds",
            "Seconds of the job's time lost, by bucket",
            labels=["job", "bucket"],
        )
        for job, m in list(self.jobs.items()):
            state = m.state
            if state is not None:
                for p in ev.JobPhase:
                    phase.add_metric([job, p.value], 1 if p is state.phase else 0)
                for name, ds in state.data.datasets.items():
                    leases.add_metric([job, name], len(ds.leases))
            if m.ledger.first_ts is not None:
                r = gp.report(m.ledger, time.time())
                ratio.add_metric([job], r.goodput)
                for bucket, secs in r.badput().items():
                    badput.add_metric([job, bucket.value], secs)
        yield from (phase, leases, ratio, badput)


JOBS = _JobGauges()
prometheus_client.REGISTRY.register(JOBS)
