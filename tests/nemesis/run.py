"""A nemesis run: a scenario's faults, in an order and at steps drawn from a seed, on
one job; the checks after it; one result row per fault."""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rove.control.catalogue import events as ev
from tests.nemesis import checks
from tests.nemesis.faults import FAULTS, Injected, job_ended
from tests.nemesis.world import Shape, World
from tests.support import eventually


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[str, ...]
    shape: Shape


#: The suite's scenarios. Faults that need the same parts of the world share a job
#: (one start-up, one end, several faults); the job is long enough to outlast them.
SCENARIOS = {
    "bus": Scenario(
        "bus",
        ("nats-kill", "nats-quorum", "nats-partition"),
        Shape(samples=3200, step_sleep=0.25, nats_netns=True),
    ),
    "rove": Scenario(
        "rove",
        ("node-partition", "master-pause", "disk-full", "checkpoint-corrupt"),
        Shape(samples=3200, step_sleep=0.25, node_netns=True, disk_mib=16),
    ),
    "cluster": Scenario(
        "cluster",
        ("nats-rolling", "nats-restart-all"),
        Shape(samples=3200, step_sleep=0.25),
    ),
    # (not in the suite's one seed: 75 s of outage; `make test-nemesis` runs it)
    "outage": Scenario("outage", ("nats-outage",), Shape(samples=3200, step_sleep=0.15)),
    "hostile": Scenario(
        "hostile", ("poison", "flood"), Shape(samples=4800, step_sleep=0.15, secured=True)
    ),
}


@dataclass
class Row:
    """One fault of one run, as the report tabulates it."""

    fault: str
    scenario: str
    seed: int
    survived: bool
    #: seconds from the fault's end until every rank trained again at full size
    recover_s: float | None
    note: str
    problems: list[str] = field(default_factory=list)
    figures: dict[str, float] = field(default_factory=dict)
    #: when the fault began and ended (was healed), wall-clock seconds
    began: float = 0.0
    ended: float = 0.0
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Outcome:
    rows: list[Row]
    problems: list[str]
    world: World


def plan(scenario: Scenario, seed: int) -> list[tuple[str, int]]:
    """(fault, at step): the scenario's faults in an order and at steps drawn from `seed`,
    all in the first 60 % of the job."""
    rnd = random.Random(seed)
    order = list(scenario.faults)
    rnd.shuffle(order)
    total = scenario.shape.samples * scenario.shape.epochs // 32
    at = sorted(rnd.sample(range(total // 10, total * 3 // 5), len(order)))
    return list(zip(order, at, strict=True))


async def run(scenario: Scenario, root: Path, seed: int) -> Outcome:
    """Run the job with the scenario's faults; check it. Never raises for what the
    system did wrong: that is in the outcome's problems (and rows)."""
    rnd = random.Random(seed * 7919)
    world = World(root, scenario.shape, seed)
    injected: list[Injected] = []
    problems: list[str] = []
    try:
        await world.start()
        for fault, at in plan(scenario, seed):
            await eventually(lambda a=at: world.progress() >= a, timeout=300)
            if world.progress() > world.total_steps() * 0.9:
                problems.append(f"the job was nearly done before {fault}: too short a job")
            if await job_ended(world):
                # (nodes a fault starts again would wait for the job's next run, which no
                # master serves: the run would hang instead of failing)
                problems.append(f"the job had ended before {fault}: it was not injected")
                break
            i = await FAULTS[fault](world, rnd)
            # (a fault that takes long on a busy machine, the poison's thousands of
            # publishes, may see the job to its end: no step after it to recover)
            i.job_done = await job_ended(world, ev.JobPhase.FINISHED)
            injected.append(i)
        codes = await world.finish()
        problems += await checks.after_run(world, injected, codes)
    except AssertionError as exc:  # a deadline missed: the system did not get there
        problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        await world.stop()
    rows = []
    for i in injected:
        back = world.full_speed_at(i.ended, i.round_before)
        recover = None if back is None else max(0.0, back - i.ended)
        outlasted = recover is None and i.job_done  # the job trained to its end during it
        note = i.note
        if outlasted:
            note = "; ".join(n for n in (note, "the job trained to its end during it") if n)
        mine = [p for p in problems if p.startswith(f"{i.fault}: ")]
        if recover is None and not outlasted:
            mine.append(f"{i.fault}: the job never trained at full size after it")
        rows.append(
            Row(
                i.fault,
                scenario.name,
                seed,
                survived=not problems and (recover is not None or outlasted),
                recover_s=recover,
                note=note,
                problems=mine or ([] if not problems else ["(the run's checks failed)"]),
                figures=i.figures,
                began=i.began,
                ended=i.ended,
            )
        )
    done = {i.fault for i in injected}
    for fault in scenario.faults:
        if fault not in done:
            rows.append(Row(fault, scenario.name, seed, False, None, "not injected", problems))
    return Outcome(rows, problems, world)
