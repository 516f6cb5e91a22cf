"""How fast a fresh master rebuilds a job's state from the stream.

Publishes N events of one job to an embedded JetStream server, then measures
the time for a fresh replica (the master's state-rebuilding part) to be ready:
  - full: no snapshot, replaying all N events;
  - shared: the full replay again, with another job of the same size sharing
    the stream (half the messages are someone else's);
  - snapshot: from a snapshot taken at N - tail, replaying only the tail.
Also the time from starting a `MasterRunner` to its first decision-ready
leadership with the snapshot, and, in the same run, the rate at which bare
nats-py delivers the same stored messages to an empty callback (the floor any
nats-py consumer sits on). Prints one JSON line.

    python benchmarks/master_recovery.py --events 100000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import nats

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.master import snapshots
from rove.control.master.evolve import evolve
from rove.control.master.replica import Replica
from rove.control.master.runner import MasterRunner
from rove.control.master.state import encode_state, initial
from rove.control.process import logs
from rove.control.process.aio import run as run_async

JOB = "bench"


def workload(n: int, nodes: int = 512, job: str = JOB) -> list[ev.Event]:
    """Node churn: joins and leaves of `nodes` nodes, n events in all."""
    out: list[ev.Event] = []
    for i in range(n):
        node = f"n{i % nodes}"
        inc = f"i{i // (2 * nodes)}"
        common: ev.Envelope = {
            "job": job,
            "id": f"{job}:{i}",
            "producer": f"agent:{node}",
            "ts": 1e9 + i,
        }
        if (i // nodes) % 2 == 0:
            out.append(ev.NodeJoined(**common, node=node, host="h", pid=i, incarnation=inc))
        else:
            out.append(ev.NodeLeft(**common, node=node, incarnation=inc, reason="churn"))
    return out


async def rebuild(url: str, use_snapshot: bool) -> tuple[float, Replica]:
    bus = await Bus.connect(BusOptions(url=url, create_streams=False))
    started = time.perf_counter()
    replica = Replica(bus, JOB, use_snapshot=use_snapshot)
    await replica.start()
    elapsed = time.perf_counter() - started
    await replica.stop()
    await bus.close()
    return elapsed, replica


async def nats_py_floor(url: str, n: int) -> float:
    """Messages/s of a bare nats-py ordered consumer with an empty callback."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    done = asyncio.Event()
    count = 0

    async def cb(_msg: object) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    started = time.perf_counter()
    sub = await js.subscribe(f"rove.ev.{JOB}.>", stream="ROVE_EVENTS", cb=cb, ordered_consumer=True)
    await done.wait()
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    await nc.close()
    return n / elapsed


async def main(n: int, tail: int) -> dict[str, object]:
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(Path(tmp) / "nats")
        url = server.start()
        try:
            bus = await Bus.connect(BusOptions(url=url))
            batch = workload(n)
            t0 = time.perf_counter()
            for i in range(0, n, 5000):
                await bus.publish_many(batch[i : i + 5000], deadline_s=120)
            publish_s = time.perf_counter() - t0

            floor = await nats_py_floor(url, n)
            full_s, full = await rebuild(url, use_snapshot=False)
            assert full.state.applied_seq == n and full.state.counters.events == n

            other = workload(n, job=f"{JOB}-other")
            for i in range(0, n, 5000):
                await bus.publish_many(other[i : i + 5000], deadline_s=120)
            shared_s, shared = await rebuild(url, use_snapshot=False)
            assert shared.state == full.state, "another job's events change nothing"

            # Snapshot at n - tail, so the snapshot path replays `tail` events.
            prefix_state = initial(JOB)
            for seq, e in enumerate(batch[: n - tail], start=1):
                prefix_state = evolve(prefix_state, e, seq)
            await snapshots.save(bus, prefix_state, master="bench", now=time.time())
            snap_s, snapped = await rebuild(url, use_snapshot=True)
            assert snapped.state == full.state, "snapshot + tail == full replay"

            runner_bus = await Bus.connect(BusOptions(url=url, create_streams=False))
            t0 = time.perf_counter()
            runner = MasterRunner(runner_bus, JOB, "bench-master", ev.JobSpec(), tick_s=0.01)
            task = asyncio.create_task(runner.run())
            while runner.role != "leader":
                await asyncio.sleep(0.001)
            leader_s = time.perf_counter() - t0
            runner.stop()
            await task
            await runner_bus.close()

            await bus.close()
        finally:
            server.stop()
    return {
        "benchmark": "master_recovery",
        "events": n,
        "tail_events": tail,
        "publish_s": round(publish_s, 3),
        "ready_s_full": round(full_s, 3),
        "ready_s_snapshot": round(snap_s, 3),
        "leader_s_snapshot": round(leader_s, 3),
        "replay_events_per_s": round(n / full_s),
        "replay_events_per_s_shared_stream": round(n / shared_s),
        "nats_py_floor_msgs_per_s": round(floor),
        "replay_vs_nats_py_floor": round((n / full_s) / floor, 3),
        "snapshot_bytes": len(encode_state(prefix_state)),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument(
        "--tail", type=int, default=1000, help="events after the snapshot (default 1000)"
    )
    a = p.parse_args()
    sys.stdout.write(json.dumps(run_async(main(a.events, a.tail))) + "\n")
