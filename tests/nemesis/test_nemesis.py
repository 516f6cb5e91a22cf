"""The nemesis in the suite: one seed of each scenario (`ROVE_NEMESIS_RUNS` seeds for a
longer soak: `make test-nemesis`). Each run appends its rows to the results file that
`python -m tests.nemesis --report` tabulates; a failed run's report carries every
process's log (conftest) and the problems found."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.nemesis import report
from tests.nemesis.run import SCENARIOS, Outcome, run
from tests.nemesis.world import JOB
from tests.support import stored_events

pytestmark = [pytest.mark.nemesis, pytest.mark.slow, pytest.mark.timeout(900)]


def seeds(first: int) -> list[int]:
    runs = int(os.environ.get("ROVE_NEMESIS_RUNS", "1") or 1)
    return list(range(first, first + max(1, runs)))


async def check(outcome: Outcome) -> None:
    report.record(outcome.rows)
    if outcome.problems:
        recent = ""
        if outcome.world.bus is not None and not outcome.world.bus.nc.is_closed:
            recs = await stored_events(outcome.world.bus, JOB)
            recent = "\n".join(f"#{r.seq} {r.event}"[:300] for r in recs[-15:])
        pytest.fail(
            "\n".join(["the nemesis found:", *outcome.problems, "the job's last events:", recent])
        )
    assert all(r.survived for r in outcome.rows), [r for r in outcome.rows if not r.survived]


@pytest.mark.restarts_nats  # kills and starts NATS servers on their ports; a network namespace
@pytest.mark.xdist_group("nats-a")
@pytest.mark.parametrize("seed", seeds(1))
async def test_the_job_rides_out_a_server_killed_a_quorum_lost_and_a_server_cut_off(
    tmp_path: Path, seed: int
) -> None:
    await check(await run(SCENARIOS["bus"], tmp_path, seed))


@pytest.mark.restarts_nats  # restarts every NATS server on its port, in turn and all at once
@pytest.mark.xdist_group("nats-b")
@pytest.mark.parametrize("seed", seeds(1))
async def test_the_job_rides_out_its_cluster_restarted_in_turn_and_all_at_once(
    tmp_path: Path, seed: int
) -> None:
    await check(await run(SCENARIOS["cluster"], tmp_path, seed))


@pytest.mark.parametrize("seed", seeds(1))
async def test_the_job_rides_out_a_node_cut_off_a_paused_master_a_full_disk_and_a_corrupt_file(
    tmp_path: Path, seed: int
) -> None:
    await check(await run(SCENARIOS["rove"], tmp_path, seed))


@pytest.mark.parametrize("seed", seeds(1))
async def test_the_job_rides_out_poison_and_a_flood_with_and_without_credentials(
    tmp_path: Path, seed: int
) -> None:
    await check(await run(SCENARIOS["hostile"], tmp_path, seed))
