"""The master's folded view of one job.

A `JobState` is the result of `fold(evolve, events)` over the job's event
stream. It is immutable: `evolve` returns a new state that shares the parts it
did not change. Collections keyed by node (and, later, by shard) are
`immutables.Map`s, hash array mapped tries: updating one entry is O(log n)
instead of copying a dict, which keeps replay fast for large jobs. Snapshots
are this struct encoded with msgpack (maps as plain msgpack maps).
"""

from __future__ import annotations

import enum
import typing
from typing import Any

import immutables
import msgspec

from rove.control.catalogue.events import EventRejected, JobPhase, JobSpec
from rove.control.master.checkpoints import CkptState
from rove.control.master.data import DataState
from rove.control.master.rdzv_state import RdzvState
from rove.control.master.scaling import ScaleState

#: How many dead letters the state keeps for `rove status` (the count is unbounded).
RECENT_REJECTIONS = 20


class NodeStatus(enum.StrEnum):
    """Lifecycle of a node as the master sees it.

    ACTIVE -> LEFT (agent stopped on purpose) | LOST (heartbeats stopped).
    LEFT or LOST -> ACTIVE when the agent joins again (a new incarnation).
    """

    ACTIVE = "active"
    LEFT = "left"
    LOST = "lost"


class NodeRecord(msgspec.Struct, frozen=True, kw_only=True):
    node: str
    host: str
    pid: int
    incarnation: str
    status: NodeStatus
    joined_ts: float
    nproc_per_node: int = 1
    reason: str = ""
    #: the stream sequence of its `node_joined` (after the job ended: its first since,
    #: where the next run it starts begins)
    joined_seq: int = 0
    #: the newest step its workers reported (`training_progress`: the slowest local
    #: rank's), kept after it left: what `rove status` shows of an ended job's nodes
    step: int | None = None


class Counters(msgspec.Struct, frozen=True, kw_only=True):
    """Monotonic counts that later features extend (new fields need defaults)."""

    events: int = 0
    nodes_joined: int = 0
    nodes_left: int = 0
    nodes_lost: int = 0
    elections: int = 0
    rejected: int = 0
    stale_decisions: int = 0
    rounds: int = 0
    worker_failures: int = 0


class JobState(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the master knows about a job, rebuilt from its events.

    `applied_seq` is the stream sequence of the last event folded in; a
    snapshot resumes replay right after it. `elected_seq` is the stream
    sequence of the newest `master_elected` event: the fence a new leader must
    name when it publishes its own election.
    """

    job: str
    phase: JobPhase = JobPhase.PENDING
    spec: JobSpec | None = None
    leader: str = ""
    epoch: int = 0
    elected_seq: int = 0
    leader_since: float = 0.0
    nodes: immutables.Map[str, NodeRecord] = msgspec.field(default_factory=immutables.Map)
    stop_requested: str | None = None
    end_reason: str = ""
    counters: Counters = msgspec.field(default_factory=Counters)
    recent_rejections: tuple[EventRejected, ...] = ()
    rdzv: RdzvState = msgspec.field(default_factory=RdzvState)
    ckpt: CkptState = msgspec.field(default_factory=CkptState)
    data: DataState = msgspec.field(default_factory=DataState)
    scale: ScaleState = msgspec.field(default_factory=ScaleState)
    applied_seq: int = 0
    #: which run of the job this is (a node joining an ended job starts the next one)
    run: int = 1
    #: the stream sequence of the `job_ended` of this run (0 while it runs)
    ended_seq: int = 0
    #: the stream sequence of this run's `run_started` (0 for the first run)
    run_seq: int = 0
    #: when the newest decision folded was made (a master's clock; 0 before any)
    decided_at: float = 0.0
    #: node -> its earlier incarnations that were active when a newer one joined, and
    #: have not been told yet (`node_replaced`): another agent under the same node id,
    #: or one that restarted without leaving
    replaced: immutables.Map[str, tuple[str, ...]] = msgspec.field(default_factory=immutables.Map)


def initial(job: str) -> JobState:
    """The state of a job before any event."""
    return JobState(job=job)


def next_run(state: JobState, run: int, seq: int) -> JobState:
    """The state as run `run` starts at stream sequence `seq`: everything of the job's
    earlier runs is left behind but the leadership, which goes on, and the counts."""
    return JobState(
        job=state.job,
        leader=state.leader,
        epoch=state.epoch,
        elected_seq=state.elected_seq,
        leader_since=state.leader_since,
        counters=state.counters,
        applied_seq=seq,
        run=run,
        run_seq=seq,
        decided_at=state.decided_at,
    )


def active_nodes(state: JobState) -> list[NodeRecord]:
    return [n for n in state.nodes.values() if n.status is NodeStatus.ACTIVE]


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, immutables.Map):
        return dict(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(tp: Any, obj: Any) -> Any:
    if typing.get_origin(tp) is immutables.Map:
        key, value = typing.get_args(tp)
        return immutables.Map(
            msgspec.convert(obj, dict[key, value], strict=False, dec_hook=_dec_hook)  # type: ignore[valid-type]
        )
    raise NotImplementedError(f"cannot decode {tp}")


_state_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_state_decoder = msgspec.msgpack.Decoder(JobState, dec_hook=_dec_hook)


def encode_state(state: JobState) -> bytes:
    return _state_encoder.encode(state)


def decode_state(data: bytes | memoryview) -> JobState:
    """Raises msgspec.DecodeError / msgspec.ValidationError for bad bytes."""
    return _state_decoder.decode(data)
