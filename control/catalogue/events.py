"""The event catalogue: every fact and every decision rove records.

Every event is a frozen, tagged `msgspec.Struct` carrying the job, a
deterministic id (sent as `Nats-Msg-Id`, so a retried publish is stored once),
its producer and the producer's wall-clock timestamp. Master decisions also
carry the master epoch that made them. One decoder reads the whole union;
msgpack is the wire format. Nothing is ever pickled.

Schema evolution (the rule every change to this file follows):

* a new field gets a default, so old payloads still decode;
* a field's type never changes, and a field is never renamed (a `StrEnum` may
  replace a `str` field whose values it lists: the bytes are the same);
* a tag is never reused: a changed meaning is a new class with a new tag;
* unknown fields are ignored, so an old reader accepts a newer writer's event;
  an unknown *tag* is rejected, so roll out readers before writers.

`tests/data/events_v1.msgpack` holds payloads written by the first version of
this catalogue; the test suite decodes them on every run.
"""

from __future__ import annotations

import enum
import typing
from typing import Final

import msgspec

# re-exported (`x as x`): callers import every event from here
from rove.control.catalogue.check_events import CheckGroup as CheckGroup
from rove.control.catalogue.check_events import NetworkCheckAssigned as NetworkCheckAssigned
from rove.control.catalogue.check_events import NetworkCheckCompleted as NetworkCheckCompleted
from rove.control.catalogue.check_events import NetworkCheckReported as NetworkCheckReported
from rove.control.catalogue.check_events import NodeCheck as NodeCheck
from rove.control.catalogue.ckpt_events import CkptCommitted as CkptCommitted
from rove.control.catalogue.ckpt_events import CkptFailed as CkptFailed
from rove.control.catalogue.ckpt_events import CkptFound as CkptFound
from rove.control.catalogue.ckpt_events import CkptInMemory as CkptInMemory
from rove.control.catalogue.ckpt_events import CkptPersisted as CkptPersisted
from rove.control.catalogue.ckpt_events import ReplicaRank as ReplicaRank
from rove.control.catalogue.ckpt_events import ReplicaStored as ReplicaStored
from rove.control.catalogue.data_events import DataPosition as DataPosition
from rove.control.catalogue.data_events import DataRejected as DataRejected
from rove.control.catalogue.data_events import DataRestored as DataRestored
from rove.control.catalogue.data_events import DatasetRegistered as DatasetRegistered
from rove.control.catalogue.data_events import DatasetSpec as DatasetSpec
from rove.control.catalogue.data_events import RequeueReason as RequeueReason
from rove.control.catalogue.data_events import ShardDone as ShardDone
from rove.control.catalogue.data_events import ShardLeased as ShardLeased
from rove.control.catalogue.data_events import ShardRef as ShardRef
from rove.control.catalogue.data_events import ShardRequested as ShardRequested
from rove.control.catalogue.data_events import ShardRequeued as ShardRequeued
from rove.control.catalogue.event_base import Decision as Decision
from rove.control.catalogue.event_base import DecisionEnvelope as DecisionEnvelope
from rove.control.catalogue.event_base import Envelope as Envelope
from rove.control.catalogue.event_base import Event as Event
from rove.control.catalogue.event_base import NodeEnvelope as NodeEnvelope
from rove.control.catalogue.event_base import NodeFact as NodeFact
from rove.control.catalogue.event_base import decision_envelope as decision_envelope
from rove.control.catalogue.event_base import envelope as envelope
from rove.control.catalogue.event_base import make_id as make_id
from rove.control.catalogue.event_base import node_envelope as node_envelope
from rove.control.catalogue.scale_events import GIB as GIB
from rove.control.catalogue.scale_events import NODE_REFUSED_EXIT as NODE_REFUSED_EXIT
from rove.control.catalogue.scale_events import PS_ROLE as PS_ROLE
from rove.control.catalogue.scale_events import JobSubmitted as JobSubmitted
from rove.control.catalogue.scale_events import NodeGone as NodeGone
from rove.control.catalogue.scale_events import NodeLaunch as NodeLaunch
from rove.control.catalogue.scale_events import NodePending as NodePending
from rove.control.catalogue.scale_events import PlanApplied as PlanApplied
from rove.control.catalogue.scale_events import PlanFailed as PlanFailed
from rove.control.catalogue.scale_events import PsNodes as PsNodes
from rove.control.catalogue.scale_events import Resources as Resources
from rove.control.catalogue.scale_events import ScalePlan as ScalePlan
from rove.control.catalogue.scale_events import ScalePolicy as ScalePolicy
from rove.control.catalogue.scale_events import ScaleRequested as ScaleRequested
from rove.control.catalogue.scale_events import ScaleRule as ScaleRule
from rove.control.catalogue.scale_events import Workload as Workload
from rove.control.catalogue.scale_events import node_argv as node_argv
from rove.control.catalogue.scale_events import node_gone as node_gone
from rove.control.catalogue.scale_events import node_name as node_name
from rove.control.catalogue.stream_events import RecordsUndecodable as RecordsUndecodable
from rove.control.catalogue.stream_events import StreamCheckpointed as StreamCheckpointed
from rove.control.catalogue.stream_events import StreamShard as StreamShard
from rove.control.catalogue.stream_events import StreamShardsAdded as StreamShardsAdded
from rove.control.catalogue.stream_events import Watermark as Watermark


class JobPhase(enum.StrEnum):
    """Lifecycle of a job.

    PENDING -> RUNNING (first node joined) -> one of FINISHED, FAILED, STOPPED.
    Terminal phases never change again.
    """

    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL: Final = frozenset({JobPhase.FINISHED, JobPhase.FAILED, JobPhase.STOPPED})


# --------------------------------------------------------------------------- values


class JobSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Job-level settings fixed by the first leader and folded into the state."""

    node_timeout_s: float = 30.0


class FailureKind(enum.StrEnum):
    """Why a worker process ended badly, as diagnosed by its agent.

    `user_error` and `oom` are the user's to fix (a repeat fails the job fast);
    `hardware` marks the node itself as faulty; the rest are worth a restart.
    """

    USER_ERROR = "user_error"
    OOM = "oom"
    KILLED = "killed"
    SEGFAULT = "segfault"
    COMMUNICATION = "communication"
    HANG = "hang"
    HARDWARE = "hardware"
    UNKNOWN = "unknown"


class RestoreSource(enum.StrEnum):
    """Where every rank of a round loads its checkpoint from ("" for a fresh start)."""

    NONE = ""
    MEMORY = "memory"
    #: some ranks from a peer's memory (`RoundCompleted.fetches`), the rest from their own
    PEER = "peer"
    STORAGE = "storage"


class RoundCause(enum.StrEnum):
    """Why the master formed a rendezvous round.

    FORMED: enough nodes gathered (the first round, or after the job waited);
    RESTART: the same members again after a worker failure (spends a restart);
    SCALE_UP: waiting nodes joined a running job; REFORMED: a member was lost,
    left or was excluded, and the round went on with the others, or a port a node
    offered was taken and the round started again on fresh ports (no restart spent).
    """

    FORMED = "formed"
    RESTART = "restart"
    SCALE_UP = "scale_up"
    REFORMED = "reformed"


class RdzvParams(msgspec.Struct, frozen=True, kw_only=True):
    """Rendezvous settings, from `rove run`'s flags; the first joiner's are the job's."""

    min_nodes: int = 1
    max_nodes: int = 1
    node_unit: int = 1
    max_restarts: int = 3
    last_call_s: float = 5.0
    below_min_wait_s: float = 300.0
    network_check: bool = False
    exclude_stragglers: bool = False
    network_check_timeout_s: float = 120.0
    #: a TensorFlow parameter-server job with this many parameter servers (0: torch)
    tf_ps: int = 0


class RoundMember(msgspec.Struct, frozen=True, kw_only=True):
    """One node's place in a rendezvous round: its group rank is its index."""

    node: str
    incarnation: str
    addr: str
    nproc: int
    first_rank: int
    replica_port: int = 0
    domain: str = ""


class TfTask(msgspec.Struct, frozen=True, array_like=True):
    """One task of a TensorFlow parameter-server round: rank `rank` runs task `index`
    of `role` (chief, ps or worker) on `node`, serving on `addr:port`."""

    role: str
    index: int
    rank: int
    node: str
    addr: str
    port: int


class RankStat(msgspec.Struct, frozen=True, kw_only=True):
    """One worker process's progress and resource use, inside a heartbeat."""

    rank: int
    local_rank: int
    pid: int
    step: int = 0
    samples_per_s: float = 0.0
    cpu_percent: float = 0.0
    rss_bytes: int = 0
    gpu_mem_bytes: int | None = None
    gpu_util_percent: float | None = None
    #: mean seconds per step the rank spent on its own work (`progress.report(busy_s=)`)
    busy_s: float | None = None


# --------------------------------------------------------------------------- agent facts


class NodeJoined(NodeFact, tag="node_joined", frozen=True, kw_only=True):
    """An agent started (or restarted: a new `incarnation`) on `node`."""

    host: str
    pid: int
    nproc_per_node: int = 1


class NodeLeft(NodeFact, tag="node_left", frozen=True, kw_only=True):
    """An agent stopped on purpose (SIGTERM, job done) and will not heartbeat again."""

    reason: str = ""


class Heartbeat(NodeFact, tag="heartbeat", frozen=True, kw_only=True):
    """Periodic liveness and metrics of one node and all its ranks (stream ROVE_HB)."""

    seq: int
    cpu_percent: float = 0.0
    mem_used_bytes: int = 0
    mem_total_bytes: int = 0
    ranks: tuple[RankStat, ...] = ()
    round: int = 0
    ports: tuple[int, ...] = ()
    #: what the node has: CPUs, its memory limit (or total), GPUs (pynvml)
    capacity: Resources | None = None


class RdzvJoined(NodeFact, tag="rdzv_joined", frozen=True, kw_only=True):
    """`node` wants a place in the next rendezvous round."""

    addr: str
    nproc_per_node: int
    ports: tuple[int, ...] = ()
    params: RdzvParams = msgspec.field(default_factory=RdzvParams)
    #: where this node's agent takes peer replicas of flash checkpoints (0: it takes none)
    replica_port: int = 0
    #: the node's failure domain (a host, a zone: `--failure-domain`): replicas go to
    #: peers of another one where there are
    domain: str = ""
    #: a TensorFlow job's node that hosts parameter servers only ("ps", `--tf-role ps`:
    #: a node sized for them); "": any role, in rank order
    tf_role: str = ""


class TaskRestarted(NodeFact, tag="task_restarted", frozen=True, kw_only=True):
    """A task of a TensorFlow round ended (`kind`, `reason`) and `node`'s agent started it
    again on the same address without a new round: the `restarts`-th time in `round`."""

    round: int
    rank: int
    role: str
    index: int
    kind: FailureKind
    reason: str
    exit_code: int | None = None
    restarts: int = 1


class NatsServerRestarted(NodeFact, tag="nats_server_restarted", frozen=True, kw_only=True):
    """The job's own NATS server (`rove run --standalone`: `node`'s launcher keeps it)
    ended unasked and was started again on its port and store. `ended` says how ("was
    killed by SIGKILL", "exited with status 1"), `pid_before` and `pid` are the two
    servers, `down_s` the seconds from finding it ended to its answering again. Its
    memory streams (heartbeats, leases) were made anew; the events stream is on disk."""

    pid_before: int = 0
    pid: int = 0
    ended: str = ""
    down_s: float = 0.0


class WorkersStarted(NodeFact, tag="workers_started", frozen=True, kw_only=True):
    """`node` started its worker processes for `round`."""

    round: int
    ranks: tuple[int, ...]
    pids: tuple[int, ...]


class WorkerExited(NodeFact, tag="worker_exited", frozen=True, kw_only=True):
    """A worker process of `round` ended with an error (diagnosed; log tail bounded)."""

    round: int
    rank: int
    local_rank: int
    kind: FailureKind
    reason: str
    exit_code: int | None = None
    signal: str | None = None
    log_tail: str = ""
    #: the port of `node` its round gave the worker that another process held, so it
    #: could not listen there (rank 0's store, a TensorFlow task's server): rove's pick
    #: failed, not the worker; the round starts again without spending a restart. 0: not so
    port_taken: int = 0


class TrainingProgress(NodeFact, tag="training_progress", frozen=True, kw_only=True):
    """How far `node`'s workers got in `round`: the slowest local rank's `step` and when
    the newest step ended (`at`); the round's first reported step and when it ended;
    the seconds so far (the most of any local rank) spent blocked in checkpoint saves,
    waiting for data, and restoring; the step the workers restored, when their
    checkpointer says it (`restored_step`: older than the round's `restore_step` when
    that step could not be read and they fell back together to an older one on
    storage). Sent every few seconds while steps advance and once when the round's
    workers end: `rove goodput` reads the job's time from these."""

    round: int
    step: int
    at: float
    first_step: int
    first_at: float
    ckpt_block_s: float = 0.0
    data_wait_s: float = 0.0
    restore_s: float = 0.0
    restored_step: int | None = None


class WorkersSucceeded(NodeFact, tag="workers_succeeded", frozen=True, kw_only=True):
    """Every worker of `node` in `round` finished its script: each exited with code 0,
    or was ended by the agent once its work was done, stuck on its way out (`note`
    says which and where)."""

    round: int
    note: str = ""


# --------------------------------------------------------------------------- operator commands


class StopRequested(Event, tag="stop_requested", frozen=True, kw_only=True):
    """An operator asked the job to stop (`rove stop`)."""

    reason: str = ""


# --------------------------------------------------------------------------- master decisions


class MasterElected(Decision, tag="master_elected", frozen=True, kw_only=True):
    """`master` holds the job's leader lease; `epoch` is the lease revision."""

    master: str


class JobConfigured(Decision, tag="job_configured", frozen=True, kw_only=True):
    """The job's settings, fixed by its first leader."""

    spec: JobSpec


class NodeLost(Decision, tag="node_lost", frozen=True, kw_only=True):
    """`node` sent no heartbeat for longer than the job's node timeout."""

    node: str
    incarnation: str
    last_seen: float
    timeout_s: float


class RestoreFetch(msgspec.Struct, frozen=True, array_like=True):
    """Rank `rank` of the round's restore step is fetched from `node`'s agent, which holds
    it of `source` (a peer replica; `source == node`: in its own memory)."""

    rank: int
    node: str
    source: str


class RoundCompleted(Decision, tag="round_completed", frozen=True, kw_only=True):
    """A rendezvous round: these members, in rank order, start their workers now."""

    round: int
    members: tuple[RoundMember, ...]
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    reason: str = ""
    restore_step: int | None = None
    restore_source: RestoreSource = RestoreSource.NONE
    #: with `restore_source` peer: the ranks whose runner does not hold the step, and
    #: where each is fetched from before the workers start
    fetches: tuple[RestoreFetch, ...] = ()
    cause: RoundCause = RoundCause.FORMED
    #: a TensorFlow round's tasks, by rank: roles and addresses (empty for torch)
    tasks: tuple[TfTask, ...] = ()
    #: on the wire only: the members travelled in this many `event_part`s before it
    #: (`rove.control.catalogue.parts`); readers see the whole round
    parts: int = 0


class EventPart(Decision, tag="event_part", frozen=True, kw_only=True):
    """Part `index` of the items of the decision `whole` (its id, a `kind` event that
    follows its parts), split because the whole would not fit one message; readers
    put them back together (`rove.control.catalogue.parts`)."""

    whole: str
    kind: str
    index: int
    #: the msgpack array of this part's items
    items: msgspec.Raw
    #: the field of the whole they belong to ("": the kind's first split field)
    field: str = ""


class NodeExcluded(Decision, tag="node_excluded", frozen=True, kw_only=True):
    """`node` is taken out of the job (faulty hardware, failed checks)."""

    node: str
    incarnation: str
    reason: str

    @property
    def ending(self) -> str:
        """Why the excluded agent ends, in its words."""
        return f"node {self.node} was excluded: {self.reason}"


class NodeReplaced(Decision, tag="node_replaced", frozen=True, kw_only=True):
    """Another agent (`by_incarnation`, process `by_pid` on `by_host`) joined as `node`
    while `incarnation` was in the job: the newest agent of a node takes its place, and
    the older one, if it still runs, leaves. So two agents that share a node id (two
    `rove run` on one machine without `--node-id`, machines with the same host name)
    are told so, where they would wait for each other without end."""

    node: str
    incarnation: str
    by_incarnation: str
    by_host: str
    by_pid: int

    @property
    def ending(self) -> str:
        """Why the replaced agent ends, in its words."""
        return (
            f"another agent joined job {self.job} as node {self.node} (pid {self.by_pid} on "
            f"{self.by_host}), so this one leaves. Several `rove run` of one job, on one "
            "machine or on machines with the same host name, need their own --node-id"
        )


class JobEnded(Decision, tag="job_ended", frozen=True, kw_only=True):
    """The job reached a terminal phase."""

    phase: JobPhase
    reason: str = ""


class RunStarted(Decision, tag="run_started", frozen=True, kw_only=True):
    """The job had ended and `node` joined it again (`rove run` under an ended job's
    name, as torchrun reruns an `--rdzv-id`): run number `run` of the job starts from
    scratch. What came before it belongs to the earlier runs (`rove events --run N`):
    the run begins at `since`, the stream sequence of `node`'s join; what the earlier
    run's nodes said after its end (their leaving) is the earlier run's. (`since` 0, in
    events recorded before it was: the run begins right after the end before it.)"""

    run: int
    node: str
    since: int = 0


class EventRejected(Decision, tag="event_rejected", frozen=True, kw_only=True):
    """Dead letter: payloads that failed to decode or validate, recorded and skipped:
    `count` of them on `subject`, from stream sequence `stream_seq` to `last_seq`
    (a burst is one dead letter); `error`, `payload_size` and `payload_head` are the
    first one's."""

    stream: str
    stream_seq: int
    subject: str
    error: str
    payload_size: int
    payload_head: bytes = b""
    count: int = 1
    last_seq: int = 0

    @property
    def upto(self) -> int:
        """The newest stream sequence this dead letter covers."""
        return max(self.stream_seq, self.last_seq)


AnyEvent = (
    DatasetRegistered
    | ShardRequested
    | ShardDone
    | ShardLeased
    | ShardRequeued
    | DataRestored
    | DataRejected
    | NodeJoined
    | NodeLeft
    | Heartbeat
    | RdzvJoined
    | WorkersStarted
    | WorkerExited
    | WorkersSucceeded
    | RoundCompleted
    | NodeExcluded
    | NodeReplaced
    | CkptCommitted
    | CkptFailed
    | CkptPersisted
    | CkptInMemory
    | CkptFound
    | ReplicaStored
    | NetworkCheckCompleted
    | NetworkCheckAssigned
    | EventPart
    | NetworkCheckReported
    | StopRequested
    | MasterElected
    | JobConfigured
    | NodeLost
    | JobEnded
    | RunStarted
    | EventRejected
    | JobSubmitted
    | ScaleRequested
    | ScalePlan
    | PlanApplied
    | PlanFailed
    | NodeGone
    | NodePending
    | StreamShardsAdded
    | StreamCheckpointed
    | TaskRestarted
    | RecordsUndecodable
    | TrainingProgress
    | NatsServerRestarted
)

#: How much of a rejected payload a dead letter keeps (bounded: garbage can be huge).
PAYLOAD_HEAD_BYTES: Final = 256
#: How much of a worker's log a `worker_exited` event carries.
LOG_TAIL_BYTES: Final = 4096
#: How long a failure reason may be.
REASON_CHARS: Final = 500

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    """msgpack bytes of `event`, as published on the bus."""
    return _encoder.encode(event)


def decode(data: bytes) -> AnyEvent:
    """Decode one event.

    Raises:
        msgspec.DecodeError: the bytes are not msgpack.
        msgspec.ValidationError: msgpack, but not an event of this catalogue
            (unknown tag, missing field, wrong type), with the path in the message.
    """
    event: AnyEvent = _decoder.decode(data)
    return event


def kind(event: Event | type[Event]) -> str:
    """The event's tag, e.g. ``node_joined``."""
    tag = event.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


#: Every event type of the catalogue by its tag, from the union (one list to keep).
EVENT_TYPES: Final[dict[str, type[Event]]] = {kind(cls): cls for cls in typing.get_args(AnyEvent)}
