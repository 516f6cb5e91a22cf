"""A peer replica's transfer: rove's channel against asyncio streams, side by side.

One rank's flash checkpoint of --size-mb in real shared memory goes from this process
(a node's agent) to a holder in another process (a peer's agent), verified there, then
comes back into a slot of a fresh engine (a replacement node's restore). Timed:

- `put_s`: the sender copying the step out of shared memory and sending it, until the
  holder answered that it verified and kept it (the median of --rounds steps);
- `fetch_s`: asking the holder for it, until it is verified in the slot.

Cases: `rove` (`rove.agent.replicas`: the event loop's socket calls, straight out of and
into the buffers, reused), `streams` (the baseline, the transport rove had before:
asyncio streams, a 16 MiB reader buffer, 4 MiB writes, a fresh buffer each time, the
fetch installed into the slot after it arrived; its copies out of and into shared
memory are today's, `rove.checkpoint.memcopy`, so the two differ by their transport
only). The slots live in /dev/shm, as a node's do. --beside CPU-bound processes run
meanwhile (default 2: two trainers on this 2-core machine).

    python benchmarks/replica_channel.py [--size-mb 1024] [--beside 2]

Prints one JSON line with both cases and `put_ratio`/`fetch_ratio` (streams / rove).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

from rove.agent.facts import NodeFacts
from rove.agent.replicas import ReplicaSender, ReplicaServer, fetch_into
from rove.checkpoint import replica as wire
from rove.checkpoint.engine import FlashEngine
from rove.checkpoint.storage import copy_out
from rove.control.catalogue import events as ev

JOB = "bench-replica"
CHUNK = 4 << 20


class Dropped:
    """The holder's facts: `replica_stored` is not what this measures."""

    def put(self, event: ev.Event) -> None:
        pass

    async def flush(self, _timeout_s: float | None) -> bool:
        return True


# ---------------------------------------------------------------- the holders


async def serve_rove() -> None:
    server = ReplicaServer(
        NodeFacts(Dropped(), job=JOB, node="nb"),  # type: ignore[arg-type]
        "127.0.0.1",
        8 << 30,
        lambda _s, _r: None,
    )
    print(await server.start(), flush=True)
    await asyncio.Event().wait()


async def serve_streams() -> None:
    """The previous transport: asyncio streams, a fresh buffer per replica."""
    held: dict[int, tuple[wire.Offer, bytearray]] = {}

    async def body(r: asyncio.StreamReader) -> bytes:
        return await r.readexactly(wire.length(await r.readexactly(4)))

    async def one(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        op = await r.readexactly(4)
        raw = await body(r)
        if op == wire.PUT:
            offer = msgspec.json.decode(raw, type=wire.Offer)
            w.write(wire.answer_frame(wire.Answer(ok=True)))
            await w.drain()
            data, got = bytearray(offer.size), 0
            while got < offer.size:
                chunk = await r.read(min(CHUNK, offer.size - got))
                data[got : got + len(chunk)] = chunk
                got += len(chunk)
            problem = await asyncio.to_thread(wire.verify, offer, data)
            held[offer.step] = (offer, data)
            w.write(wire.answer_frame(wire.Answer(ok=not problem, error=problem)))
        else:
            want = msgspec.json.decode(raw, type=wire.Want)
            offer, data = held[want.step]
            w.write(wire.answer_frame(wire.Answer(ok=True, offer=offer)))
            w.write(data)
        await w.drain()
        w.close()

    server = await asyncio.start_server(one, "127.0.0.1", 0, limit=4 * CHUNK)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()


# ---------------------------------------------------------------- the senders


async def rove_case(engine: FlashEngine, port: int, a: argparse.Namespace) -> dict[str, Any]:
    sender = ReplicaSender(NodeFacts(Dropped(), job=JOB, node="na"), replicas=1)  # type: ignore[arg-type]
    members = [member("na", 0), member("nb", port)]
    sender.new_round(1, members, {0: engine})
    sending = asyncio.create_task(sender.run())
    puts = []
    for step in range(1, a.rounds + 1):
        save(engine, step, a.size_mb)
        began = time.perf_counter()
        sender.offer(step)
        while sender.sent.get("nb") != step:
            await asyncio.sleep(0.005)
        puts.append(time.perf_counter() - began)
    sending.cancel()
    fresh = FlashEngine(f"{JOB}-fresh", 0)
    want = wire.Want(job=JOB, source="na", step=a.rounds, rank=0)
    began = time.perf_counter()
    seals = []

    def land(offer: wire.Offer) -> list[memoryview]:
        meta, data, seal = fresh.receive(want.step, offer.meta_len, offer.data_len)
        seals.append(seal)
        return [meta, data]

    offer = await fetch_into("127.0.0.1", port, want, land)
    seals[0](offer.checksum)
    fetched = time.perf_counter() - began
    assert fresh.newest() is not None and fresh.newest().step == a.rounds  # type: ignore[union-attr]
    fresh.unlink()
    return {
        "put_s": round(statistics.median(puts), 3),
        "puts_s": rounded(puts),
        "fetch_s": round(fetched, 3),
    }


async def streams_case(engine: FlashEngine, port: int, a: argparse.Namespace) -> dict[str, Any]:
    async def answer(r: asyncio.StreamReader) -> wire.Answer:
        n = wire.length(await r.readexactly(4))
        return msgspec.json.decode(await r.readexactly(n), type=wire.Answer)

    puts = []
    for step in range(1, a.rounds + 1):
        save(engine, step, a.size_mb)
        began = time.perf_counter()
        slot = engine.slot_of(step)
        assert slot is not None
        m, raw = await asyncio.to_thread(copy_out, engine, slot, 0)
        offer = wire.Offer(
            job=JOB, source="na", round=1, step=step, rank=0, ranks=(0,),
            meta_len=m.meta_len, data_len=m.data_len, checksum=m.checksum,
        )  # fmt: skip
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=4 * CHUNK)
        w.write(wire.frame(wire.PUT, offer))
        await w.drain()
        assert (await answer(r)).ok
        view = memoryview(raw)
        for at in range(0, len(view), CHUNK):
            w.write(view[at : at + CHUNK])
            await w.drain()
        assert (await answer(r)).ok
        w.close()
        puts.append(time.perf_counter() - began)
    fresh = FlashEngine(f"{JOB}-fresh", 0)
    began = time.perf_counter()
    r, w = await asyncio.open_connection("127.0.0.1", port, limit=4 * CHUNK)
    w.write(wire.frame(wire.GET, wire.Want(job=JOB, source="na", step=a.rounds, rank=0)))
    await w.drain()
    got = (await answer(r)).offer
    assert got is not None
    data, n = bytearray(got.size), 0
    while n < got.size:
        chunk = await r.read(min(CHUNK, got.size - n))
        data[n : n + len(chunk)] = chunk
        n += len(chunk)
    w.close()
    assert not await asyncio.to_thread(wire.verify, got, data)
    await asyncio.to_thread(fresh.install, got.step, data, got.meta_len, got.checksum)
    fetched = time.perf_counter() - began
    fresh.unlink()
    return {
        "put_s": round(statistics.median(puts), 3),
        "puts_s": rounded(puts),
        "fetch_s": round(fetched, 3),
    }


def member(node: str, port: int) -> ev.RoundMember:
    return ev.RoundMember(
        node=node, incarnation="i", addr="127.0.0.1", nproc=1, first_rank=0, replica_port=port
    )


def save(engine: FlashEngine, step: int, size_mb: int) -> None:
    engine.save(step, {"w": torch.full((size_mb << 18,), float(step))})  # 4-byte floats


def rounded(xs: list[float]) -> list[float]:
    return [round(x, 3) for x in xs]


def case(kind: str, a: argparse.Namespace) -> dict[str, Any]:
    holder = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        engine = FlashEngine(f"{JOB}-{kind}", 0)
        try:
            run = rove_case if kind == "rove" else streams_case
            return asyncio.run(run(engine, port, a))
        finally:
            engine.unlink()
    finally:
        holder.kill()
        holder.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="steps sent in each case")
    p.add_argument("--beside", type=int, default=2, help="CPU-bound processes meanwhile")
    p.add_argument("--serve", choices=["rove", "streams"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        asyncio.run(serve_rove() if a.serve == "rove" else serve_streams())
        return
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.beside)
    ]
    try:
        memory = "/dev/shm" if Path("/dev/shm").is_dir() else None  # as a node's is
        with tempfile.TemporaryDirectory(prefix="rove-replica-channel-", dir=memory) as shm:
            os.environ["ROVE_SHM_DIR"] = shm
            streams = case("streams", a)
            rove = case("rove", a)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    size = a.size_mb << 20
    print(
        json.dumps(
            {
                "size_mb": a.size_mb,
                "beside": f"{a.beside} CPU-bound processes",
                "rove": {**rove, "put_mb_s": round(size / rove["put_s"] / 1e6)},
                "streams": {**streams, "put_mb_s": round(size / streams["put_s"] / 1e6)},
                "put_ratio": round(streams["put_s"] / rove["put_s"], 2),
                "fetch_ratio": round(streams["fetch_s"] / rove["fetch_s"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
