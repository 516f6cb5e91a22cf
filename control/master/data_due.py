"""What the data fold's state asks the leader to say (pure): grants to announce (again,
or as lapsed once their leases expired unconfirmed), a dataset's rollback, expired or
orphaned leases to requeue, and refusals. `decide` wraps them into decisions."""

from __future__ import annotations

import hashlib

import msgspec

from rove.control.catalogue import events as ev
from rove.control.master.data import PARK_S, Dataset, DataState, Grant, Lease, Parked, Rejection
from rove.control.master.skew import ON_TIME, ClockOff, ours


class Announce(msgspec.Struct, frozen=True, kw_only=True):
    """Announce `grant`, an allocation the fold already made, to its client; `unparked`:
    the empty answer to a request parked for `PARK_S`."""

    dataset: str
    grant: Grant
    unparked: bool = False
    lapsed: bool = False


class AnnounceRestore(msgspec.Struct, frozen=True, kw_only=True):
    """`dataset` was rolled back to the lineage of `round` (restored from `step`)."""

    dataset: str
    round: int
    step: int | None
    done_shards: int
    partial_shards: int


class Requeue(msgspec.Struct, frozen=True, kw_only=True):
    """Give `shards` leased to `client` back to todo; `digest` names these very leases."""

    dataset: str
    client: str
    reason: ev.RequeueReason
    shards: tuple[ev.ShardRef, ...]
    digest: str


class Reject(msgspec.Struct, frozen=True, kw_only=True):
    """Tell a client its request or acknowledgement was refused, and why."""

    rejection: Rejection


DataIntent = Announce | AnnounceRestore | Requeue | Reject


def due(
    d: DataState,
    current_round: int,
    lost_nodes: frozenset[str],
    now: float,
    clock_off: ClockOff = ON_TIME,
    left_nodes: frozenset[str] = frozenset(),
) -> list[DataIntent]:
    """What to announce now, for `decide` to wrap into decisions. A lease's deadline, a
    grant's and a parked request's time are the requesting node's stamps: read on the
    leader's clock (`clock_off`, `skew`). The leases of `lost_nodes` and `left_nodes`
    go back to todo (each with its reason)."""
    out: list[DataIntent] = [Reject(rejection=r) for r in d.rejections]
    for ds in d.datasets.values():
        if ds.announce_restore:
            out.append(
                AnnounceRestore(
                    dataset=ds.name,
                    round=ds.round,
                    step=ds.step,
                    done_shards=ds.restored_done,
                    partial_shards=ds.restored_partial,
                )
            )
        out.extend(_announcements(ds, now, clock_off))
        out.extend(
            Announce(dataset=ds.name, grant=_empty(w, ds.spec.lease_s, now), unparked=True)
            for w in ds.parked.values()
            if now - ours(clock_off, w.node, w.since) >= PARK_S
        )
        out.extend(_requeues(ds, current_round, lost_nodes, left_nodes, now, clock_off))
    return out


def _announcements(ds: Dataset, now: float, clock_off: ClockOff) -> list[Announce]:
    """The grants of `ds` no client confirmed yet. One whose leases expired first (its
    request was folded late, after an outage; or no master announced it in time) is
    announced as lapsed, with no shards, for one more `lease_s`: a live client asks at
    least every `lease_s / 3` and confirms it; one that never does is gone."""
    out = []
    for g in ds.grants.values():
        deadline = ours(clock_off, g.node, g.deadline)
        if deadline >= now:
            out.append(Announce(dataset=ds.name, grant=g))
        elif now - deadline <= ds.spec.lease_s:
            void = Grant(g.client, g.request, g.node, g.rank, (), g.deadline, False)
            out.append(Announce(dataset=ds.name, grant=void, lapsed=True))
    return out


def _empty(want: Parked, lease_s: float, now: float) -> Grant:
    return Grant(want.client, want.request, want.node, want.rank, (), now + lease_s, False)


def _requeues(
    ds: Dataset,
    current_round: int,
    lost_nodes: frozenset[str],
    left_nodes: frozenset[str],
    now: float,
    clock_off: ClockOff,
) -> list[Requeue]:
    groups: dict[tuple[str, ev.RequeueReason], list[tuple[int, Lease]]] = {}
    # a lease expired once its deadline, on the leader's clock, has passed; none that
    # has is later than `bound` (a node ahead stamps deadlines later than they are), so
    # the leases of a job whose clocks agree cost what they did
    bound = now - min(0.0, *clock_off.values()) if clock_off else now
    for key, lease in ds.leases.items():
        if lease.node in lost_nodes:
            reason = ev.RequeueReason.NODE_LOST
        elif lease.node in left_nodes:
            reason = ev.RequeueReason.NODE_LEFT
        elif 0 < lease.round < current_round:
            reason = ev.RequeueReason.ROUND_RESTARTED
        elif lease.deadline < bound and (
            not clock_off or lease.deadline + clock_off.get(lease.node, 0.0) < now
        ):
            reason = ev.RequeueReason.LEASE_EXPIRED
        else:
            continue
        groups.setdefault((lease.client, reason), []).append((key, lease))
    out = []
    for (client, reason), leases in sorted(groups.items()):
        leases.sort(key=lambda kl: kl[0])
        # the id names these very leases (a shard leased again later is a new requeue)
        text = ",".join(f"{k}/{lease.offset}/{lease.deadline}" for k, lease in leases)
        digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
        refs = tuple(ev.ShardRef(k, lease.offset) for k, lease in leases)
        out.append(
            Requeue(dataset=ds.name, client=client, reason=reason, shards=refs, digest=digest)
        )
    return out
