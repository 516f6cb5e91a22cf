"""End-to-end run of rove's control plane on one machine, with a master failover.

What it does, printing each step:
  1. starts an embedded NATS JetStream server (its own, on a free port);
  2. starts two `rove master` processes for job `demo`: one leads, one stands by;
  3. three simulated agents join and heartbeat; one of them then goes silent;
  4. kills the leading master with SIGKILL; the standby takes over from the stream;
  5. the new leader declares the silent node lost; `rove status` and `rove events` show it all.

Run it with `make demo` (or `python examples/control_plane_demo.py`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.master.election import current_holder

JOB = "demo"
TTL = 3.0


def say(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def rove(*args: str, url: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "rove.control.cli.main", *args, "--job", JOB, "--nats", url],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


async def heartbeat(bus: Bus, node: str, silent: set[str]) -> None:
    seq = 0
    while True:
        if node not in silent:
            seq += 1
            await bus.publish(
                ev.Heartbeat(
                    job=JOB,
                    id=f"{node}:hb:{seq}",
                    producer=f"agent:{node}",
                    ts=time.time(),
                    node=node,
                    incarnation="demo",
                    seq=seq,
                    ranks=(
                        ev.RankStat(
                            rank=0,
                            local_rank=0,
                            pid=os.getpid(),
                            step=seq * 10,
                            samples_per_s=128.0,
                        ),
                    ),
                ),
                deadline_s=30,
            )
        await asyncio.sleep(0.5)


async def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="rove-demo-"))
    say(f"starting an embedded NATS JetStream server (store in {workdir})")
    server = EmbeddedServer(workdir / "nats")
    url = server.start()
    print(f"    NATS at {url}")
    bus = await Bus.connect(BusOptions(url=url, lease_ttl_s=TTL))
    masters = {}
    tasks: list[asyncio.Task[None]] = []
    try:
        say("starting two masters for job 'demo': one will lead, one will stand by")
        for name in ("master-a", "master-b"):
            log = (workdir / f"{name}.log").open("wb")
            masters[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rove.control.cli.main",
                    "master",
                    "--job",
                    JOB,
                    "--id",
                    name,
                    "--nats",
                    url,
                    "--node-timeout",
                    "3",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        kv, _ = await bus.lease_bucket()
        holder = None
        while holder is None:
            holder = await current_holder(kv, subjects.lease_key(JOB))
            await asyncio.sleep(0.1)
        leader = holder.master
        print(f"    {leader} holds the lease")

        say("three agents join and heartbeat")
        silent: set[str] = set()
        for node in ("node-1", "node-2", "node-3"):
            await bus.publish(
                ev.NodeJoined(
                    job=JOB,
                    id=f"{node}:joined",
                    producer=f"agent:{node}",
                    ts=time.time(),
                    node=node,
                    host="localhost",
                    pid=os.getpid(),
                    incarnation="demo",
                )
            )
            tasks.append(asyncio.create_task(heartbeat(bus, node, silent)))
        await asyncio.sleep(2)
        print(rove("status", url=url))

        say(f"node-3 goes silent, and the leading master ({leader}) is killed with SIGKILL")
        silent.add("node-3")
        masters[leader].send_signal(signal.SIGKILL)
        killed = time.time()

        new_leader = None
        while new_leader in (None, leader):
            h = await current_holder(kv, subjects.lease_key(JOB))
            new_leader = h.master if h else None
            await asyncio.sleep(0.1)
        print(
            f"    {new_leader} took the lease {time.time() - killed:.1f}s after the kill "
            f"(lease TTL {TTL:g}s); it rebuilt the job's state from the stream"
        )

        say("waiting for the new leader to declare node-3 lost")
        while "lost" not in rove("status", url=url):
            await asyncio.sleep(0.5)
        print(rove("status", url=url))
        say("the job's events (rove events --job demo)")
        print(rove("events", url=url))
        say("stopping the job (rove stop --job demo)")
        rove("stop", url=url)
        while "stopped" not in rove("status", url=url):
            await asyncio.sleep(0.2)
        print(rove("status", url=url).splitlines()[0])
        say("done: the control plane survived the loss of its leader and of a node")
    finally:
        for t in tasks:
            t.cancel()
        for p in masters.values():
            if p.poll() is None:
                p.terminate()
                p.wait(15)
        await bus.close()
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
