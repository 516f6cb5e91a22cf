"""What the master knows about checkpoints, and when a step is committed (pure).

Agents report the steps their ranks hold in memory (`ckpt_in_memory`) and the
steps they persisted (`ckpt_persisted`), each with the round whose workers saved
it. A round that restores step S starts a new lineage there: the steps after S
of the old one are forgotten, and a late report of one is ignored, so a commit
never mixes the ranks of two lineages that reuse the same step numbers. A step is
committed, by one `ckpt_committed` decision, once the ranks persisted for it cover
the whole world it was saved in; only the newest such step is committed, and a
committed step never goes back, unless the workers of a round could not read it
and fell back to an older one (`training_progress.restored_step`): the lineage
then starts there, and that step is committed again, so that storage says it.
Steps at or below the committed one are forgotten, so the state stays small
however long the job runs.

A job started on storage an earlier run of it left behind goes on from there: each
agent says the committed step it found as it started (`ckpt_found`), and until the
job commits a step of its own, a round that cannot restore from memory restores the
oldest step its members found (every one of them must have found one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import immutables
import msgspec
from msgspec.structs import replace

from rove.control.catalogue import events as ev


class CkptState(msgspec.Struct, frozen=True, kw_only=True):
    committed: int | None = None
    #: step -> (world size, ranks persisted so far: a set of ranks below the world
    #: size, as a map so that one report adds in O(log n), not a copy of the set)
    persisted: immutables.Map[int, tuple[int, immutables.Map[int, bool]]] = msgspec.field(
        default_factory=immutables.Map
    )
    #: node -> (newest step in memory, its ranks)
    memory: immutables.Map[str, tuple[int, tuple[int, ...]]] = msgspec.field(
        default_factory=immutables.Map
    )
    failures: int = 0
    last_error: str = ""
    #: node -> the committed step it found on storage as it started (an earlier run's)
    found: immutables.Map[str, int] = msgspec.field(default_factory=immutables.Map)
    #: node -> the step it reported in memory before its newest (for the same ranks): its
    #: other slot holds it unless the agent skipped a report (a restore then falls back)
    previous: immutables.Map[str, int] = msgspec.field(default_factory=immutables.Map)
    #: node -> the incarnation of its agent that reported its memory: a node restarted
    #: since (a new agent, its memory maybe gone with the old one) holds nothing known
    reporter: immutables.Map[str, str] = msgspec.field(default_factory=immutables.Map)
    #: source node -> (newest step held as peer replicas, its ranks, the (node,
    #: incarnation) holding every one of them, verified): what a lost node's peers could
    #: give back (a holder restarted since holds nothing)
    replicas: immutables.Map[str, tuple[int, tuple[int, ...], tuple[tuple[str, str], ...]]] = (
        msgspec.field(default_factory=immutables.Map)
    )
    #: source node -> (the newest step a peer took whole of it, its ranks, the
    #: incarnation of its agent that sent it): that agent keeps its own copy of the
    #: step (`ReplicaStored.source_incarnation`) after its slots moved on
    kept: immutables.Map[str, tuple[int, tuple[int, ...], str]] = msgspec.field(
        default_factory=immutables.Map
    )
    #: the newest round's restore: (step, source, ranks fetched from peers); None: afresh
    restored: tuple[int, str, int] | None = None
    #: (round, step it restored, -1 for a fresh start) of the recent rounds: where
    #: each started a new lineage (the newest `MAX_CUTS`)
    cuts: tuple[tuple[int, int], ...] = ()
    #: node -> its ranks whose slots spilled to disk, as of its newest report (said by
    #: `rove status`)
    spilled: immutables.Map[str, tuple[int, ...]] = msgspec.field(default_factory=immutables.Map)
    #: the older step a round's workers fell back to, once `committed`, to be committed
    #: again by a decision (agents record it on storage, whose committed step still
    #: names the unreadable one); None once that decision is folded
    recommit: int | None = None


#: How many lineage cuts the state remembers (a report older than all of them is stale).
MAX_CUTS = 32


def _stale(c: CkptState, step: int, round_: int) -> bool:
    """A step saved in `round_` that a later round abandoned (it restored an older step)."""
    return any(round_ < r and step > kept for r, kept in c.cuts)


def on_round(c: CkptState, e: ev.RoundCompleted) -> CkptState:
    """A round restores `e.restore_step` (None: starts afresh): a new lineage starts
    there, and every newer step of the old one is forgotten."""
    if c.cuts and e.round <= c.cuts[-1][0]:
        return c
    keep = -1 if e.restore_step is None else e.restore_step
    restored = (
        None if e.restore_step is None else (e.restore_step, e.restore_source.value, len(e.fetches))
    )
    cuts = (*c.cuts, (e.round, keep))[-MAX_CUTS:]
    return replace(_forget(c, keep), cuts=cuts, restored=restored)


def on_progress(c: CkptState, e: ev.TrainingProgress) -> CkptState:
    """The workers of the newest round say the step they restored: one older than the
    step the round named means they could not read it (corrupted, truncated, gone)
    and fell back together to an older step on storage, discarding the newer ones
    there and in their memory (`rove.checkpoint.restore`). The lineage starts at that
    step instead: what the state knew of the steps after it, up to the named one, is
    forgotten (newer ones are the new lineage's: the round forgot the old lineage's),
    and it is the committed step (every rank read it from storage), to be committed
    again by a decision (`recommit`) so that storage says it too: the steps the new
    lineage persists are committed rather than ignored as older than the named one."""
    if e.restored_step is None or not c.cuts:
        return c
    rnd, named = c.cuts[-1]
    if e.round != rnd or e.restored_step >= named:
        return c
    keep = e.restored_step
    c = _forget(c, keep, named)
    persisted = c.persisted
    for step in [s for s in persisted if s <= keep]:
        persisted = persisted.delete(step)
    return replace(
        c,
        committed=keep,
        persisted=persisted,
        recommit=keep,
        cuts=(*c.cuts[:-1], (rnd, keep)),
        restored=(keep, ev.RestoreSource.STORAGE.value, 0),
    )


def _forget(c: CkptState, keep: int, upto: float = float("inf")) -> CkptState:
    """`c` without what it knew of the steps after `keep` up to `upto` (a new lineage
    starts at `keep`, and reuses their numbers)."""

    def gone(step: int) -> bool:
        return keep < step <= upto

    persisted = c.persisted
    for step in [s for s in persisted if gone(s)]:
        persisted = persisted.delete(step)
    memory, replicas, kept = (_without(m, gone) for m in (c.memory, c.replicas, c.kept))
    previous = c.previous
    for node in [n for n, step in previous.items() if gone(step) or n not in memory]:
        previous = previous.delete(node)
    return replace(
        c, persisted=persisted, memory=memory, previous=previous, replicas=replicas, kept=kept
    )


Stepped = TypeVar("Stepped", bound=tuple[Any, ...])


def _without(
    by_node: immutables.Map[str, Stepped], gone: Callable[[int], bool]
) -> immutables.Map[str, Stepped]:
    """`by_node` without the entries (step first) of a step that is `gone`."""
    with by_node.mutate() as m:
        for node in [n for n, held in by_node.items() if gone(held[0])]:
            del m[node]
        left = m.finish()
    return left


def on_in_memory(c: CkptState, e: ev.CkptInMemory) -> CkptState:
    if e.recovered:
        return _recovered(c, e)
    if _stale(c, e.step, e.round):
        return c  # a late report of a step a newer round abandoned
    known = c.memory.get(e.node)
    if known is not None and known[0] >= e.step:
        return c
    previous = c.previous.delete(e.node) if e.node in c.previous else c.previous
    if known is not None and tuple(known[1]) == tuple(e.ranks):
        previous = previous.set(e.node, known[0])
    spilled = (
        c.spilled.set(e.node, e.spilled)
        if e.spilled
        else c.spilled.delete(e.node)
        if e.node in c.spilled
        else c.spilled
    )
    return replace(
        c,
        memory=c.memory.set(e.node, (e.step, e.ranks)),
        previous=previous,
        reporter=c.reporter.set(e.node, e.incarnation),
        spilled=spilled,
    )


def _recovered(c: CkptState, e: ev.CkptInMemory) -> CkptState:
    """A new agent of `e.node` holds the step its earlier agent reported (and no round
    since abandoned: `on_round` forgets newer steps): its memory is the new agent's. A
    step the master did not know the node held (another lineage's, maybe, or one saved
    as the agent was killed, before it was reported) is ignored. The agent says each
    step it holds, newest first: the first one known is taken."""
    known = c.memory.get(e.node)
    # (more ranks than the node ran: nodes sharing a machine's memory, each agent sees
    # every one's slots; those of this node are among them)
    if known is None or not set(known[1]) <= set(e.ranks):
        return c
    if known[0] == e.step:
        return replace(c, reporter=c.reporter.set(e.node, e.incarnation))
    taken = c.reporter.get(e.node) == e.incarnation
    if not taken and c.previous.get(e.node) == e.step:  # the newest slot was lost
        return replace(
            c,
            memory=c.memory.set(e.node, (e.step, known[1])),
            previous=c.previous.delete(e.node),
            reporter=c.reporter.set(e.node, e.incarnation),
        )
    return c


def on_replica(c: CkptState, e: ev.ReplicaStored) -> CkptState:
    """`e.node` holds `e.source`'s ranks of `e.step`: the newest step replicated of a
    source replaces an older one (a peer keeps only its newest), another holder of the
    same step adds to it."""
    if _stale(c, e.step, e.round):
        return c
    ranks = tuple(sorted(r.rank for r in e.ranks))
    mine = c.kept.get(e.source)
    if e.source_incarnation and (
        mine is None or mine[2] != e.source_incarnation or mine[0] < e.step
    ):
        c = replace(c, kept=c.kept.set(e.source, (e.step, ranks, e.source_incarnation)))
    known = c.replicas.get(e.source)
    if known is not None and (known[0] > e.step or (known[0] == e.step and known[1] != ranks)):
        return c
    holders = known[2] if known is not None and known[0] == e.step else ()
    if (e.node, e.incarnation) in holders:
        return c
    entry = (e.step, ranks, (*holders, (e.node, e.incarnation)))
    return replace(c, replicas=c.replicas.set(e.source, entry))


def on_persisted(c: CkptState, e: ev.CkptPersisted) -> CkptState:
    if c.committed is not None and e.step <= c.committed:
        return c
    if _stale(c, e.step, e.round):
        return c  # persisted by a lineage a newer round abandoned: never to be committed
    world, ranks = c.persisted.get(e.step, (e.world_size, immutables.Map()))
    with ranks.mutate() as more:
        for rank in e.ranks:
            if 0 <= rank < world:
                more[rank] = True
        ranks = more.finish()
    return replace(c, persisted=c.persisted.set(e.step, (world, ranks)))


def on_failed(c: CkptState, e: ev.CkptFailed) -> CkptState:
    return replace(
        c,
        failures=c.failures + 1,
        last_error=f"step {e.step} on {e.node}: {e.error}"[: ev.REASON_CHARS],
    )


def on_found(c: CkptState, e: ev.CkptFound) -> CkptState:
    return replace(c, found=c.found.set(e.node, e.step))


def on_committed(c: CkptState, e: ev.CkptCommitted) -> CkptState:
    if c.recommit is not None and e.step == c.recommit:
        return replace(c, recommit=None)  # the step fallen back to, committed again
    if c.committed is not None and e.step <= c.committed:
        return c
    if _stale(c, e.step, e.round):
        return c  # decided before a round abandoned that step
    persisted = c.persisted
    for step in [s for s in persisted if s <= e.step]:
        persisted = persisted.delete(step)
    return replace(c, committed=e.step, persisted=persisted)


def to_commit(c: CkptState) -> tuple[int, int] | None:
    """(step, world size) of the newest fully persisted step not yet committed."""
    complete = [
        (step, world)
        for step, (world, ranks) in c.persisted.items()
        if len(ranks) == world and (c.committed is None or step > c.committed)
    ]
    return max(complete) if complete else None


class Restore(NamedTuple):
    """Where a new round restores from: the step, its source, and for a restore from
    peers the ranks fetched and from whom."""

    step: int | None
    source: ev.RestoreSource
    fetches: tuple[ev.RestoreFetch, ...] = ()


def restore_point(
    c: CkptState,
    members: list[tuple[str, tuple[int, ...]]],
    incarnations: Mapping[str, str] | None = None,
) -> Restore:
    """The step every rank of a new round should load, and where from.

    `members` are (node, the ranks it will run); `incarnations` their incarnations
    (a replica holder restarted since holds nothing). Memory wins when every member
    reported a step in memory for exactly those ranks: the newest step they all
    hold (each keeps its two newest, so the oldest of their newest is there).
    Else peers' memory (`peer_plan`), when it has a step at least as new as the
    committed one. Otherwise the committed step on storage (the job's own, else the
    one an earlier run left, found by every member); otherwise nothing (a fresh start).
    """
    committed = c.committed if c.committed is not None else _found(c, members)
    incarnations = incarnations or {}
    steps: list[int] = []
    for node, ranks in members:
        held = c.memory.get(node) if _same_agent(c, node, incarnations) else None
        if held is None or tuple(held[1]) != tuple(ranks):
            steps = []
            break
        steps.append(held[0])
    if steps and (committed is None or min(steps) >= committed):
        return Restore(min(steps), ev.RestoreSource.MEMORY)
    plan = peer_plan(c, members, incarnations)
    if plan is not None and (committed is None or plan[0] >= committed):
        step, fetches = plan
        # (no rank to fetch: every runner holds the step, an older one than its newest)
        source = ev.RestoreSource.PEER if fetches else ev.RestoreSource.MEMORY
        return Restore(step, source, fetches)
    if committed is not None:
        return Restore(committed, ev.RestoreSource.STORAGE)
    return Restore(None, ev.RestoreSource.NONE)


def peer_plan(
    c: CkptState, members: list[tuple[str, tuple[int, ...]]], incarnations: Mapping[str, str]
) -> tuple[int, tuple[ev.RestoreFetch, ...]] | None:
    """The newest step every rank of the new round can get from the members' memory
    (their own flash slots, the peer replicas they hold, or the copy a node keeps of
    its own step a peer took), and where each rank its runner does not hold in its
    slots comes from; None when some rank has no such step.

    Only members serve (they are alive: they just joined). A rank's runner that holds
    it in its slots loads it itself; another one fetches it, from a replica first (held
    for that), then another member's slots, then a kept copy (its own, maybe)."""
    runner = {r: node for node, ranks in members for r in ranks}
    here = set(runner.values())
    offers: dict[int, dict[int, list[tuple[int, str, str]]]] = {}  # step -> rank -> offers

    def offer(step: int, rank: int, kind: int, node: str, source: str) -> None:
        if rank in runner:
            offers.setdefault(step, {}).setdefault(rank, []).append((kind, node, source))

    for node, (step, ranks) in c.memory.items():
        if node not in here or not _same_agent(c, node, incarnations):
            continue
        for s in (step, c.previous.get(node)):
            if s is not None:
                for r in ranks:
                    offer(s, r, 2, node, node)
    for source, (step, ranks, holders) in c.replicas.items():
        for holder, incarnation in holders:
            if holder in here and incarnations.get(holder, incarnation) == incarnation:
                for r in ranks:
                    offer(step, r, 1, holder, source)
    for source, (step, ranks, incarnation) in c.kept.items():
        if source in here and incarnations.get(source) == incarnation:
            for r in ranks:
                offer(step, r, 3, source, source)
    for step in sorted(offers, reverse=True):
        by_rank = offers[step]
        if len(by_rank) < len(runner):
            continue
        fetches = []
        for r in sorted(runner):
            if any(k == 2 and node == runner[r] for k, node, _ in by_rank[r]):
                continue  # its runner holds it in its own slots
            _, node, source = min(by_rank[r])
            fetches.append(ev.RestoreFetch(r, node, source))
        return step, tuple(fetches)
    return None


def _same_agent(c: CkptState, node: str, incarnations: Mapping[str, str]) -> bool:
    """`node`'s memory report came from the agent that runs it now (unknown: assumed)."""
    now, then = incarnations.get(node), c.reporter.get(node)
    return now is None or then is None or now == then


def _found(c: CkptState, members: list[tuple[str, tuple[int, ...]]]) -> int | None:
    """The oldest step the members found on storage as they started, if each did."""
    found = [c.found.get(node) for node, _ in members]
    if not found or any(step is None for step in found):
        return None
    return min(step for step in found if step is not None)


def at_end(c: CkptState, nodes: list[str], committing: int | None) -> str:
    """What a job that ends now leaves durable, as a clause of its end reason ('' when
    its workers saved no flash checkpoint). `nodes`: the last round's members;
    `committing`: the step committed in the same breath, if any."""
    durable = committing if committing is not None else c.committed
    held = [c.memory[n][0] for n in nodes if n in c.memory]
    newest = min(held) if held and len(held) == len(nodes) else None
    if durable is None and newest is None:
        return ""
    if durable is None and c.last_error:
        return (
            f"; its newest checkpoint (step {newest}) was kept in memory only: no step "
            f"reached storage ({c.last_error})"
        )
    if durable is None:
        return (
            f"; its newest checkpoint (step {newest}) was kept in memory only: no step is "
            "durable (give --checkpoint-dir to persist them)"
        )
    if newest is not None and durable < newest:
        why = f" ({c.last_error})" if c.last_error else ": not every rank persisted it"
        return f"; the newest durable checkpoint is step {durable}, not step {newest}{why}"
    return f"; its last checkpoint, step {durable}, is committed to storage"
