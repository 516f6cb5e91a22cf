"""The pre-training network check (pure: no clock, no I/O).

With `--network-check`, the first training round waits for two check rounds:

* round 0 pairs the nodes in arrival order ({0,1}, {2,3}, ...; an odd node
  out joins the last pair, a single node checks alone);
* round 1 pairs the slowest of round 0 with the fastest, so a slow or broken
  link is told apart from a slow or broken node.

Each group times a matmul and an allreduce (`rove.agent.netcheck`), each node
bounding its own check by the timeout (its start, not part of the timeout, by
`startup_s`). A node that is gone, or has not reported within `backstop_s`,
counts as failed. A node that failed both
rounds is **faulty** and is excluded, unless no node passed a round (then nothing
tells it from its peers: none is excluded, and training says what fails); a node
whose best time is more than twice the median is a **straggler**, excluded with
`--exclude-straggler`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev

CHECK_ROUNDS = 2
STRAGGLER_FACTOR = 2.0


def startup_s(timeout_s: float) -> float:
    """How long a node may take to start its check process and meet its group.

    Not part of the check's timeout: starting Python and importing torch takes
    seconds, many more on a busy machine, and says nothing about the network.
    """
    return max(120.0, timeout_s)


def backstop_s(timeout_s: float) -> float:
    """How long the master waits for a node's report before counting it failed.

    Every live agent reports (its check process bounds itself by `startup_s`
    plus the timeout); this only covers an agent that died without being
    declared lost yet.
    """
    return startup_s(timeout_s) + timeout_s + 30.0


class CheckState(msgspec.Struct, frozen=True, kw_only=True):
    check_round: int = -1
    groups: tuple[ev.CheckGroup, ...] = ()
    assigned_at: float = 0.0
    timeout_s: float = 120.0
    #: this round's results: node -> elapsed seconds, or None when it failed
    reports: immutables.Map[str, float | None] = msgspec.field(default_factory=immutables.Map)
    #: earlier rounds' results per node
    history: immutables.Map[str, tuple[float | None, ...]] = msgspec.field(
        default_factory=immutables.Map
    )
    done: bool = False
    faulty: tuple[str, ...] = ()
    stragglers: tuple[str, ...] = ()
    results: tuple[ev.NodeCheck, ...] = ()

    def nodes(self) -> list[str]:
        return [n for g in self.groups for n in g.nodes]


def _closed(c: CheckState) -> immutables.Map[str, tuple[float | None, ...]]:
    """History including the current round (nodes that did not report failed)."""
    history = c.history
    for node in c.nodes():
        history = history.set(node, (*history.get(node, ()), c.reports.get(node)))
    return history


# --------------------------------------------------------------------------- fold


def on_assigned(c: CheckState, e: ev.NetworkCheckAssigned) -> CheckState:
    if e.check_round <= c.check_round or c.done:
        return c
    history = _closed(c) if c.check_round >= 0 else c.history
    return replace(
        c,
        check_round=e.check_round,
        groups=e.groups,
        assigned_at=e.ts,
        timeout_s=e.timeout_s,
        reports=immutables.Map(),
        history=history,
    )


def on_reported(c: CheckState, e: ev.NetworkCheckReported) -> CheckState:
    if c.done or e.check_round != c.check_round or e.node in c.reports:
        return c
    for g in c.groups:
        if (e.node, e.incarnation) in zip(g.nodes, g.incarnations, strict=True):
            return replace(c, reports=c.reports.set(e.node, e.elapsed_s if e.ok else None))
    return c


def on_completed(c: CheckState, e: ev.NetworkCheckCompleted) -> CheckState:
    if c.done:
        return c
    return replace(
        c,
        done=True,
        history=_closed(c),
        faulty=e.faulty,
        stragglers=e.stragglers,
        results=e.results,
        reports=immutables.Map(),
    )


# --------------------------------------------------------------------------- decide


class Wait(msgspec.Struct, frozen=True, kw_only=True):
    """Nothing to decide now, and why not yet (`until`: when that may change)."""

    reason: str
    until: float | None = None


class StartCheck(msgspec.Struct, frozen=True, kw_only=True):
    """Assign check round `check_round` to these groups."""

    check_round: int
    groups: tuple[ev.CheckGroup, ...]
    timeout_s: float


class CompleteCheck(msgspec.Struct, frozen=True, kw_only=True):
    """The check's verdict."""

    results: tuple[ev.NodeCheck, ...]
    faulty: tuple[str, ...]
    stragglers: tuple[str, ...]


Member = tuple[str, str, str, int]  # node, incarnation, addr, store port


def _group(members: Sequence[Member]) -> ev.CheckGroup:
    return ev.CheckGroup(
        nodes=tuple(m[0] for m in members),
        incarnations=tuple(m[1] for m in members),
        master_addr=members[0][2],
        master_port=members[0][3],
    )


def _pairs(ordered: Sequence[Member]) -> list[list[Member]]:
    groups = [list(ordered[i : i + 2]) for i in range(0, len(ordered) - len(ordered) % 2, 2)]
    if len(ordered) % 2:
        if groups:
            groups[-1].append(ordered[-1])
        else:
            groups.append([ordered[-1]])
    return groups


def first_groups(pool: Sequence[Member]) -> tuple[ev.CheckGroup, ...]:
    return tuple(_group(g) for g in _pairs(pool))


def second_groups(c: CheckState, pool: Sequence[Member]) -> tuple[ev.CheckGroup, ...]:
    """Slowest with fastest (a failure counts as the slowest)."""
    history = _closed(c)

    def speed(m: Member) -> float:
        t = history.get(m[0], (None,))[-1]
        return float("inf") if t is None else t

    by_speed = sorted(pool, key=speed)
    ordered: list[Member] = []
    lo, hi = 0, len(by_speed) - 1
    while lo <= hi:
        ordered.append(by_speed[hi])
        if lo != hi:
            ordered.append(by_speed[lo])
        lo, hi = lo + 1, hi - 1
    return tuple(_group(g) for g in _pairs(ordered))


def round_over(c: CheckState, now: float, present: frozenset[str]) -> bool:
    """Every node of the round reported or is gone (`present`: the nodes still alive)."""
    return all(
        n in c.reports or n not in present for n in c.nodes()
    ) or now - c.assigned_at > backstop_s(c.timeout_s)


def verdict(c: CheckState) -> tuple[tuple[ev.NodeCheck, ...], tuple[str, ...], tuple[str, ...]]:
    history = _closed(c)
    results = []
    for node in sorted(history.keys()):
        times = history[node]
        ok = [t for t in times if t is not None]
        results.append(
            ev.NodeCheck(node=node, failures=len(times) - len(ok), best_s=min(ok) if ok else None)
        )
    best = [r.best_s for r in results if r.best_s is not None]
    # (no node passed a round: nothing tells a broken node from its peers, three nodes
    # checked as one group, or a fault of the check's own; excluding them all left the
    # job waiting for ever: none is excluded, and the training round says what fails)
    faulty = tuple(
        r.node for r in results if best and r.best_s is None and r.failures >= CHECK_ROUNDS
    )
    stragglers: tuple[str, ...] = ()
    if len(best) >= 2:
        median = statistics.median(best)
        stragglers = tuple(
            r.node for r in results if r.best_s is not None and r.best_s > STRAGGLER_FACTOR * median
        )
    return tuple(results), faulty, stragglers


def next_action(
    c: CheckState,
    pool: Sequence[Member],
    now: float,
    ready: bool,
    *,
    timeout_s: float,
) -> StartCheck | CompleteCheck | Wait:
    """The check's next decision while it is not done, or why it waits.

    `ready`: the job could form its first round now (the check starts then).
    """
    if c.check_round < 0:
        if not ready:
            return Wait(
                reason=f"the network check starts once enough nodes are here ({len(pool)} now)"
            )
        return StartCheck(check_round=0, groups=first_groups(pool), timeout_s=timeout_s)
    if not round_over(c, now, frozenset(m[0] for m in pool)):
        missing = [n for n in c.nodes() if n not in c.reports]
        return Wait(
            reason=f"network check round {c.check_round}: waiting for "
            f"{', '.join(missing)} to report",
            until=c.assigned_at + backstop_s(c.timeout_s),
        )
    if c.check_round + 1 < CHECK_ROUNDS:
        return StartCheck(
            check_round=c.check_round + 1, groups=second_groups(c, pool), timeout_s=timeout_s
        )
    results, faulty, stragglers = verdict(c)
    return CompleteCheck(results=results, faulty=faulty, stragglers=stragglers)


def to_exclude(
    c: CheckState, exclude_stragglers: bool, excluded: Callable[[str], bool]
) -> str | None:
    """The next node the check's verdict excludes, if any is left."""
    for node in (*c.faulty, *(c.stragglers if exclude_stragglers else ())):
        if not excluded(node):
            return node
    return None
