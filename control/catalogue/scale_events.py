"""The scaling part of the event catalogue: submitted workloads, scale plans, outcomes.

A *managed* job is one whose workload was submitted (`job_submitted`): the
master plans its nodes (`scale_plan`, a fenced decision) and a scaler applies
each plan through a backend, reporting `plan_applied` or `plan_failed`. Node
names are deterministic per slot and attempt (`node_name`), so a plan applied
twice (a replay, a restarted scaler) creates nothing twice.

`rove.control.catalogue.events` re-exports everything here; import from there.
"""

from __future__ import annotations

import enum

import msgspec

from rove.control.catalogue.event_base import Decision, Event, make_id

GIB = 1 << 30


class Resources(msgspec.Struct, frozen=True, kw_only=True):
    """What a node gets (in a plan) or has (in a heartbeat); 0 means not set / no limit."""

    cpu: float = 0.0
    memory_bytes: int = 0
    gpus: int = 0

    def describe(self) -> str:
        parts = []
        if self.cpu:
            parts.append(f"{self.cpu:g} CPU")
        if self.memory_bytes:
            parts.append(f"{self.memory_bytes / GIB:.3g} GiB")
        if self.gpus:
            parts.append(f"{self.gpus} GPU")
        return ", ".join(parts) or "no limits"


class ScalePolicy(msgspec.Struct, frozen=True, kw_only=True):
    """The optimiser's thresholds (`docs/scaling.md` explains each; defaults shown)."""

    #: OOM: the relaunched node gets memory x this ...
    oom_memory_factor: float = 2.0
    #: ... but at most this much more per relaunch (DLRover: +8 GiB) ...
    oom_max_step_bytes: int = 8 * GIB
    #: ... and never more than this in total: an OOM at the cap fails the job.
    max_memory_bytes: int = 64 * GIB
    #: Replace a node that was lost, left unasked, or was excluded as faulty.
    replace_failed: bool = True
    #: Replace a node whose workers' busy time per step is this many times the median.
    straggler_factor: float = 2.0
    #: Grow by one node while the last added node brings at least this share of a
    #: node's speed (DLRover stops below 0.2); shrink back when it does not.
    min_marginal_speed: float = 0.2
    #: Grow and judge only after a round has run this long (warm-up excluded).
    settle_s: float = 20.0
    #: A launched node that has not joined after this long is retried smaller.
    pending_timeout_s: float = 120.0
    #: Fewest seconds between two plans (a failing plan backs off: x2 per failure).
    plan_interval_s: float = 2.0
    #: Most plans a job may make; then it stops planning and says so.
    max_plans: int = 100
    #: Consecutive failed plans after which the job fails.
    max_failed_plans: int = 5
    #: Most attempts per slot (relaunches of one node).
    max_attempts: int = 5
    #: Grow with throughput (on by default when --nnodes MIN < MAX).
    auto_grow: bool = True


class PsNodes(msgspec.Struct, frozen=True, kw_only=True):
    """A TensorFlow job's parameter servers on nodes of their own, one per node
    (`rove run --tf-role ps`), sized `resources`; `argv` is what such a node runs."""

    count: int
    resources: Resources
    argv: tuple[str, ...]


#: The role of a node that hosts a parameter server (`NodeLaunch.role`).
PS_ROLE = "ps"


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    """What runs on every node of a managed job.

    `argv`: the `rove run` arguments every node gets (flags, script and its
    arguments), without the node's own (`--node-id`, `--nats`, `--job`).
    `ps`: a TensorFlow job's parameter servers on nodes of their own (counted in
    `min_nodes` and `max_nodes`), else None.
    """

    argv: tuple[str, ...]
    cwd: str
    min_nodes: int
    max_nodes: int
    nproc_per_node: int = 1
    resources: Resources = msgspec.field(default_factory=Resources)
    policy: ScalePolicy = msgspec.field(default_factory=ScalePolicy)
    ps: PsNodes | None = None


class ScaleRule(enum.StrEnum):
    """Which optimiser rule made a plan."""

    INITIAL = "initial"
    REPLACE = "replace"
    OOM = "oom"
    STRAGGLER = "straggler"
    PENDING = "pending"
    GROW = "grow"
    SHRINK = "shrink"
    #: an operator's new node bounds (`scale_requested`)
    RESIZE = "resize"


class NodeLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """One node a plan starts: slot `slot`, attempt `attempt`, named `node_name(...)`.

    `replaces`: the node (an earlier attempt of the slot) it takes over from.
    """

    node: str
    slot: int
    attempt: int
    resources: Resources
    replaces: str = ""
    #: "ps": a node of a TensorFlow job's parameter servers (`Workload.ps`)
    role: str = ""


def node_argv(w: Workload, launch: NodeLaunch) -> tuple[str, ...]:
    """The `rove run` arguments of the node `launch` starts (its role's)."""
    return w.ps.argv if launch.role == PS_ROLE and w.ps is not None else w.argv


def node_name(slot: int, attempt: int) -> str:
    """The deterministic name of a managed node: `n<slot>-a<attempt>`."""
    return f"n{slot}-a{attempt}"


class JobSubmitted(Event, tag="job_submitted", frozen=True, kw_only=True):
    """An operator (`rove submit`, `rove run --auto-scale`) asks rove to run and scale
    `workload`; the first submission of a job is the one that counts."""

    workload: Workload


class ScaleRequested(Event, tag="scale_requested", frozen=True, kw_only=True):
    """An operator set the job's node bounds (`rove scale`, a RoveJob's `nnodes`): its
    rounds take `min_nodes` to `max_nodes` nodes from now on, and a managed job's master
    plans toward them (nodes started up to the minimum, removed down to the maximum)."""

    min_nodes: int
    max_nodes: int
    reason: str = ""


class ScalePlan(Decision, tag="scale_plan", frozen=True, kw_only=True):
    """Plan number `plan` of the job: start `launch`, stop `remove`.

    A relaunch (OOM, replacement) is a `launch` whose `replaces` names the old
    node, which is in `remove` when it still runs. `cause` is the id of the
    event that led to it (never two plans for one cause); `speed` is the job's
    samples/s when it was made (a grow plan's baseline).
    """

    plan: int
    rule: ScaleRule
    reason: str
    cause: str
    launch: tuple[NodeLaunch, ...] = ()
    remove: tuple[str, ...] = ()
    target: int = 0
    speed: float = 0.0
    #: on the wire only: `launch` and `remove` travelled in this many `event_part`s
    #: before it (`rove.control.catalogue.parts`); readers see the whole plan
    parts: int = 0


class PlanApplied(Event, tag="plan_applied", frozen=True, kw_only=True):
    """The scaler applied plan `plan`: `created` nodes started (or found already
    there), `removed` stopped (or already gone)."""

    plan: int
    scaler: str
    backend: str
    created: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    elapsed_s: float = 0.0
    #: on the wire only: the node lists travelled in this many `event_part`s before it
    parts: int = 0


class PlanFailed(Event, tag="plan_failed", frozen=True, kw_only=True):
    """The scaler could not apply plan `plan` within its deadline; `created` and
    `removed` say what it did before failing; `retryable`: a later plan may succeed."""

    plan: int
    scaler: str
    backend: str
    error: str
    retryable: bool = True
    created: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    #: on the wire only: the node lists travelled in this many `event_part`s before it
    parts: int = 0


#: `rove run`'s exit code when it refuses to start (`rove.control.flags.options.EXIT_USAGE`).
NODE_REFUSED_EXIT = 2


class NodeGone(Event, tag="node_gone", frozen=True, kw_only=True):
    """The scaler saw the process (or pod) of `node` end: the master takes it as lost
    at once instead of waiting for its heartbeats to time out. `incarnation` is the
    agent's, as the scaler last knew it ("" if it never joined). `exit_code`
    `NODE_REFUSED_EXIT` is `rove run` refusing its arguments or configuration (another
    job writes the checkpoint location, a bad flag): the slot is not launched again,
    every attempt would be refused alike."""

    node: str
    incarnation: str = ""
    scaler: str
    reason: str
    exit_code: int | None = None


class NodePending(Event, tag="node_pending", frozen=True, kw_only=True):
    """The scaler's backend cannot place `node` (e.g. a pod the Kubernetes scheduler
    finds no room for, `reason` quoting it): the master's optimiser need not wait for
    its pending timeout to retry the node smaller or go on without it."""

    node: str
    scaler: str
    reason: str


def node_gone(
    job: str,
    node: str,
    *,
    reporter: str,
    reason: str,
    ts: float,
    exit_code: int | None = None,
    incarnation: str = "",
) -> NodeGone:
    """The `node_gone` fact `reporter` (a scaler, or `pool:<agent>`) publishes for `node`."""
    return NodeGone(
        job=job,
        id=make_id(job, "node_gone", node, incarnation),
        producer=f"scaler:{reporter}",
        ts=ts,
        node=node,
        incarnation=incarnation,
        scaler=reporter,
        reason=reason,
        exit_code=exit_code,
    )
