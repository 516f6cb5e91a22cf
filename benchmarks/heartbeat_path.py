"""What one heartbeat costs the leader that reads it, by the path it is read through.

A real `nats-server`; a child process publishes `--rounds` rounds of `--nodes`
heartbeats (rove's event type and subjects, as the agents do: core NATS publishes
into the memory stream `ROVE_HB`) as fast as it can, while this process reads them
through one path, then the next path under the same load:

- `jetstream`: an ordered push consumer on the stream (`Bus.subscribe`), each message
  checked and decoded as any stored event (`records.read`);
- `core`: a core NATS subscription on the job's heartbeat subjects, each message
  decoded the same way (the stream still stores them: a master taking over reads the
  newest of every node from it, so they stay replayable).

- `core_lean`: the same subscription, each message decoded as a heartbeat only
  (`records.read_heartbeat`, the same checks);
- `core_raw`: the same, handed straight from the protocol parser (`rove.control.bus.live`: no
  `Msg`, queue or task switch per message), which is what the leader uses.

It prints one JSON line: per path the reader's CPU microseconds per heartbeat
(`<path>_us`), how many it got (a reader that falls behind gets fewer: the stream
keeps the newest of each node) and how long it took, and each path's ratio to
`jetstream`, the path before (`ratio`, `lean_ratio`, `raw_ratio`).

    python benchmarks/heartbeat_path.py [--nodes 25000] [--rounds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import sim_heartbeat
from nats.aio.msg import Msg

from rove.control.bus import records
from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.bus.natsclient import RoveNatsClient
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects

JOB = "hbpath"
NAME = "gke-training-pool-a100-highmem-8-{:05d}-7f9c2b1d"


async def _publish(url: str, nodes: int, rounds: int) -> None:
    bus = await Bus.connect(BusOptions(url=url, create_streams=False, name="hb-publisher"))
    for seq in range(1, rounds + 1):
        now = time.time()
        for i in range(nodes):
            node = NAME.format(i)
            hb = sim_heartbeat(JOB, node, "inc-" + "y" * 28, seq, now)
            await bus.nc.publish(subjects.heartbeat(JOB, node), ev.encode(hb))
            if i % 1000 == 0:
                await asyncio.sleep(0)
        await bus.nc.flush()
    await bus.close()


def _publisher(url: str, nodes: int, rounds: int) -> None:
    asyncio.run(_publish(url, nodes, rounds))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(
    url: str, args: argparse.Namespace, start: Callable[[Bus, Callable[[ev.Heartbeat], None]], Any]
) -> dict[str, float]:
    """Run one reading path (`start` subscribes it, calling `got()` per heartbeat)
    under one publisher's load; its CPU per heartbeat."""
    bus = await Bus.connect(BusOptions(url=url, create_streams=False, name="hb-reader"))
    count = 0
    done = asyncio.Event()
    last = NAME.format(args.nodes - 1)

    def got(hb: ev.Heartbeat) -> None:
        nonlocal count
        count += 1
        if hb.seq == args.rounds and hb.node == last:
            done.set()  # the last one sent: any not read by now were replaced, unread

    stop = await start(bus, got)
    proc = mp.Process(target=_publisher, args=(url, args.nodes, args.rounds))
    cpu0, t0 = _cpu(), time.monotonic()
    proc.start()
    await asyncio.wait_for(done.wait(), args.timeout)
    cpu, span = _cpu() - cpu0, time.monotonic() - t0
    proc.join()
    await stop()
    await bus.close()
    return {"us": round(cpu / max(count, 1) * 1e6, 2), "got": count, "s": round(span, 2)}


async def _jetstream(bus: Bus, got: Callable[[ev.Heartbeat], None]) -> Any:
    liveness: dict[str, ev.Event] = {}

    def on(rec: records.Recorded) -> None:
        assert isinstance(rec.event, ev.Heartbeat)
        liveness[rec.subject] = rec.event
        got(rec.event)

    feed = await bus.subscribe(
        subjects.HEARTBEAT_STREAM,
        subjects.job_heartbeats(JOB),
        on,
        lambda _rej: None,
        last_per_subject=True,
    )
    return feed.stop


async def _core(bus: Bus, got: Callable[[ev.Heartbeat], None]) -> Any:
    liveness: dict[str, ev.Event] = {}

    async def on(msg: Msg) -> None:
        item = records.read(subjects.HEARTBEAT_STREAM, 0, msg.subject, msg.data)
        if type(item) is records.Recorded and isinstance(item.event, ev.Heartbeat):
            liveness[msg.subject] = item.event
            got(item.event)

    sub = await bus.nc.subscribe(subjects.job_heartbeats(JOB), cb=on, pending_msgs_limit=-1)
    return sub.unsubscribe


async def _core_lean(bus: Bus, got: Callable[[ev.Heartbeat], None]) -> Any:
    liveness: dict[str, ev.Event] = {}

    async def on(msg: Msg) -> None:
        item = records.read_heartbeat(JOB, msg.subject, msg.data)
        if type(item) is ev.Heartbeat:
            liveness[msg.subject] = item
            got(item)

    sub = await bus.nc.subscribe(subjects.job_heartbeats(JOB), cb=on, pending_msgs_limit=-1)
    return sub.unsubscribe


async def _core_raw(bus: Bus, got: Callable[[ev.Heartbeat], None]) -> Any:
    liveness: dict[str, ev.Event] = {}

    async def on(subject: bytes, _reply: bytes, data: bytes, _headers: bytes | None) -> None:
        item = records.read_heartbeat(JOB, subject.decode(), data)
        if type(item) is ev.Heartbeat:
            liveness[item.node] = item
            got(item)

    nc = bus.nc
    assert isinstance(nc, RoveNatsClient)
    sub = await nc.subscribe(subjects.job_heartbeats(JOB))
    nc.raw_deliveries[sub._id] = on

    async def stop() -> None:
        nc.raw_deliveries.pop(sub._id, None)
        await sub.unsubscribe()

    return stop


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rove-hbpath-") as tmp:
        server = EmbeddedServer(Path(tmp) / "nats")
        url = server.start()
        try:
            setup = await Bus.connect(BusOptions(url=url))
            await setup.close()
            result: dict[str, Any] = {"nodes": args.nodes, "rounds": args.rounds}
            paths = (
                ("jetstream", _jetstream),
                ("core", _core),
                ("core_lean", _core_lean),
                ("core_raw", _core_raw),
            )
            for name, path in paths:
                for key, value in (await _measure(url, args, path)).items():
                    result[f"{name}_{key}"] = value
            result["ratio"] = round(result["core_us"] / result["jetstream_us"], 3)
            result["lean_ratio"] = round(result["core_lean_us"] / result["jetstream_us"], 3)
            result["raw_ratio"] = round(result["core_raw_us"] / result["jetstream_us"], 3)
            return result
        finally:
            server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=25_000, help="heartbeats per round (25,000)")
    p.add_argument("--rounds", type=int, default=8, help="rounds published (8)")
    p.add_argument("--timeout", type=float, default=300.0, help="the longest wait per path")
    args = p.parse_args()
    print(json.dumps(asyncio.run(run(args))), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
