"""JetStream stream names and subjects, built by functions only.

Call sites never paste subject strings together: they call these functions,
which also validate the names that become subject tokens.

    rove.ev.<job>.node.<node>        agent facts
    rove.ev.<job>.master             master decisions (no kind)
    rove.ev.<job>.master.<kind>      master decisions, one subject per kind
    rove.ev.<job>.master.<kind>.part.<i>  part i of a decision too large for one message
    rove.ev.<job>.data.<dataset>     shard requests / acknowledgements
    rove.ev.<job>.data.<dataset>.<client>   the master's refusals to one data client
    rove.ev.<job>.plan               scale plans
    rove.ev.<job>.scaler             plan outcomes
    rove.ev.<job>.cmd                operator commands
    rove.hb.<job>.<node>             heartbeats (stream ROVE_HB, last per subject kept)
    rove.ans.<job>.<dataset>.<client>  the master's leases to one data client (stream
                                     ROVE_ANSWERS, memory: rebuilt from the requests)
    rove.snap.<job>                  master snapshots (stream ROVE_SNAP, rollup)
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Callable
from typing import Any, Final

from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError, InvalidEventError

EVENTS_STREAM: Final = "ROVE_EVENTS"
HEARTBEAT_STREAM: Final = "ROVE_HB"
ANSWER_STREAM: Final = "ROVE_ANSWERS"
SNAPSHOT_STREAM: Final = "ROVE_SNAP"
LEASE_BUCKET: Final = "rove_leases"
SNAPSHOT_OBJECTS: Final = "rove_snapshots"

EVENTS_ROOT: Final = "rove.ev"
HEARTBEAT_ROOT: Final = "rove.hb"
ANSWER_ROOT: Final = "rove.ans"
SNAPSHOT_ROOT: Final = "rove.snap"

#: The stream every fenced master write is scoped to.
ELECTED_KIND: Final = "elected"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_NOT_IN_NAME = re.compile(r"[^A-Za-z0-9_-]+")


def cleaned(text: str) -> str:
    """`text` with anything a name cannot hold as `-`, and no leading `-` or `_` (may be
    empty; not checked for length)."""
    return _NOT_IN_NAME.sub("-", text).lstrip("-_")


def name_from(text: str) -> str:
    """A valid name for `text` (an id another tool chose, e.g. torchrun's `--rdzv-id`):
    `text` itself where it is one, else `cleaned(text)`, cut to fit, with a hash of the
    whole, so the same text always gives the same name (every node of a job derives it
    alike) and two texts share one only by a 1-in-16-million chance."""
    if _NAME.match(text):
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:6]
    stem = cleaned(text)[:57].rstrip("-_")
    return f"{stem}-{digest}" if stem else digest


@functools.lru_cache(maxsize=65536)
def check_name(what: str, value: str) -> str:
    """Return `value` if it can be a subject token and a KV key, else raise.

    Raises:
        ConfigError: with a message naming `what` and the allowed characters.
    """
    if not _NAME.match(value):
        raise ConfigError(
            f"invalid {what} name {value!r}: use 1-64 letters, digits, '-' or '_', "
            "starting with a letter or digit"
        )
    return value


def job_events(job: str) -> str:
    """Every event of `job` (the replay filter)."""
    return f"{EVENTS_ROOT}.{check_name('job', job)}.>"


def node_facts(job: str, node: str) -> str:
    return f"{EVENTS_ROOT}.{check_name('job', job)}.node.{check_name('node', node)}"


def master(job: str, kind: str | None = None) -> str:
    base = f"{EVENTS_ROOT}.{check_name('job', job)}.master"
    return base if kind is None else f"{base}.{kind}"


def master_elected(job: str) -> str:
    """The subject whose last sequence fences every master write."""
    return master(job, ELECTED_KIND)


def data(job: str, dataset: str) -> str:
    return f"{EVENTS_ROOT}.{check_name('job', job)}.data.{check_name('dataset', dataset)}"


def data_answer(job: str, dataset: str, client: str) -> str:
    """Where the master refuses one data client's requests (stored): only it listens."""
    return f"{data(job, dataset)}.{check_name('client', client)}"


def lease_answer(job: str, dataset: str, client: str) -> str:
    """Where the master leases shards to one data client (stream ROVE_ANSWERS)."""
    return (
        f"{ANSWER_ROOT}.{check_name('job', job)}.{check_name('dataset', dataset)}."
        f"{check_name('client', client)}"
    )


def plan(job: str) -> str:
    return f"{EVENTS_ROOT}.{check_name('job', job)}.plan"


def scaler(job: str) -> str:
    return f"{EVENTS_ROOT}.{check_name('job', job)}.scaler"


def cmd(job: str) -> str:
    return f"{EVENTS_ROOT}.{check_name('job', job)}.cmd"


def heartbeat(job: str, node: str) -> str:
    return f"{HEARTBEAT_ROOT}.{check_name('job', job)}.{check_name('node', node)}"


def job_heartbeats(job: str) -> str:
    return f"{HEARTBEAT_ROOT}.{check_name('job', job)}.*"


def snapshot(job: str) -> str:
    return f"{SNAPSHOT_ROOT}.{check_name('job', job)}"


def lease_key(job: str) -> str:
    return check_name("job", job)


#: Split kinds that are the scaler's facts: their parts go on the scaler's subjects.
_SCALER_KINDS = frozenset({"plan_applied", "plan_failed"})


def part(job: str, kind: str, index: int) -> str:
    """Part `index` of a split `kind` event: one subject per index, so a reader of
    the newest message per subject still gets every part of the newest whole; under
    its producer's subjects (the master's, or the scaler's for its facts)."""
    if kind in _SCALER_KINDS:
        return f"{scaler(job)}.{kind}.part.{index}"
    return f"{master(job, kind)}.part.{index}"


def _decision_subject(event: ev.Event) -> str:
    return master(event.job, ev.kind(event))


#: Subject of each event type (a dict lookup: this runs for every event replayed).
_SUBJECT_OF: dict[type[ev.Event], Callable[[Any], str]] = {
    ev.MasterElected: lambda e: master_elected(e.job),
    ev.EventPart: lambda e: part(e.job, e.kind, e.index),
    ev.Heartbeat: lambda e: heartbeat(e.job, e.node),
    ev.NodeJoined: lambda e: node_facts(e.job, e.node),
    ev.NodeLeft: lambda e: node_facts(e.job, e.node),
    ev.RdzvJoined: lambda e: node_facts(e.job, e.node),
    ev.WorkersStarted: lambda e: node_facts(e.job, e.node),
    ev.TaskRestarted: lambda e: node_facts(e.job, e.node),
    ev.NatsServerRestarted: lambda e: node_facts(e.job, e.node),
    ev.WorkerExited: lambda e: node_facts(e.job, e.node),
    ev.WorkersSucceeded: lambda e: node_facts(e.job, e.node),
    ev.TrainingProgress: lambda e: node_facts(e.job, e.node),
    ev.NetworkCheckReported: lambda e: node_facts(e.job, e.node),
    ev.CkptInMemory: lambda e: node_facts(e.job, e.node),
    ev.CkptPersisted: lambda e: node_facts(e.job, e.node),
    ev.CkptFailed: lambda e: node_facts(e.job, e.node),
    ev.CkptFound: lambda e: node_facts(e.job, e.node),
    ev.ReplicaStored: lambda e: node_facts(e.job, e.node),
    ev.StopRequested: lambda e: cmd(e.job),
    ev.JobSubmitted: lambda e: cmd(e.job),
    ev.ScaleRequested: lambda e: cmd(e.job),
    ev.ScalePlan: lambda e: plan(e.job),
    ev.PlanApplied: lambda e: scaler(e.job),
    ev.PlanFailed: lambda e: scaler(e.job),
    ev.NodeGone: lambda e: scaler(e.job),
    ev.NodePending: lambda e: scaler(e.job),
    ev.DatasetRegistered: lambda e: data(e.job, e.dataset),
    ev.StreamShardsAdded: lambda e: data(e.job, e.dataset),
    ev.StreamCheckpointed: lambda e: data(e.job, e.dataset),
    ev.RecordsUndecodable: lambda e: data(e.job, e.dataset),
    ev.ShardRequested: lambda e: data(e.job, e.dataset),
    ev.ShardDone: lambda e: data(e.job, e.dataset),
    ev.ShardLeased: lambda e: lease_answer(e.job, e.dataset, e.client),
    ev.DataRejected: lambda e: data_answer(e.job, e.dataset, e.client),
}


def subject_for(event: ev.Event) -> str:
    """The one subject on which `event` is published."""
    build = _SUBJECT_OF.get(type(event))
    if build is not None:
        return build(event)
    if isinstance(event, ev.Decision):
        return _decision_subject(event)
    raise TypeError(f"no subject is defined for event type {type(event).__name__}")


def check_subject(event: ev.Event, subject: str) -> None:
    """Refuse an event that arrived on a subject it does not belong to.

    This stops a producer from writing another job's or another node's facts,
    or dressing a fact up as a master decision.

    Raises:
        InvalidEventError: naming the expected and the actual subject.
    """
    try:
        expected = subject_for(event)
    except (TypeError, ConfigError) as exc:
        raise InvalidEventError(f"event of type {ev.kind(event)} is not valid here: {exc}") from exc
    if subject != expected:
        raise InvalidEventError(
            f"event {ev.kind(event)} (id {event.id}) arrived on {subject} but belongs on {expected}"
        )
