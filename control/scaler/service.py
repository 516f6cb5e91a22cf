"""The scaler: follows a managed job and applies its scale plans through a backend.

It never decides anything. The master's optimiser publishes a `scale_plan`;
the scaler starts the plan's nodes, then stops the ones it removes, each call
retried with backoff (`rove.control.bus.retry`) inside one total deadline per
plan, and reports `plan_applied` or `plan_failed` (ids made of the plan
number: a report sent twice is stored once). It also tells the master at once
when a node's process ends (`node_gone`), instead of leaving it to heartbeat
timeouts, and when the backend cannot place a node (`node_pending`).

Crash safety: the plan being applied is part of the folded state
(`scale.pending_plan`) until its outcome is folded, so a scaler killed half-way
and started again applies the same plan again. Backends create each node
name at most once, so nothing is created twice and nothing is forgotten.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from rove.control.bus import records, retry
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import PermanentError, TemporaryError
from rove.control.master.service import JobService
from rove.control.master.state import NodeStatus
from rove.control.scaler.backend import Backend

log = structlog.get_logger("rove.scaler")

T = TypeVar("T")

_WAKE_ON = (ev.ScalePlan, ev.JobEnded, ev.PlanApplied, ev.PlanFailed)


class Scaler(JobService):
    """Applies `job`'s plans through `backend` until the job ends or `stop()`."""

    def __init__(
        self,
        bus: Bus,
        job: str,
        backend: Backend,
        *,
        scaler_id: str,
        plan_deadline_s: float = 300.0,
        create_interval_s: float = 0.0,
        end_grace_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__(bus, job, name=f"scaler {scaler_id}", clock=clock)
        self.backend = backend
        self.scaler_id = scaler_id
        self.plan_deadline_s = plan_deadline_s
        self.create_interval_s = create_interval_s
        self.end_grace_s = end_grace_s
        self._reported: set[int] = set()
        self.log = log.bind(job=job, scaler=scaler_id, backend=backend.name)

    def on_event(self, rec: records.Recorded) -> None:
        if isinstance(rec.event, _WAKE_ON):
            self.wake()

    async def serve(self) -> None:
        self.log.info(
            "scaler is following the job",
            plans=self.state.scale.plans,
            pending=self.state.scale.pending or None,
        )
        ended_at: float | None = None
        while not self.stopping:
            plan = self.state.scale.pending_plan
            if plan is not None and plan.plan not in self._reported:
                await self._apply(plan)
            await self._report_ended()
            await self._report_pending()
            if self.state.phase.terminal:
                ended_at = ended_at or time.monotonic()
                if await self._all_stopped() or time.monotonic() - ended_at > self.end_grace_s:
                    await self._stop_leftovers()
                    self.log.info("job ended: scaler done", phase=self.state.phase.value)
                    return
            await self.doze(1.0 if self.state.phase.terminal else None)

    # ------------------------------------------------------------------ plans

    async def _apply(self, plan: ev.ScalePlan) -> None:
        workload = self.state.scale.workload
        assert workload is not None  # a plan exists only for a submitted job
        started = time.monotonic()
        deadline = started + self.plan_deadline_s
        created: list[str] = []
        removed: list[str] = []
        self.log.info(
            f"applying plan {plan.plan} ({plan.rule.value}): {plan.reason}",
            launch=[n.node for n in plan.launch] or None,
            remove=list(plan.remove) or None,
        )
        try:
            for i, spec in enumerate(plan.launch):
                if i and self.create_interval_s:
                    await self.sleep(self.create_interval_s)
                where = await self._call(
                    functools.partial(self.backend.launch, self.job, spec, workload, deadline),
                    f"start node {spec.node}",
                    deadline,
                )
                created.append(spec.node)
                self.log.info(
                    f"node {spec.node} started: {where}", resources=spec.resources.describe()
                )
            for node in plan.remove:
                await self._call(
                    functools.partial(self.backend.remove, self.job, node, deadline),
                    f"stop node {node}",
                    deadline,
                )
                removed.append(node)
                self.log.info(f"node {node} stopped")
        except (TemporaryError, PermanentError) as exc:
            retryable = isinstance(exc, TemporaryError)
            outcome: ev.PlanApplied | ev.PlanFailed = ev.PlanFailed(
                **self._envelope("plan_failed", plan.plan),
                plan=plan.plan,
                scaler=self.scaler_id,
                backend=self.backend.name,
                error=str(exc),
                retryable=retryable,
                created=tuple(created),
                removed=tuple(removed),
            )
            self.log.warning(f"plan {plan.plan} failed: {exc}", retryable=retryable)
        else:
            outcome = ev.PlanApplied(
                **self._envelope("plan_applied", plan.plan),
                plan=plan.plan,
                scaler=self.scaler_id,
                backend=self.backend.name,
                created=tuple(created),
                removed=tuple(removed),
                elapsed_s=round(time.monotonic() - started, 3),
            )
        self._reported.add(plan.plan)
        self.emit(outcome)

    async def _call(self, fn: Callable[[], Awaitable[T]], what: str, deadline: float) -> T:
        async def attempt(_timeout: float) -> T:
            return await fn()

        return await retry.call(
            attempt,
            what=what,
            deadline_s=max(0.1, deadline - time.monotonic()),
            wait_initial=0.5,
            wait_max=10.0,
            failed="not done",
            advice=f"the {self.backend.name} backend kept failing",
        )

    def _envelope(self, *id_parts: object) -> ev.Envelope:
        # The id names the plan, not this scaler: whoever reports it first, it is stored once.
        return ev.envelope(self.job, f"scaler:{self.scaler_id}", self.clock(), *id_parts)

    # ------------------------------------------------------------------ node ends

    async def _report_ended(self) -> None:
        try:
            ended = await self.backend.ended(self.job)
        except (TemporaryError, PermanentError) as exc:
            self.log.warning("cannot tell which nodes ended", error=str(exc))
            return
        for gone in ended:
            record = self.state.nodes.get(gone.node)
            slot = self.state.scale.current(gone.node)
            active = record is not None and record.status is NodeStatus.ACTIVE
            if self.state.phase.terminal or (not active and slot is None):
                continue
            if gone.node in self.state.scale.removing:
                continue  # stopped by a plan: its leaving is no news
            incarnation = record.incarnation if record is not None else ""
            self.log.info(f"node {gone.node} is gone: {gone.reason}")
            self.emit(
                ev.node_gone(
                    self.job,
                    gone.node,
                    reporter=self.scaler_id,
                    reason=gone.reason,
                    ts=self.clock(),
                    exit_code=gone.exit_code,
                    incarnation=incarnation,
                )
            )

    async def _report_pending(self) -> None:
        """Nodes the backend cannot place (`node_pending`), so the optimiser need not
        wait for its pending timeout to retry them smaller or go on without them."""
        if self.state.phase.terminal:
            return
        try:
            stuck = await self.backend.pending(self.job)
        except (TemporaryError, PermanentError) as exc:
            self.log.warning("cannot tell which nodes are pending", error=str(exc))
            return
        for item in stuck:
            slot = self.state.scale.current(item.node)
            if slot is None or slot.unplaceable:
                continue
            self.log.warning(f"node {item.node} cannot be placed: {item.reason}")
            self.emit(
                ev.NodePending(
                    **ev.envelope(
                        self.job,
                        f"scaler:{self.scaler_id}",
                        self.clock(),
                        "node_pending",
                        item.node,
                    ),
                    node=item.node,
                    scaler=self.scaler_id,
                    reason=item.reason,
                )
            )

    async def _all_stopped(self) -> bool:
        try:
            return not any(n.running for n in await self.backend.nodes(self.job))
        except (TemporaryError, PermanentError):
            return False

    async def _stop_leftovers(self) -> None:
        """After the job ended and its grace period: stop any node still running."""
        try:
            nodes = await self.backend.nodes(self.job)
        except (TemporaryError, PermanentError) as exc:
            self.log.warning("cannot list the job's nodes to stop them", error=str(exc))
            return
        for info in nodes:
            if info.running:
                self.log.warning(f"node {info.node} still runs after the job ended: stopping it")
                try:
                    await self.backend.remove(self.job, info.node, time.monotonic() + 30.0)
                except (TemporaryError, PermanentError) as exc:
                    self.log.warning(f"could not stop node {info.node}", error=str(exc))
