"""Online learning from a Kafka click stream, exactly once relative to the checkpointed model.

Two parts. The producer writes a click stream whose pattern drifts (which
features make a user click turns slowly with time); `--mock` starts
librdkafka's mock cluster in the producer's process when there is no broker:

    python examples/online.py produce --mock --rate 200          # prints the bootstrap

The trainer learns from it continuously, under rove (the bridge that cuts the
topic into leased shards runs inside `rove run --standalone`):

    rove run --standalone --nproc-per-node 2 \\
        --kafka-bootstrap 127.0.0.1:PORT --kafka-topic clicks \\
        examples/online.py train

Each rank reads the offset ranges the master leases it (`StreamIterable`),
steps in lockstep with the others (a rank waiting for the stream takes
zero-size steps), and saves the model with the stream's offset vector in a
flash checkpoint every `--ckpt-every` steps: after a failure the ranks resume
exactly where the restored model stood. `rove status` shows per-partition lag
and how fresh the trained data is.

`train --records N` ends once the model's lineage has trained N records (0:
never). `--trace FILE` appends one JSON line per rank and step with the
(partition, offset) of every record trained in it: the tests rebuild the final
model's lineage from it and check that every produced record was trained
exactly once.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import math
import os
import random
import sys
import time
from typing import Any

FEATURES = 8


# --------------------------------------------------------------------------- producer


def truth(t: float, period_s: float) -> list[float]:
    """The weights that make a user click at time `t`: they turn a full circle in `period_s`."""
    angle = 2 * math.pi * t / period_s
    return [
        math.cos(angle) * math.cos(i) + math.sin(angle) * math.sin(3 * i) for i in range(FEATURES)
    ]


def click(rnd: random.Random, t: float, period_s: float) -> dict[str, Any]:
    x = [rnd.gauss(0, 1) for _ in range(FEATURES)]
    score = sum(w * v for w, v in zip(truth(t, period_s), x, strict=True))
    return {"x": x, "click": int(rnd.random() < 1 / (1 + math.exp(-3 * score))), "t": t}


def produce(args: argparse.Namespace) -> None:
    import logging

    from confluent_kafka import Producer

    quiet = logging.getLogger("online.librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    config: dict[str, Any] = {"logger": quiet, "linger.ms": 5}
    if args.mock:
        config["test.mock.num.brokers"] = 1
    else:
        config["bootstrap.servers"] = args.bootstrap
    producer = Producer(config)
    brokers = producer.list_topics(timeout=10).brokers.values()
    print(",".join(f"{b.host}:{b.port}" for b in brokers), flush=True)
    rnd = random.Random(args.seed)
    began, sent = time.time(), 0
    try:
        while args.records == 0 or sent < args.records:
            due = int((time.time() - began) * args.rate) + 1
            while sent < due and (args.records == 0 or sent < args.records):
                value = click(rnd, time.time(), args.drift_period)
                producer.produce(args.topic, json.dumps(value).encode(), key=str(sent).encode())
                sent += 1
            producer.poll(0)
            time.sleep(0.01)
        producer.flush(30)
        print(f"produced {sent} records", file=sys.stderr, flush=True)
        if args.mock:  # the mock cluster lives in this process: keep it for the trainer
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        producer.flush(5)


# --------------------------------------------------------------------------- trainer


def train(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from rove.agent.progress import report
    from rove.checkpoint.api import FlashCheckpointer
    from rove.shard_service.kafka import Record
    from rove.shard_service.stream import StreamIterable

    def decode(record: Record) -> tuple[torch.Tensor, torch.Tensor]:
        row = json.loads(record.value or b"")
        return torch.tensor(row["x"], dtype=torch.float32), torch.tensor(
            [float(row["click"])], dtype=torch.float32
        )

    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=dt.timedelta(seconds=120))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    data = StreamIterable(
        args.dataset or os.environ.get("ROVE_KAFKA_TOPIC", "clicks"),
        bootstrap=args.bootstrap or None,
        topic=args.topic or None,
        decode=decode,
    )
    flash = FlashCheckpointer(os.environ.get("ROVE_CKPT_DIR"))
    step, trained = 0, 0
    restored = flash.load()
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        data.load_state_dict(state["data"])
        trained = state["trained"]
    ddp = DistributedDataParallel(model) if world > 1 else model
    round_ = int(os.environ.get("ROVE_ROUND", "0"))
    trace = open(args.trace, "a") if args.trace else None  # noqa: SIM115 - kept open all run

    def log(row: dict[str, object]) -> None:
        if trace is not None:
            trace.write(
                json.dumps({"round": round_, "rank": rank, "pid": os.getpid(), **row}) + "\n"
            )
            trace.flush()

    log({"restored": step, "world": world, "trained": trained})
    if rank == 0:
        plural = "" if world == 1 else "s"
        print(
            f"online training on {world} worker{plural} from step {step}, "
            f"{trained} records trained ({flash.restored_from or 'fresh start'})",
            flush=True,
        )
    loss_fn = nn.BCEWithLogitsLoss()
    recent: collections.deque[float] = collections.deque(maxlen=200)  # hits before training
    losses: collections.deque[float] = collections.deque(maxlen=50)  # of steps with records
    loader = data.loader(batch_size=args.batch_size, num_workers=args.loader_workers)
    for batch in loader:
        step += 1
        x, y = batch if batch is not None else (torch.zeros(0, FEATURES), torch.zeros(0, 1))
        opt.zero_grad()
        out = ddp(x)
        loss = loss_fn(out, y) if len(x) else out.sum() * 0.0
        loss.backward()
        opt.step()
        if len(x):
            losses.append(loss.item())  # (an idle step, no record arrived, has no loss)
        recent.extend(((out.detach() > 0).float() == y).float().flatten().tolist())
        count = torch.tensor([len(x)])
        if world > 1:
            dist.all_reduce(count)
        trained += int(count.item())
        if args.step_sleep:
            time.sleep(args.step_sleep)
        report(step, samples=len(x))
        log({"step": step, "t": time.time(), "samples": loader.last_delivered if len(x) else []})
        if step % args.ckpt_every == 0:
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "trained": trained}
            flash.save(step, {**state, "data": data.state_dict()})
        if rank == 0 and step % 50 == 0 and recent:
            fresh = time.time() - data.newest_ts if data.newest_ts else float("nan")
            mean = f"{sum(losses) / len(losses):.3f}" if losses else "-"
            print(
                f"step {step}  loss {mean}  accuracy {sum(recent) / len(recent):.2f} "
                f"(last {len(recent)})  {trained} records  freshness {fresh:.1f}s",
                flush=True,
            )
        if args.records and trained >= args.records:  # the same on every rank: all-reduced
            break
    if rank == 0:
        print(f"done at step {step}: {trained} records trained", flush=True)
    data.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="part", required=True)
    pr = sub.add_parser("produce", help="write a drifting click stream to a topic")
    pr.add_argument("--bootstrap", default="127.0.0.1:9092")
    pr.add_argument("--mock", action="store_true", help="start librdkafka's mock cluster here")
    pr.add_argument("--topic", default="clicks")
    pr.add_argument("--rate", type=float, default=200.0, help="records per second")
    pr.add_argument("--records", type=int, default=0, help="stop after this many (0: never)")
    pr.add_argument("--drift-period", type=float, default=120.0, metavar="SECONDS")
    pr.add_argument("--seed", type=int, default=0)
    tr = sub.add_parser("train", help="learn from the stream (under rove run)")
    tr.add_argument("--bootstrap", default="", help="default: $ROVE_KAFKA_BOOTSTRAP")
    tr.add_argument("--topic", default="", help="default: $ROVE_KAFKA_TOPIC")
    tr.add_argument("--dataset", default="", help="the bridge's --dataset (default: the topic)")
    tr.add_argument("--records", type=int, default=0, help="end after this many (0: never)")
    tr.add_argument("--batch-size", type=int, default=16, help="per rank")
    tr.add_argument("--lr", type=float, default=0.1)
    tr.add_argument("--loader-workers", type=int, default=1)
    tr.add_argument("--ckpt-every", type=int, default=1)
    tr.add_argument("--step-sleep", type=float, default=0.0)
    tr.add_argument("--trace", default="")
    args = p.parse_args()
    if args.part == "produce":
        produce(args)
    else:
        if not args.dataset:
            args.dataset = args.topic
        train(args)


if __name__ == "__main__":
    main()
