"""What fsyncing every event costs: rove's publishes with JetStream's default sync
(every 2 minutes) and with `sync_interval: always`, in one run, on this machine's disk.

Two embedded servers (one per policy), a rove `Bus` on each; alternating, `--repeats`
times: `--events` facts published one at a time (each waits for its acknowledgement,
as an agent's outbox does) and `--events` more pipelined in windows of 256
(`publish_many`, as a catch-up of buffered facts). Prints one JSON line with the rates
and `always_vs_default` ratios.

    python benchmarks/durability.py [--events 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.process import logs
from rove.control.process.aio import run as run_async


def facts(job: str, n: int) -> list[ev.Event]:
    return [
        ev.NodeJoined(
            **ev.node_envelope(job, "n0", "i1", float(i), "bench", i),
            host="bench",
            pid=i,
            nproc_per_node=1,
        )
        for i in range(n)
    ]


async def rates(bus: Bus, job: str, n: int) -> tuple[float, float]:
    one = facts(job + "a", n)
    began = time.perf_counter()
    for e in one:
        await bus.publish(e)
    sync = n / (time.perf_counter() - began)
    many = facts(job + "b", n)
    began = time.perf_counter()
    for i in range(0, n, 256):
        await bus.publish_many(many[i : i + 256])
    pipelined = n / (time.perf_counter() - began)
    return sync, pipelined


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    out: dict[str, list[tuple[float, float]]] = {"default": [], "always": []}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            policy: EmbeddedServer(Path(tmp) / policy, sync_always=policy == "always")
            for policy in out
        }
        buses = {}
        try:
            for policy, server in servers.items():
                buses[policy] = await Bus.connect(BusOptions(url=server.start()))
            for r in range(args.repeats):
                order = list(out) if r % 2 == 0 else list(reversed(out))
                for policy in order:
                    out[policy].append(await rates(buses[policy], f"b{r}", args.events))
        finally:
            for bus in buses.values():
                await bus.close()
            for server in servers.values():
                server.stop()
    med = {
        p: (statistics.median(s for s, _ in v), statistics.median(m for _, m in v))
        for p, v in out.items()
    }
    return {
        "default_sync_per_s": round(med["default"][0]),
        "always_sync_per_s": round(med["always"][0]),
        "always_vs_default_sync": round(med["always"][0] / med["default"][0], 3),
        "default_pipelined_per_s": round(med["default"][1]),
        "always_pipelined_per_s": round(med["always"][1]),
        "always_vs_default_pipelined": round(med["always"][1] / med["default"][1], 3),
        "events": args.events,
        "repeats": args.repeats,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    logs.configure(level="WARNING")
    print(json.dumps(run_async(main_async(args))))


if __name__ == "__main__":
    main()
