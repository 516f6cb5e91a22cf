"""The goodput ledger of a large, long job: its memory, and what it says, with and
without thinning the points each round keeps and closing its older rounds.

A master folds every event of its job through a `rove.control.domain.goodput.Ledger`
(for `rove_goodput_ratio`), and `rove goodput` replays the whole stream into one. Each
node reports its progress every 5 s (`training_progress`); the ledger places steps in
time from those reports. This folds a job of `--nodes` nodes reporting for `--hours`
hours, cut into `--rounds` rounds (each a failure, restoring a step `--rollback-s`
older), into:

- `every`: the ledger keeping one point per report and every round open (the code
  before either change: `point_gap_s=0`, no bound, `open_rounds=0`);
- `thinned`: points at least `POINT_GAP_S` apart, at most about `MAX_POINTS` a round,
  every round keeping each node's newest report (`open_rounds=0`: the code before
  rounds closed), the baseline of `closed`;
- `closed`: the ledger as rove runs it (also closing the rounds older than the newest
  `OPEN_ROUNDS`: their nodes' reports folded into one, their points thinned to about
  `CLOSED_POINTS`).

Memory is what `tracemalloc` counts as held by the ledger once every event is folded
(a pass of its own: tracing slows the fold); the fold's and the report's times come
from a pass without tracing. Prints one JSON line: each ledger's points, MiB, bytes in
a master's snapshot (encoded, and compressed as the snapshot is), fold and report
seconds, goodput and badput by bucket, and the ratios.

    python benchmarks/goodput_ledger.py [--nodes 1000] [--hours 2] [--rounds 4] [--rollback-s 60]
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp

JOB = "bench"


def events(nodes: int, hours: float, rounds: int, rollback_s: float) -> Iterator[ev.Event]:
    """The job's events in stream order (generated, not kept: a list of them would
    dwarf the ledger)."""
    span = hours * 3600 / rounds
    members = tuple(
        ev.RoundMember(node=f"n{i}", incarnation="i1", addr="10.0.0.1", nproc=1, first_rank=i)
        for i in range(nodes)
    )
    step_s, restored = 0.5, None
    for r in range(1, rounds + 1):
        start = (r - 1) * span + 1.0
        yield ev.RoundCompleted(
            **ev.envelope(JOB, "master:m1", start, "round", r),
            epoch=1,
            round=r,
            members=members,
            world_size=nodes,
            master_addr="10.0.0.1",
            master_port=29500,
            restore_step=restored,
        )
        for i in range(nodes):
            yield ev.WorkersStarted(
                **ev.node_envelope(JOB, f"n{i}", "i1", start + 1, "started", r),
                round=r,
                ranks=(i,),
                pids=(1000 + i,),
            )
        first_step, first_at = (restored or 0) + 1, start + 3
        t = start + 5
        while t < start + span - 2:
            for i in range(nodes):
                at = t + i / 1000
                step = first_step + int((at - first_at) / step_s)
                yield ev.TrainingProgress(
                    **ev.node_envelope(JOB, f"n{i}", "i1", at, "progress", r, step),
                    round=r,
                    step=step,
                    at=at,
                    first_step=first_step,
                    first_at=first_at,
                )
            t += 5
        last = first_step + int((t - 5 - first_at) / step_s)
        restored = max(0, last - int(rollback_s / step_s))
        yield ev.WorkerExited(
            **ev.node_envelope(JOB, "n0", "i1", start + span - 1, "exited", r),
            round=r,
            rank=0,
            local_rank=0,
            exit_code=-9,
            kind=ev.FailureKind.KILLED,
            reason="killed by SIGKILL",
        )


def fold(ledger: gp.Ledger, a: argparse.Namespace) -> float:
    started = time.perf_counter()
    for e in events(a.nodes, a.hours, a.rounds, a.rollback_s):
        ledger.add(e)
    return time.perf_counter() - started


def measure(make: Callable[[], gp.Ledger], a: argparse.Namespace) -> dict[str, Any]:
    ledger = make()
    fold_s = fold(ledger, a)
    started = time.perf_counter()
    report = gp.report(ledger, now=a.hours * 3600 + 10)
    report_s = time.perf_counter() - started
    points = sum(len(r.points) for r in ledger.rounds.values())
    encoded = gp.encode(ledger)  # what a master's snapshot carries of it
    del ledger
    tracemalloc.start()
    traced = make()
    fold(traced, a)
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return {
        "points": points,
        "mib": round(held / 2**20, 2),
        "snapshot_bytes": len(encoded),
        "snapshot_bytes_compressed": len(zlib.compress(encoded, 1)),
        "fold_s": round(fold_s, 2),
        "report_s": round(report_s, 4),
        "goodput": round(report.goodput, 5),
        "seconds": {b.value: round(s, 2) for b, s in report.seconds.items() if s},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--rollback-s", type=float, default=60.0)
    a = p.parse_args()
    reports = a.nodes * int(a.hours * 3600 / 5)
    every = measure(lambda: gp.Ledger(point_gap_s=0.0, max_points=0, open_rounds=0), a)
    thinned = measure(lambda: gp.Ledger(open_rounds=0), a)
    closed = measure(gp.Ledger, a)
    print(
        json.dumps(
            {
                "nodes": a.nodes,
                "hours": a.hours,
                "rounds": a.rounds,
                "rollback_s": a.rollback_s,
                "progress_reports": reports,
                "every": every,
                "thinned": thinned,
                "closed": closed,
                # thinned against every, closed against thinned (its baseline)
                "mib_ratio": round(thinned["mib"] / every["mib"], 4),
                "report_s_ratio": round(thinned["report_s"] / every["report_s"], 4),
                "goodput_difference": round(abs(thinned["goodput"] - every["goodput"]), 6),
                "closed_mib_ratio": round(closed["mib"] / thinned["mib"], 4),
                "closed_snapshot_ratio": round(
                    closed["snapshot_bytes"] / thinned["snapshot_bytes"], 4
                ),
                "closed_report_s_ratio": round(closed["report_s"] / thinned["report_s"], 4),
                "closed_goodput_difference": round(abs(closed["goodput"] - thinned["goodput"]), 6),
            }
        )
    )


if __name__ == "__main__":
    main()
