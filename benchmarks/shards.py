"""Shard lease throughput and latency against one master, and the sampler's overhead.

1. Leases: 1, 4 and 16 concurrent clients each loop for `--seconds`:
   request one shard, wait for the lease, acknowledge it in the next request
   (as the sampler does: one stored event per lease). Latency is from
   publishing the request to receiving the lease. A real `rove master`
   process and a real nats-server do the work; the clients share one
   connection in this process. `runs_acks_apart` is the same with each
   acknowledgement a stored event of its own (`shard_done`: two stored events
   per lease), in the same run.
2. Sampler overhead: the same small training loop over generated data, one
   epoch fed by a `DistributedSampler`, one fed by `ShardSampler` (leases
   from the master, acknowledgements, position tracking), alternating, the
   median of `--repeats` (7). The ratio is sharded time / plain time; the
   range of the paired ratios shows the machine's noise, and the CPU the
   sharded epoch adds (in the trainer, and in the master and nats-server that
   share its cores) shows where the time goes.

The leases are measured beside one CPU-bound process (a busy loop: a machine
whose training keeps a core busy), unless `--quiet-machine`.

Prints one JSON line: `runs` and `runs_acks_apart` (clients, leases_per_s, p50_ms, p99_ms),
`leases_beside`, `master_state` (the master's newest snapshot after the lease runs: the
shards done and how many it keeps one by one, its bytes and the time to pack and load
it, beside the same state with every done shard kept one by one, as before the done
floor), `sampler_overhead_ratio`, and the times it came from.

    python benchmarks/shards.py [--seconds 5] [--repeats 7] [--only leases|sampler]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

import immutables
import psutil
import torch
from common import cpu_bound_beside, job_master
from msgspec.structs import replace
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.process import logs
from rove.control.process.aio import run as run_async

JOB = "bench"


async def lease_run(
    bus: Bus, clients: int, seconds: float, dataset: str, acks_apart: bool = False
) -> dict[str, float]:
    spec = ev.DatasetSpec(size=5_000_000, shard_size=1)
    latencies: list[float] = []
    answers: dict[str, asyncio.Queue[ev.ShardLeased]] = {}
    feeds = []
    for c in range(clients):
        name = f"c{c}"
        answers[name] = asyncio.Queue()

        def on(rec, q=answers[name]):  # type: ignore[no-untyped-def]
            if isinstance(rec.event, ev.ShardLeased):
                q.put_nowait(rec.event)

        feeds.append(
            await bus.subscribe(
                subjects.ANSWER_STREAM,
                subjects.lease_answer(JOB, dataset, name),
                on,
                lambda rej: None,
            )
        )

    def env(client: str, n: int) -> dict[str, object]:
        return {"job": JOB, "id": f"{dataset}:{client}:{n}", "producer": client, "ts": time.time()}

    await bus.publish(
        ev.DatasetRegistered(**env("c0", 0), dataset=dataset, spec=spec, client="c0")  # type: ignore[arg-type]
    )

    sent: dict[str, int] = {}
    acks: list[asyncio.Future[int]] = []

    trained: dict[str, tuple[ev.ShardRef, ...]] = {}
    answered: dict[str, int] = {}

    async def client(name: str, stop: float) -> int:
        done = 0
        while True:
            n = sent[name] = sent.get(name, 0) + 2
            t = time.perf_counter()
            # as the sampler does: the shards trained since ride in the next request
            await bus.publish(
                ev.ShardRequested(
                    **env(name, n),  # type: ignore[arg-type]
                    dataset=dataset,
                    client=name,
                    request=n,
                    count=1,
                    node="bench",
                    done=trained.pop(name, ()),
                    answered=answered.get(name, 0),
                )
            )
            lease = await asyncio.wait_for(answers[name].get(), 30)
            latencies.append(time.perf_counter() - t)
            answered[name] = lease.request
            if not acks_apart:
                trained[name] = lease.shards
            else:  # one stored event each, while training goes on
                acks.append(
                    asyncio.ensure_future(
                        bus.publish(
                            ev.ShardDone(
                                **env(name, n + 1),  # type: ignore[arg-type]
                                dataset=dataset,
                                client=name,
                                shard=lease.shards[0],
                            )
                        )
                    )
                )
            done += 1
            if time.perf_counter() >= stop:
                return done

    await asyncio.gather(*(client(f"c{c}", 0.0) for c in range(clients)))  # one lease each: warm
    latencies.clear()
    started = time.perf_counter()
    stop = started + seconds
    counts = await asyncio.gather(*(client(f"c{c}", stop) for c in range(clients)))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*acks)
    for feed in feeds:
        await feed.stop()
    q = statistics.quantiles(latencies, n=100)
    return {
        "clients": clients,
        "leases": sum(counts),
        "leases_per_s": round(sum(counts) / elapsed, 1),
        "p50_ms": round(q[49] * 1000, 2),
        "p99_ms": round(q[98] * 1000, 2),
    }


def train_epoch(loader, model, opt) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    """(wall seconds, CPU seconds of this process) of one epoch."""
    started, cpu = time.perf_counter(), time.process_time()
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        opt.step()
    return time.perf_counter() - started, time.process_time() - cpu


def _cpu_s(pids: tuple[int, ...]) -> float:
    return sum(sum(psutil.Process(p).cpu_times()[:2]) for p in pids)


def sampler_overhead(url: str, repeats: int, others: tuple[int, ...]) -> dict[str, float]:
    """Epochs fed by DistributedSampler and by ShardSampler, alternating.

    Besides wall time it records where the sharded epoch's extra work goes: this
    process's CPU (the sampler, its bus thread), and the CPU of `others` (the
    master and the nats-server), which share the machine's cores with training.
    """
    from rove.shard_service import ShardSampler

    torch.manual_seed(0)
    n, batch = 8192, 64
    data = TensorDataset(torch.randn(n, 256), torch.randn(n, 1))
    hidden = 2048  # ~10 ms of compute per batch here: a small real job, not an empty loop
    model = torch.nn.Sequential(
        torch.nn.Linear(256, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    plain_s, sharded_s, startup_s = [], [], []
    plain_cpu, sharded_cpu, others_cpu = [], [], []
    for r in range(repeats):
        for side in ("plain", "sharded") if r % 2 == 0 else ("sharded", "plain"):
            if side == "plain":
                sampler: DistributedSampler[tuple[torch.Tensor, torch.Tensor]]
                sampler = DistributedSampler(data, num_replicas=1, rank=0, seed=r)
                loader = DataLoader(data, batch_size=batch, sampler=sampler)
                wall, cpu = train_epoch(loader, model, opt)
                plain_s.append(wall)
                plain_cpu.append(cpu)
            else:
                t = time.perf_counter()
                sharded = ShardSampler(
                    f"overhead{r}", n, batch_size=batch, shard_size=512, seed=r, nats=url, job=JOB
                )
                sharded.connect()  # once per process: its own NATS connection
                startup_s.append(time.perf_counter() - t)
                before = _cpu_s(others)
                wall, cpu = train_epoch(sharded.loader(data), model, opt)
                others_cpu.append(_cpu_s(others) - before)
                sharded_s.append(wall)
                sharded_cpu.append(cpu)
                sharded.close()
    plain, shard = statistics.median(plain_s), statistics.median(sharded_s)
    pairs = sorted(s / p for s, p in zip(sharded_s, plain_s, strict=True))
    return {
        "plain_epoch_s": round(plain, 3),
        "sharded_epoch_s": round(shard, 3),
        "startup_s": round(statistics.median(startup_s), 3),
        "ratio": shard / plain,
        "ratio_min": pairs[0],
        "ratio_max": pairs[-1],
        "trainer_cpu_extra_s": statistics.median(sharded_cpu) - statistics.median(plain_cpu),
        "master_and_server_cpu_s": statistics.median(others_cpu),
    }


async def leases(url: str, seconds: float, acks_apart: bool) -> list[dict[str, float]]:
    bus = await Bus.connect(BusOptions(url=url))
    tag = "apart" if acks_apart else ""
    try:
        return [await lease_run(bus, c, seconds, f"leases{tag}{c}", acks_apart) for c in (1, 4, 16)]
    finally:
        await bus.close()


async def master_state(url: str) -> dict[str, float]:
    """The master's newest snapshot after the lease runs: its size and the time to pack
    (encode, compress) and load (decompress, decode) it, beside the same state with every
    done shard kept one by one (as before the done floor: `*_one_by_one`)."""
    from rove.control.master import data, snapshots
    from rove.control.master.state import decode_state

    bus = await Bus.connect(BusOptions(url=url))
    try:
        loaded = await snapshots.load(bus, JOB)
    finally:
        await bus.close()
    assert loaded is not None, "the master wrote no snapshot"
    state = loaded.state
    sets = {
        name: replace(
            ds,
            done_floor=0,
            done=immutables.Map(
                {k: True for k in range(ds.done_floor)} | {k: True for k in ds.done}
            ),
        )
        for name, ds in state.data.datasets.items()
    }
    one_by_one = replace(state, data=replace(state.data, datasets=immutables.Map(sets)))

    def measure(s: object) -> tuple[int, float, float]:
        packs, loads = [], []
        for _ in range(5):
            t = time.perf_counter()
            size, packed = snapshots._pack(s, b"")  # type: ignore[arg-type]
            packs.append(time.perf_counter() - t)
            t = time.perf_counter()
            decode_state(zlib.decompress(packed))
            loads.append(time.perf_counter() - t)
        return size, statistics.median(packs), statistics.median(loads)

    size, pack_s, load_s = measure(state)
    size_before, pack_before, load_before = measure(one_by_one)
    return {
        "done_shards": sum(data.done_count(state.data, ds) for ds in state.data.datasets.values()),
        "done_kept_one_by_one": sum(len(ds.done) for ds in state.data.datasets.values()),
        "snapshot_bytes": size,
        "snapshot_bytes_one_by_one": size_before,
        "snapshot_bytes_ratio": round(size / size_before, 4),
        "pack_ms": round(pack_s * 1000, 2),
        "pack_ms_one_by_one": round(pack_before * 1000, 2),
        "load_ms": round(load_s * 1000, 2),
        "load_ms_one_by_one": round(load_before * 1000, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--quiet-machine",
        action="store_true",
        help="leases without the CPU-bound process beside them (the target is with it)",
    )
    p.add_argument(
        "--nats-sync",
        choices=("always", "default"),
        default="always",
        help="the server fsyncs every message (rove's embedded default) or every 2 minutes",
    )
    p.add_argument(
        "--only", choices=("leases", "sampler"), help="one of the two measurements (default both)"
    )
    args = p.parse_args()
    logs.configure(level="WARNING")
    level = os.environ.get("BENCH_MASTER_LOG", "warning")
    with (
        tempfile.TemporaryDirectory() as tmp,
        job_master(Path(tmp), JOB, level, sync_always=args.nats_sync == "always") as (url, pids),
    ):
        time.sleep(1.0)  # the master starts; the first request waits for its election
        # the sampler first, while the master holds only its dataset (as a training
        # job's master does), then the lease runs (which leave ~50,000 done shards)
        overhead = None
        if args.only != "leases":
            overhead = sampler_overhead(url, args.repeats, tuple(pids))
        runs, apart, beside, master = [], [], "nothing", {}
        if args.only != "sampler":
            with cpu_bound_beside(not args.quiet_machine) as beside:
                runs = run_async(leases(url, args.seconds, acks_apart=False))
                apart = run_async(leases(url, args.seconds, acks_apart=True))
            master = run_async(master_state(url))
    result: dict[str, object] = {
        "runs": runs,
        "runs_acks_apart": apart,
        "leases_beside": beside,
        "master_state": master,
        "nats_sync": args.nats_sync,
        "targets": {"leases_per_s": 2000, "p99_ms": 20, "sampler_overhead_ratio": 1.03},
    }
    if overhead is not None:
        result.update(
            {
                "sampler_overhead_ratio": round(overhead["ratio"], 4),
                "plain_epoch_s": overhead["plain_epoch_s"],
                "sharded_epoch_s": overhead["sharded_epoch_s"],
                "sampler_startup_s": overhead["startup_s"],
                "sampler_ratio_range": [
                    round(overhead["ratio_min"], 4),
                    round(overhead["ratio_max"], 4),
                ],
                "sampler_trainer_cpu_extra_s": round(overhead["trainer_cpu_extra_s"], 3),
                "sampler_master_and_server_cpu_s": round(overhead["master_and_server_cpu_s"], 3),
            }
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
