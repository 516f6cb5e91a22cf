"""Records per second through rove's stream path, beside a bare Kafka consumer, and freshness.

A librdkafka mock cluster (a real Kafka-protocol server on loopback) lives in
this process; a real nats-server, a real `rove master` and a real
`rove kafka-bridge` per topic run beside it.

1. Throughput, for two workloads:
   - *click*: JSON click events as `examples/online.py` produces them, decoded
     as its trainer does (`json.loads`, two tensors): the ratio that matters;
   - *raw*: `--value-bytes` of filler per record, decoded into one tensor: the
     worst case, where rove's fixed cost per record weighs most.
   For each, records are produced on 4 partitions first. Then, alternating,
   `--repeats` times:
   - *bare*: one `confluent_kafka.Consumer`, assigned every partition from the
     start (no group), reads them all in batches, decodes each record and
     stacks batches of `--batch-size`, in this process;
   - *rove*: `rove kafka-bridge` (its own process, as deployed) cuts the topic
     into shards, and has published them when the clock starts (as in a running
     job, where it follows the stream); the master (its own process too) leases
     them, and a `StreamIterable` reads exactly the leased
     ranges, decodes with the same function and hands batches of `--batch-size`
     to the loop, acknowledging each shard; with `--loader-workers` 0 (in this
     process, like the bare consumer), and again with 2 DataLoader workers.
   Each repeat streams a fresh topic, so every side reads the same records from
   the broker. A ratio is the median of rove's records/s after its first batch
   over the median of bare records/s (start-up is reported apart);
   `overhead_us_per_record` is what rove adds to each record, whatever the decode.
2. Freshness. Click records are produced at `--rate` a second for `--seconds`,
   each stamped by the broker; the rove loop notes, for every record it
   receives, now minus the produce time. p50 and p99 of that.

Prints one JSON line with `records_per_s`, `bare_records_per_s`, `ratio` (the
click workload), `ratio_raw`, `freshness_p50_s`, `freshness_p99_s`, and the runs
they came from.

    python benchmarks/streaming.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from common import job_master, wait_for
from confluent_kafka import Consumer, Producer, TopicPartition
from torch.utils.data._utils.collate import default_collate

from rove.control.process import logs

JOB = "bench-stream"
PARTITIONS = 4


def quiet(name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


def click_value(rnd: random.Random) -> bytes:
    """A click event as examples/online.py produces it."""
    x = [rnd.gauss(0, 1) for _ in range(8)]
    return json.dumps({"x": x, "click": int(rnd.random() < 0.5), "t": time.time()}).encode()


def decode_click(value: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    """What examples/online.py's trainer does with a record."""
    row = json.loads(value)
    return torch.tensor(row["x"], dtype=torch.float32), torch.tensor(
        [float(row["click"])], dtype=torch.float32
    )


def decode_raw(value: bytes) -> torch.Tensor:
    """The least a pipeline does with a record: its bytes as a feature tensor."""
    return torch.frombuffer(bytearray(value), dtype=torch.uint8).float()


class Workload(NamedTuple):
    name: str
    records: int
    value: Callable[[random.Random], bytes]
    decode: Callable[[bytes], Any]


def workloads(args: argparse.Namespace) -> list[Workload]:
    filler = b"x" * args.value_bytes
    # the mock cluster keeps about 4 MB per partition (older records are deleted, as
    # retention would): each workload's records stay whole on 4 partitions
    return [
        Workload("click", args.click_records, click_value, decode_click),
        Workload("raw", args.records, lambda _rnd: filler, decode_raw),
    ]


def produce(
    producer: Producer, topic: str, n: int, value: Callable[[random.Random], bytes]
) -> None:
    rnd = random.Random(0)
    for i in range(n):
        record = value(rnd)
        while True:
            try:
                producer.produce(topic, record, partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.01)
    if producer.flush(120):
        raise RuntimeError("the mock cluster did not take every record in 120 s")


def bare(
    bootstrap: str, topic: str, n: int, batch_size: int, decode: Callable[[bytes], Any]
) -> float:
    """Seconds for one consumer to read all `n` records of `topic`, decoding each and
    collating them into batches of `batch_size`, as a hand-written input loop would."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "bench-bare",
            "enable.auto.commit": False,
            "auto.offset.reset": "error",  # records the mock deleted: fail, never skip
            "logger": quiet("bench.bare"),
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    started, got, batch = time.perf_counter(), 0, []
    while got < n:
        if time.perf_counter() - started > 120:
            raise RuntimeError(f"the bare consumer read {got} of {n} records in 120 s")
        for msg in consumer.consume(num_messages=1000, timeout=1.0):
            if msg.error() is not None:
                raise RuntimeError(f"the bare consumer failed: {msg.error()}")
            batch.append(decode(msg.value() or b""))
            if len(batch) == batch_size or got + len(batch) == n:
                default_collate(batch)  # type: ignore[no-untyped-call]
                got += len(batch)
                batch = []
    elapsed = time.perf_counter() - started
    consumer.close()
    return elapsed


class BridgeProcess:
    """`rove kafka-bridge` for `topic`, its own process as deployed (not a thread of the
    reading process, which a real trainer never shares with it); ready once it has
    published shards."""

    def __init__(self, url: str, bootstrap: str, topic: str, args: argparse.Namespace) -> None:
        self.log = Path(args.tmp) / f"bridge-{topic}.log"
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "rove.control.cli.main", "kafka-bridge"),
                *("--job", JOB, "--nats", url, "--bootstrap", bootstrap, "--topic", topic),
                *("--id", f"bench-{topic}", "--shard-records", str(args.shard_records)),
                *("--linger", "0.05", "--poll", "0.05"),
            ],
            stdout=open(self.log, "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            env={**os.environ, "ROVE_LOG_LEVEL": "info"},
        )

    def wait_published(self) -> None:
        def published() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the bridge exited: {self.log.read_text()[-2000:]}")
            return "published" in self.log.read_text()

        wait_for(published, 120, "the bridge's first shards")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def rove_read(
    url: str,
    bootstrap: str,
    topic: str,
    n: int,
    args: argparse.Namespace,
    *,
    decode: Callable[[bytes], Any],
    loader_workers: int,
    fresh: bool,
    ready: Callable[[], None] = lambda: None,
) -> tuple[float, float, list[float]]:
    """(seconds to the first batch, seconds for the rest) for rove's stream path to deliver
    `n` records of `topic` to the loop, decoded and batched, and (with `fresh`) the age
    of each record produced after the bridge was `ready` when it arrived."""
    from rove.shard_service.stream import StreamIterable

    def parse(record: Any) -> Any:  # what the bare consumer does with a record
        return decode(record.value or b"")

    def parse_stamped(record: Any) -> Any:  # and the produce time, for freshness
        return (decode(record.value or b""), record.ts)

    bridge = BridgeProcess(url, bootstrap, topic, args)
    bridge.wait_published()  # as in a running job: the bridge has caught up
    since = time.time()
    ready()
    data = StreamIterable(
        topic,
        bootstrap=bootstrap,
        topic=topic,
        decode=parse_stamped if fresh else parse,
        nats=url,
        job=JOB,
        node="bench",
        rank=0,
        round=1,
    )
    ages: list[float] = []
    try:
        started, got = time.perf_counter(), 0
        loader = data.loader(batch_size=args.batch_size, num_workers=loader_workers, lockstep=False)
        first = 0.0
        for batch in loader:
            if not got:
                first = time.perf_counter()
            if fresh:
                sample, stamps = batch
                now = time.time()
                ages.extend(now - float(t) for t in stamps if t >= since)
            else:
                sample = batch
            got += len(sample[0] if isinstance(sample, list | tuple) else sample)
            if got >= n:
                break
        ended = time.perf_counter()
    finally:
        data.close()
        bridge.stop()
    return first - started, ended - first, ages


def throughput(
    w: Workload, r: int, url: str, bootstrap: str, producer: Producer, args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """One repeat of workload `w` on a fresh topic per side: seconds (start-up, rest)."""
    sides = ["bare", "rove", "rove2"] if r % 2 == 0 else ["rove2", "rove", "bare"]
    out: dict[str, tuple[float, float]] = {}
    for side in sides:
        topic = f"{w.name}-{side}-{r}"
        produce(producer, topic, w.records, w.value)
        if side == "bare":
            out[side] = (0.0, bare(bootstrap, topic, w.records, args.batch_size, w.decode))
        else:
            startup, rest, _ = rove_read(
                url,
                bootstrap,
                topic,
                w.records,
                args,
                decode=w.decode,
                loader_workers=0 if side == "rove" else 2,
                fresh=False,
            )
            out[side] = (startup, rest)
    return out


def summary(w: Workload, runs: list[dict[str, tuple[float, float]]], batch: int) -> dict[str, Any]:
    def rate(side: str) -> float:
        rest = statistics.median(run[side][1] for run in runs)
        # rove: after the first batch (the start-up is reported on its own)
        return (w.records - (batch if side != "bare" else 0)) / rest

    bare_rate, rove_rate, rove2_rate = rate("bare"), rate("rove"), rate("rove2")
    return {
        "records_per_s": round(rove_rate),
        "bare_records_per_s": round(bare_rate),
        "ratio": round(rove_rate / bare_rate, 3),
        "records_per_s_2_loader_workers": round(rove2_rate),
        "ratio_2_loader_workers": round(rove2_rate / bare_rate, 3),
        "overhead_us_per_record": round(1e6 / rove_rate - 1e6 / bare_rate, 2),
        "startup_s": round(statistics.median(run["rove"][0] for run in runs), 3),
        "records": w.records,
        "rove_s": [round(run["rove"][1], 3) for run in runs],
        "rove2_s": [round(run["rove2"][1], 3) for run in runs],
        "bare_s": [round(run["bare"][1], 3) for run in runs],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--click-records", type=int, default=30_000)
    p.add_argument("--records", type=int, default=100_000, help="raw workload")
    p.add_argument("--value-bytes", type=int, default=100, help="raw workload")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--shard-records", type=int, default=4096)
    p.add_argument("--rate", type=float, default=2000.0, help="freshness: records per second")
    p.add_argument("--seconds", type=float, default=10.0, help="freshness: how long")
    args = p.parse_args()
    logs.configure(level="WARNING")
    producer = Producer(
        {
            "test.mock.num.brokers": 1,
            "logger": quiet("bench.mock"),
            "linger.ms": 5,
            "queue.buffering.max.messages": 1_000_000,
        }
    )
    meta = producer.list_topics(timeout=10)
    bootstrap = ",".join(f"{b.host}:{b.port}" for b in meta.brokers.values())
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp, job_master(Path(tmp), JOB) as (url, _):
        args.tmp = tmp
        for w in workloads(args):
            runs = [throughput(w, r, url, bootstrap, producer, args) for r in range(args.repeats)]
            results[w.name] = summary(w, runs, args.batch_size)
        # freshness: click records produced at a steady rate while rove reads them
        # (after one record per partition, which the bridge publishes when it is up)
        n = int(args.rate * args.seconds)
        produce(producer, "fresh", PARTITIONS, click_value)
        feeder = threading.Thread(target=steady, args=(producer, "fresh", n, args.rate))
        _, _, ages = rove_read(
            url,
            bootstrap,
            "fresh",
            n + PARTITIONS,
            args,
            decode=decode_click,
            loader_workers=0,
            fresh=True,
            ready=feeder.start,
        )
        feeder.join()
    click, raw = results["click"], results["raw"]
    q = statistics.quantiles(ages, n=100)
    print(
        json.dumps(
            {
                "records_per_s": click["records_per_s"],
                "bare_records_per_s": click["bare_records_per_s"],
                "ratio": click["ratio"],
                "ratio_raw": raw["ratio"],
                "overhead_us_per_record": click["overhead_us_per_record"],
                "freshness_p50_s": round(q[49], 3),
                "freshness_p99_s": round(q[98], 3),
                "workloads": results,
                "batch_size": args.batch_size,
                "shard_records": args.shard_records,
                "freshness_rate": args.rate,
                "targets": {"ratio": 0.8},
            }
        )
    )


def steady(producer: Producer, topic: str, n: int, rate: float) -> None:
    rnd = random.Random(1)
    began = time.time()
    for i in range(n):
        delay = began + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        producer.produce(topic, click_value(rnd), partition=i % PARTITIONS)
        producer.poll(0)
    producer.flush(30)


if __name__ == "__main__":
    main()
