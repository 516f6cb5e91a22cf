"""Publish and consume rates through rove's bus client beside bare nats-py, in one run.

Both sides do the same work per event: msgpack-encode it and publish it with a
`Nats-Msg-Id` header (sync: one request per event; pipelined: windows of
`publish_async`), or consume all of a job's stored events with an ordered
callback consumer and decode each. rove adds validation against the subject,
retries inside a deadline and dead-lettering. Each figure is the median of
`--repeats` runs, alternating which side goes first. Prints one JSON line with
`publish_overhead_ratio` etc. = rove time / bare time (1.0 = no overhead).

    python benchmarks/bus_throughput.py [--events 20000] [--sync-events 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import nats.aio.client
import nats.aio.msg
from nats.js.api import Header

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.process import logs
from rove.control.process.aio import run as run_async


def events(job: str, n: int) -> list[ev.Event]:
    return [
        ev.NodeJoined(
            job=job,
            id=f"{job}:{i}",
            producer="agent:n1",
            ts=1e9 + i,
            node=f"n{i % 64}",
            host="h",
            pid=i,
            incarnation="i1",
        )
        for i in range(n)
    ]


async def timed(fn: Callable[[], Awaitable[None]]) -> float:
    t = time.perf_counter()
    await fn()
    return time.perf_counter() - t


class Sides:
    def __init__(self, bus: Bus, nc: nats.aio.client.Client) -> None:
        self.bus = bus
        self.js = nc.jetstream(publish_async_max_pending=4000)
        self.run = 0

    def job(self, side: str, what: str) -> str:
        self.run += 1
        return f"{what}-{side}-{self.run}"

    async def rove_sync(self, n: int) -> float:
        batch = events(self.job("rove", "sync"), n)

        async def go() -> None:
            for e in batch:
                await self.bus.publish(e)

        return await timed(go)

    async def bare_sync(self, n: int) -> float:
        batch = events(self.job("bare", "sync"), n)

        async def go() -> None:
            for e in batch:
                await self.js.publish(
                    subjects.subject_for(e), ev.encode(e), headers={Header.MSG_ID.value: e.id}
                )

        return await timed(go)

    async def rove_pipelined(self, n: int) -> tuple[float, str]:
        job = self.job("rove", "pipe")
        batch = events(job, n)

        async def go() -> None:
            for i in range(0, n, 2000):
                await self.bus.publish_many(batch[i : i + 2000])

        return await timed(go), job

    async def bare_pipelined(self, n: int) -> tuple[float, str]:
        job = self.job("bare", "pipe")
        batch = events(job, n)

        async def go() -> None:
            for i in range(0, n, 2000):
                futs = [
                    await self.js.publish_async(
                        subjects.subject_for(e), ev.encode(e), headers={Header.MSG_ID.value: e.id}
                    )
                    for e in batch[i : i + 2000]
                ]
                await asyncio.gather(*(asyncio.wait_for(f, 30) for f in futs))

        return await timed(go), job

    async def rove_consume(self, job: str) -> float:
        async def go() -> None:
            got: list[object] = []
            feed = await self.bus.subscribe(
                subjects.EVENTS_STREAM, subjects.job_events(job), got.append, got.append
            )
            await feed.caught_up.wait()
            await feed.stop()

        return await timed(go)

    async def bare_consume(self, job: str, n: int) -> float:
        async def go() -> None:
            done = asyncio.Event()
            got: list[object] = []

            async def cb(msg: nats.aio.msg.Msg) -> None:
                got.append(ev.decode(msg.data))
                if len(got) == n:
                    done.set()

            sub = await self.js.subscribe(
                subjects.job_events(job),
                stream=subjects.EVENTS_STREAM,
                cb=cb,
                ordered_consumer=True,
            )
            await done.wait()
            await sub.unsubscribe()

        return await timed(go)


async def main(n: int, n_sync: int, repeats: int) -> dict[str, object]:
    logs.configure("warning")
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedServer(Path(tmp) / "nats")
        url = server.start()
        bus = await Bus.connect(BusOptions(url=url))
        nc = await nats.connect(url)
        s = Sides(bus, nc)
        r: dict[str, list[float]] = {k: [] for k in ("rs", "bs", "rp", "bp", "rc", "bc")}
        try:
            for i in range(repeats):
                order = (0, 1) if i % 2 == 0 else (1, 0)
                for side in order:
                    if side == 0:
                        r["rs"].append(await s.rove_sync(n_sync))
                        t, rjob = await s.rove_pipelined(n)
                        r["rp"].append(t)
                    else:
                        r["bs"].append(await s.bare_sync(n_sync))
                        t, bjob = await s.bare_pipelined(n)
                        r["bp"].append(t)
                for side in order:
                    if side == 0:
                        r["rc"].append(await s.rove_consume(rjob))
                    else:
                        r["bc"].append(await s.bare_consume(bjob, n))
        finally:
            await nc.close()
            await bus.close()
            server.stop()
    m = {k: statistics.median(v) for k, v in r.items()}
    return {
        "benchmark": "bus_throughput",
        "events": n,
        "sync_events": n_sync,
        "repeats": repeats,
        "rove_sync_publish_per_s": round(n_sync / m["rs"]),
        "bare_sync_publish_per_s": round(n_sync / m["bs"]),
        "rove_pipelined_publish_per_s": round(n / m["rp"]),
        "bare_pipelined_publish_per_s": round(n / m["bp"]),
        "rove_consume_per_s": round(n / m["rc"]),
        "bare_consume_per_s": round(n / m["bc"]),
        "publish_overhead_ratio": round(m["rs"] / m["bs"], 3),
        "pipelined_publish_overhead_ratio": round(m["rp"] / m["bp"], 3),
        "consume_overhead_ratio": round(m["rc"] / m["bc"], 3),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--events", type=int, default=20_000)
    p.add_argument("--sync-events", type=int, default=3_000)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    sys.stdout.write(json.dumps(run_async(main(a.events, a.sync_events, a.repeats))) + "\n")
