"""How a round's workers ended, as this node's facts and metrics, and the lines a job
ends with on the console.

The agent decides what happened (its actor); this says it: every worker finished
(`workers_succeeded`, with a note when one was ended stuck on its way out), one failed
(`worker_exited`, diagnosed, with its log tail), one hung (`worker_exited`, kind
`hang`), or a task was restarted in place (`task_restarted`, TensorFlow). At the job's
end `rove run` says the root cause of a failure (`summary`) and the job's goodput
(`goodput_line`).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import structlog

from rove.agent import ports
from rove.agent.diagnosis import port_in_use, signal_name
from rove.agent.facts import NodeFacts
from rove.agent.runtime import RootFailure, TaskRestart
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.domain import goodput
from rove.control.errors import RoveError, plain
from rove.control.history import runs
from rove.control.master.runner import SupervisedMaster
from rove.control.master.state import JobState
from rove.control.process import metrics

log = structlog.get_logger("rove.run")

#: How long the end of a job may wait for its events to say its goodput.
GOODPUT_READ_S = 5.0
#: How long a standalone job stopped by a signal waits for its master to end it.
STOP_WAIT_S = 10.0


def summary(node: str, rank: int, root: RootFailure) -> list[str]:
    """The lines a failed job ends with on the console of the node where a worker failed,
    as torchrun's root-cause table: who, how it ended, what it raised, where, and where
    its whole output is."""
    sig = signal_name(root.exit_code)
    how = f"killed by {sig}" if sig else f"exit code {root.exit_code}"
    lines = [
        f"root cause: rank {rank} (local rank {root.local_rank}, pid {root.pid}) "
        f"on node {node}, {how}",
        f"  {root.diagnosis.said}",
    ]
    if root.where:
        lines.append(f"  at {root.where}")
    if root.log_path:
        lines.append(f"  its output: {root.log_path}")
    return lines


def store_port_taken(r: ev.RoundCompleted | None, rank: int, root: RootFailure, addr: str) -> int:
    """The port of round `r`'s rendezvous store (`MASTER_PORT`, which rank 0 listens on)
    when rank 0 failed because another process holds it, else what the runtime found
    taken (`root.port_taken`: a TensorFlow task's), else 0."""
    if root.port_taken or r is None or rank != 0 or r.tasks:
        return root.port_taken
    if root.diagnosis.kind is not ev.FailureKind.COMMUNICATION:
        return 0
    port = port_in_use(root.log_tail)  # torch: "port: 29500, ..., name: EADDRINUSE"
    return r.master_port if port == r.master_port and ports.taken(port, addr) else 0


class Endings:
    def __init__(self, facts: NodeFacts) -> None:
        self.facts = facts

    def succeeded(self, round_: int, notes: list[str]) -> None:
        self.facts.emit(
            ev.WorkersSucceeded(**self.facts.envelope(), round=round_, note="; ".join(notes))
        )

    def failed(self, round_: int, rank: int, root: RootFailure, port_taken: int = 0) -> None:
        self._count(root.diagnosis.kind)
        self.facts.emit(
            ev.WorkerExited(
                **self.facts.envelope(),
                round=round_,
                rank=rank,
                local_rank=root.local_rank,
                kind=root.diagnosis.kind,
                reason=root.diagnosis.reason,
                exit_code=root.exit_code,
                signal=signal_name(root.exit_code),
                log_tail=root.log_tail[-ev.LOG_TAIL_BYTES :],
                port_taken=port_taken,
            )
        )

    def hung(self, round_: int, rank: int, local_rank: int, reason: str) -> None:
        self._count(ev.FailureKind.HANG)
        self.facts.emit(
            ev.WorkerExited(
                **self.facts.envelope(),
                round=round_,
                rank=rank,
                local_rank=local_rank,
                kind=ev.FailureKind.HANG,
                reason=reason[: ev.REASON_CHARS],
            )
        )

    def task_restarted(self, round_: int, rank: int, t: TaskRestart) -> None:
        self._count(t.diagnosis.kind)
        self.facts.emit(
            ev.TaskRestarted(
                **self.facts.envelope(),
                round=round_,
                rank=rank,
                role=t.role,
                index=t.index,
                kind=t.diagnosis.kind,
                reason=t.diagnosis.reason,
                exit_code=t.exit_code,
                restarts=t.restarts,
            )
        )

    def _count(self, kind: ev.FailureKind) -> None:
        metrics.NODE_WORKER_FAILURES.labels(self.facts.job, kind.value).inc()


async def goodput_line(bus: Bus, job: str) -> str | None:
    """The job's goodput in one line, from its events, for the console at its end (`rove
    goodput` tells the rest); None when its events could not be read in time."""
    try:
        folded = await asyncio.wait_for(runs.ledger(bus, job), GOODPUT_READ_S)
    except (TimeoutError, RoveError) as exc:
        log.info("could not read the job's events for its goodput", error=plain(exc))
        return None
    if not folded.steps_reported:
        return goodput.NOT_KNOWN
    report = goodput.report(folded, time.time())
    worst = max(report.badput().items(), key=lambda kv: kv[1], default=None)
    rest = (
        f"; most of the rest went to {worst[0].value} ({worst[1]:.1f}s)"
        if worst is not None and worst[1] >= 0.05
        else ""
    )
    trained = report.seconds.get(goodput.Bucket.PRODUCTIVE, 0.0)
    return (
        f"goodput {100 * report.goodput:.1f}%: {trained:.1f}s of {report.total_s:.1f}s "
        f"trained the model it ends with{rest}"
    )


async def stopped(
    bus: Bus, job: str, node: str, master: SupervisedMaster, signum: int
) -> tuple[str, JobState | None]:
    """A standalone job's one node left on `signum` (Ctrl-C, `timeout`'s SIGTERM): no
    other node can go on with it, so its master in this process ends it, `stopped`, as
    `rove stop` would. Without this the stored job stayed `running` for good (`rove
    status`: "the job fails unless nodes join", with no master left to decide it), and
    a rerun under its name joined the old run. Returns the sentence of its end (the
    master's reason names the step left durable) and the master's state as it ended
    the job, or, if the master could not end it in `STOP_WAIT_S`, why not and None."""
    name = signal.Signals(signum).name
    try:
        await bus.publish(
            ev.StopRequested(
                **ev.envelope(job, f"launcher:{node}", time.time(), "stop", uuid.uuid4().hex),
                reason=f"rove run received {name}",
            ),
            deadline_s=STOP_WAIT_S,
        )
    except RoveError as exc:
        return f"agent received {name}; the job's stop could not be recorded: {plain(exc)}", None
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        runner = master.runner
        if runner is not None and runner.state.phase.terminal:
            state = runner.state
            return f"job {job} {state.phase.value}: {state.end_reason}", state
        await asyncio.sleep(0.05)
    return (
        f"agent received {name}; its master did not end the job within {STOP_WAIT_S:.0f}s "
        "(rove status tells where it stands)"
    ), None
