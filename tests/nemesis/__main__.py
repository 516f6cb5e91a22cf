"""`python -m tests.nemesis`: run the nemesis scenarios (as root: network namespaces
and a tmpfs) and print the table; `--report` prints the table of the results so far.

    python -m tests.nemesis --runs 5            # every scenario, seeds 1..5
    python -m tests.nemesis --scenario rove --seed 7 --runs 2
    python -m tests.nemesis --report            # the table of every recorded run (or,
                                                # before any, of the published figures)
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from rove.control.process import logs
from tests.nemesis import report
from tests.nemesis.run import SCENARIOS, run


async def _run_all(names: list[str], seeds: list[int], keep: bool) -> int:
    failed = 0
    for seed in seeds:
        for name in names:
            root = Path(tempfile.mkdtemp(prefix=f"nemesis-{name}-{seed}-"))
            outcome = await run(SCENARIOS[name], root, seed)
            report.record(outcome.rows)
            state = "survived" if not outcome.problems else "FAILED"
            print(f"{name} seed {seed}: {state} ({root})", flush=True)
            for p in outcome.problems:
                print(f"  - {p}", flush=True)
            if outcome.problems:
                failed += 1
                print(outcome.world.logs(2000), file=sys.stderr)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.nemesis",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=sorted(SCENARIOS),
        help="a scenario to run (repeatable; default: all)",
    )
    p.add_argument("--runs", type=int, default=1, help="seeds per scenario (1)")
    p.add_argument("--seed", type=int, default=1, help="the first seed (1)")
    p.add_argument(
        "--report",
        action="store_true",
        help="print the table of the recorded results and run nothing",
    )
    p.add_argument("--keep", action="store_true", help="keep the runs' folders")
    args = p.parse_args(argv)
    if args.report:
        source = report.results_path()
        if not source.exists():  # no run here yet: the figures docs/operations.md publishes
            source = report.PUBLISHED
        rows = report.load(source)
        if not rows:
            print(f"no results in {source}: run `python -m tests.nemesis`")
            return 1
        print(f"{len(rows)} faults injected, from {source}:\n")
        print(report.table(rows))
        return 0
    logs.configure("error")  # the harness's own client: its denied publishes are the point
    names = args.scenario or sorted(SCENARIOS)
    seeds = list(range(args.seed, args.seed + max(1, args.runs)))
    failed = asyncio.run(_run_all(names, seeds, args.keep))
    print(report.table([r for r in report.load() if r["seed"] in seeds]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
