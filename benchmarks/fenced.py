"""How a leading master should publish its fenced writes, on one server and on a 3-node
cluster, measured side by side in one run.

Every decision a leader writes is fenced on the job's election subject. Three ways to
publish a tick's worth of decisions (`--window` of them, e.g. the answers to waiting
data clients), `--writes` in all:

* `together_raw`: all of a tick's at once, no retry of a refusal (what the leader did
  before: a refusal ended the master);
* `together_retried`: all at once, with rove's retry policy (a refused write is sent
  again);
* `one_at_a_time`: each write after the previous one is acknowledged (what it does
  with its other decisions, whose order matters);
* `together_then_in_turn`: all at once, then those refused one at a time (what it does
  now with its answers to data clients).

For each: writes per second, and the writes the server refused at least once (10164,
"wrong last sequence" with no number: another write checked against the same subject
was being proposed). Prints one JSON line; the baseline is `together_raw`.

    python benchmarks/fenced.py [--writes 2000] [--window 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import nats.js.errors

from rove.control.bus.client import Bus, BusOptions, Fence
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.process import logs
from rove.control.process.aio import run as run_async

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support import Cluster  # the same 3-node cluster the tests start


def writes(job: str, n: int) -> list[ev.Event]:
    return [
        ev.NodeLost(
            **ev.decision_envelope(job, 1, "m1", time.time(), "lost", i),
            node=f"n{i}",
            incarnation="i1",
            last_seen=0.0,
            timeout_s=30.0,
        )
        for i in range(n)
    ]


async def run_way(bus: Bus, way: str, n: int, window: int) -> dict[str, float]:
    job = f"{way.replace('_', '-')}-{time.monotonic_ns()}"
    subject = subjects.master_elected(job)
    elected = ev.MasterElected(
        **ev.decision_envelope(job, 1, "m1", time.time(), "elected"), master="m1"
    )
    fence = Fence(subject, await bus.publish(elected, fence=Fence(subject, 0)))
    batch = writes(job, n)
    refused = 0
    started = time.perf_counter()
    for i in range(0, n, window):
        tick = batch[i : i + window]
        if way == "one_at_a_time":
            for w in tick:
                await bus.publish(w, fence=fence)
        elif way == "together_then_in_turn":
            outcomes = await asyncio.gather(
                *(bus.publish(w, fence=fence, busy_retried=False) for w in tick),
                return_exceptions=True,
            )
            for w, outcome in zip(tick, outcomes, strict=True):
                if isinstance(outcome, nats.js.errors.APIError):
                    refused += 1
                    await bus.publish(w, fence=fence)
        else:
            raws = await asyncio.gather(
                *(_raw(bus, w, fence) for w in tick), return_exceptions=True
            )
            for w, raw in zip(tick, raws, strict=True):
                if isinstance(raw, nats.js.errors.APIError):
                    refused += 1
                    if way == "together_retried":  # sent again, as rove's bus does
                        await bus.publish(w, fence=fence)
    elapsed = time.perf_counter() - started
    stored = n - refused if way == "together_raw" else n
    return {"writes_per_s": round(n / elapsed), "refused_once": refused, "stored": stored}


async def _raw(bus: Bus, w: ev.Event, fence: Fence) -> object:
    """One fenced publish, no retry."""
    return await bus.js.publish(
        subjects.subject_for(w), ev.encode(w), headers={"Nats-Msg-Id": w.id, **fence.headers()}
    )


async def shape(url: str, replicas: int, n: int, window: int) -> dict[str, object]:
    bus = await Bus.connect(BusOptions(url=url, replicas=replicas))
    try:
        out: dict[str, object] = {}
        for way in ("together_raw", "together_retried", "one_at_a_time", "together_then_in_turn"):
            out[way] = await run_way(bus, way, n, window)
        return out
    finally:
        await bus.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--window", type=int, default=8)
    args = p.parse_args()
    logs.configure(level="WARNING")
    result: dict[str, object] = {
        "benchmark": "fenced",
        "writes": args.writes,
        "window": args.window,
        "baseline": "together_raw",
    }
    with tempfile.TemporaryDirectory() as tmp:
        one = EmbeddedServer(Path(tmp) / "one")
        one.start()
        cluster = Cluster(Path(tmp) / "cluster")
        cluster.start()
        try:
            assert one.url is not None
            result["one_server"] = run_async(shape(one.url, 1, args.writes, args.window))
            result["cluster_r3"] = run_async(shape(cluster.url, 3, args.writes, args.window))
        finally:
            one.stop()
            cluster.stop()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
