"""What must hold after every nemesis run, whatever was injected: each check returns the
problems it found (empty: it holds)."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from rove.checkpoint.durable import CheckpointError
from rove.checkpoint.storage import FileStorage
from rove.control.catalogue import events as ev
from tests import lineage
from tests.nemesis.faults import Injected
from tests.nemesis.world import NODES, WITNESS, World


def storage_of(root: Path) -> FileStorage | None:
    """The job's checkpoint storage under `root` (where its `committed` tracker is)."""
    # (the agents remove old steps meanwhile: only `root` and its children are looked at)
    for directory in [root, *sorted(root.glob("*"))]:
        if (directory / "committed").exists():
            return FileStorage(directory)
    return None


def finished(codes: dict[str, int]) -> list[str]:
    bad = {n: c for n, c in codes.items() if c != 0}
    return [f"nodes that did not finish: {bad}"] if bad or set(codes) != set(NODES) else []


def exactly_once(trace: Path, samples: int, epochs: int) -> list[str]:
    """Every sample of every epoch once in the lineage of the final model."""
    try:
        trained = collections.Counter(lineage.lineage(trace))
    except AssertionError as exc:
        return [f"the lineage cannot be rebuilt: {exc}"]
    expected = {(e, i) for e in range(epochs) for i in range(samples)}
    problems = []
    missing = expected - set(trained)
    if missing:
        problems.append(f"{len(missing)} samples never trained, e.g. {sorted(missing)[:5]}")
    twice = {k: n for k, n in trained.items() if n > 1}
    if twice:
        problems.append(f"{len(twice)} samples trained twice, e.g. {list(twice.items())[:5]}")
    return problems


def committed_kept(root: Path, records: list[Any], destroyed: set[int]) -> list[str]:
    """The newest committed step is on storage, and every committed step kept there loads
    on every rank that persisted it (but those a fault destroyed on purpose)."""
    commits = [r.event.step for r in records if isinstance(r.event, ev.CkptCommitted)]
    if not commits:
        return ["no step was ever committed"]
    storage = storage_of(root)
    if storage is None:
        return [f"no committed checkpoint is on storage under {root}"]
    problems = []
    newest = commits[-1]
    kept = storage.steps()
    if newest not in kept and newest not in destroyed:
        problems.append(f"the newest committed step {newest} is not on storage (kept: {kept})")
    for step in kept:
        if step in destroyed:
            continue
        for rank in sorted(storage.persisted_ranks(step)):
            try:
                storage.load(step, rank)
            except CheckpointError as exc:
                problems.append(f"committed step {step} of rank {rank} does not load: {exc}")
    return problems


def witness_stored(world: World, records: list[Any]) -> list[str]:
    """Every event the server acknowledged is in the stream, once, in the order it was
    published (the witness publishes one at a time)."""
    stored = collections.Counter(r.event.id for r in records)
    missing = [i for i in world.witness.acked if i not in stored]
    doubled = [i for i, n in stored.items() if n > 1]
    problems = []
    numbers = [int(r.event.id.rsplit(":", 1)[1]) for r in records]
    if numbers != sorted(numbers):
        problems.append("the witness's events are not stored in the order they were published")
    if missing:
        problems.append(f"{len(missing)} acknowledged events are not in the stream: {missing[:5]}")
    if doubled:
        problems.append(f"{len(doubled)} events are stored twice: {doubled[:5]}")
    if len(world.witness.acked) < 20:
        problems.append(f"the witness was acknowledged only {len(world.witness.acked)} times")
    return problems


def no_deposed_writes(records: list[Any]) -> list[str]:
    """No decision of an epoch older than a stored election is stored after it: the
    server refused whatever a deposed master wrote."""
    epoch, stale = 0, []
    for r in records:
        e = r.event
        if isinstance(e, ev.MasterElected):
            epoch = max(epoch, e.epoch)
        elif isinstance(e, ev.Decision) and e.epoch < epoch:
            stale.append(f"#{r.seq} {type(e).__name__} of epoch {e.epoch} < {epoch}")
    return [f"decisions of a deposed master were stored: {stale[:5]}"] if stale else []


def masters_well(world: World) -> list[str]:
    problems = []
    for name, m in world.masters.items():
        if name in world.gone:
            continue
        code = m.proc.poll()
        if code not in (None, 0):
            problems.append(f"master {name} exited with {code}")
        if "Traceback" in m.log():
            problems.append(f"master {name} logged a traceback")
    return problems


async def after_run(world: World, injected: list[Injected], codes: dict[str, int]) -> list[str]:
    await world.stop_witness()
    records = await world.records()
    witness = await world.records(WITNESS)
    destroyed = set().union(*(i.destroyed for i in injected)) if injected else set()
    problems = [p for i in injected for p in (f"{i.fault}: {x}" for x in i.problems)]
    problems += finished(codes)
    problems += exactly_once(world.trace, world.shape.samples, world.shape.epochs)
    problems += committed_kept(world.ckpt, records, destroyed)
    problems += witness_stored(world, witness)
    problems += no_deposed_writes(records)
    problems += masters_well(world)
    return problems
