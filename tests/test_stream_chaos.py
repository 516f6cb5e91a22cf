"""Exactly once relative to the checkpointed model, for a Kafka stream, through failures.

The online example (examples/online.py) trains a 2 nodes x 2 workers DDP job on a
click stream that its producer writes into librdkafka's mock cluster while the job
runs; `rove kafka-bridge` cuts the topic into shards, two `rove master`s lease them,
and every step is a flash checkpoint with the stream's offset vector in it. While
records stream in, the chaos kills (kill -9) a random worker, the leading master,
a whole agent (the job goes on with one node, then grows back to two) and the
bridge, in an order and at times drawn from the seed. Every rank logs the
(partition, offset) of each record it trained, with the step: in the lineage of
the final model (a restored round discards the steps after the one it restored),
every produced offset appears exactly once.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import time
from pathlib import Path

import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.master import streams
from tests.kafkamock import ClickStream
from tests.lineage import lineage, rows
from tests.support import (
    ROOT,
    BridgeProc,
    CliProc,
    MasterProc,
    RunProc,
    chaos_seeds,
    eventually,
    finished,
    fold_records,
    pid_alive,
    stored_events,
)

# the job's own end is bounded (with a diagnosis) by `finished`, inside this
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = ROOT / "examples" / "online.py"
RECORDS, RATE = 2400, 60.0
JOB = "stream-chaos"
GROUP = "online-dashboard"


def trained(trace: Path) -> int:
    """Records trained so far, over every round (an estimate of progress)."""
    return sum(len(r.get("samples", ())) for r in rows(trace))


async def leader(bus: Bus) -> str:
    elected = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.MasterElected)
    ]
    return elected[-1].master if elected else ""


@pytest.mark.parametrize("seed", chaos_seeds(21))
async def test_every_produced_offset_once_through_worker_agent_master_and_bridge_kills(
    bus: Bus, tmp_path: Path, seed: int
) -> None:
    rnd = random.Random(seed)
    actions = ["worker", "master", "agent", "bridge"]
    rnd.shuffle(actions)
    at = sorted(rnd.sample(range(RECORDS // 10, RECORDS * 7 // 10, 50), len(actions)))
    await chaos(bus, tmp_path, seed, list(zip(actions, at, strict=True)))


async def test_a_stream_scales_from_two_nodes_to_one_and_back(bus: Bus, tmp_path: Path) -> None:
    """One agent dies a quarter into the stream: the job goes on with one node, the agent
    comes back and the job grows to two nodes again, still exactly once."""
    # (the second half of the stream is written once the node is back: a busy machine
    # took 30 s from the kill to the node's return, by when a stream written at a fixed
    # rate had ended, and the job had finished on one node during the last call)
    worlds = await chaos(bus, tmp_path, 7, [("agent", RECORDS // 4)], held=RECORDS // 2)
    assert 2 in worlds and worlds[-1] == 4, f"scaled 4 -> 2 -> 4 ranks: {worlds}"


def group_offsets(bootstrap: str, partitions: list[int]) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": GROUP})
    try:
        got = consumer.committed([TopicPartition("clicks", p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in got}
    finally:
        consumer.close()


async def mirrored_the_committed_checkpoint(bus: Bus, bootstrap: str) -> None:
    """The consumer group holds the offset vector of the job's committed step, which
    trails what the lineage trained; the status has the freshness of the training."""
    state = fold_records(await stored_events(bus, JOB), JOB)
    stream = state.data.streams.streams["clicks"]
    vector = streams.committed(stream, state.ckpt.committed)
    assert vector is not None, "a step committed, and its offsets were saved with it"
    assert sum(o for _, o in vector.offsets) > 0
    await eventually(
        lambda: group_offsets(bootstrap, list(stream.next)) == dict(vector.offsets), timeout=30
    )
    assert streams.freshness(stream) is not None


async def joined_or_ended(bus: Bus, node: str, since: float) -> str:
    """ "joined" once `node` asked to join a round after `since`, "ended" once the job
    ended first, "" before either."""
    for r in await stored_events(bus, JOB):
        e = r.event
        if isinstance(e, ev.RdzvJoined) and e.node == node and e.ts >= since:
            return "joined"
        if isinstance(e, ev.JobEnded) and e.ts >= since:
            return "ended"
    return ""


async def chaos(
    bus: Bus, tmp_path: Path, seed: int, plan: list[tuple[str, int]], held: int = 0
) -> list[int]:
    """Run the job while the stream is produced (`RATE` records a second), doing each
    (action, at records trained) of `plan`; check the lineage; return the world size of
    each round. The last `held` records are written once every action is done (the job
    cannot end before them)."""
    rnd = random.Random(seed)
    trace = tmp_path / "trace.jsonl"
    stream = ClickStream(tmp_path, RECORDS - held, RATE)
    masters = {
        m: MasterProc(bus.url, JOB, m, tmp_path, "--node-timeout", "4") for m in ("m1", "m2")
    }
    await eventually(lambda: leader(bus), timeout=30)

    def bridge(name: str) -> BridgeProc:
        return BridgeProc(
            bus.url,
            JOB,
            name,
            tmp_path,
            *("--bootstrap", stream.bootstrap, "--topic", "clicks", "--shard-records", "24"),
            *("--linger", "0.5", "--poll", "0.25", "--group", GROUP),
        )

    def agent(node: str, name: str) -> RunProc:
        return RunProc(
            tmp_path,
            name,
            *("--nats", bus.url, "--job", JOB, "--node-id", node, "--local-addr", "127.0.0.1"),
            *("--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "30"),
            *("--heartbeat-interval", "0.5", "--last-call-timeout", "1"),
            *("--checkpoint-dir", str(tmp_path / "ckpt")),
            *("--kafka-bootstrap", stream.bootstrap, "--kafka-topic", "clicks"),
            str(SCRIPT),
            "train",
            *("--records", str(RECORDS), "--batch-size", "8", "--step-sleep", "0.05"),
            *("--trace", str(trace)),
            env={"ROVE_SHM_DIR": str(tmp_path / "shm")},  # killed agents leave slots behind
        )

    bridges = [bridge("b1")]
    nodes = {"na": agent("na", "na-1"), "nb": agent("nb", "nb-1")}
    everyone: list[CliProc] = [*nodes.values()]
    done_actions = []
    late: set[str] = set()
    try:
        for action, when in plan:
            await eventually(lambda w=when: trained(trace) >= w, timeout=240)
            latest = max(r["round"] for r in rows(trace))
            if action == "worker":
                pids = sorted({r["pid"] for r in rows(trace) if r["round"] == latest})
                victim = rnd.choice([p for p in pids if pid_alive(p)] or pids)
                os.kill(victim, signal.SIGKILL)
            elif action == "master":
                name = await leader(bus)
                masters[name].kill()
                fresh = f"m{len(masters) + 1}"
                masters[fresh] = MasterProc(bus.url, JOB, fresh, tmp_path, "--node-timeout", "4")
            elif action == "bridge":
                bridges[-1].kill()
                bridges.append(bridge(f"b{len(bridges) + 1}"))
            else:
                node = rnd.choice(sorted(nodes))
                nodes[node].kill()
                # the job goes on with one node; then the node comes back
                await eventually(
                    lambda seen=latest: max(r["round"] for r in rows(trace)) > seen, timeout=120
                )
                back = time.time()
                nodes[node] = agent(node, f"{node}-2")
                everyone.append(nodes[node])
                # Under load the job can finish on the other node before this one joins
                # again; it would then wait for the job's next run, which no master
                # serves (they stop with the job). Such a node came back too late.
                outcome = await eventually(
                    lambda n=node, t=back: joined_or_ended(bus, n, t), timeout=120
                )
                if outcome == "ended":
                    nodes[node].stop()
                    late.add(node)
            done_actions.append(action)
        if held:
            await stream.more(held, RATE)
        procs = [*everyone, *masters.values(), *bridges]
        codes = await finished(bus, JOB, {n: p for n, p in nodes.items() if n not in late}, procs)
        assert set(codes.values()) == {0}, {n: p.log()[-3000:] for n, p in nodes.items()}
    finally:
        for p in [*everyone, *bridges]:
            p.stop()
        for m in masters.values():
            m.stop()

    assert done_actions == [a for a, _ in plan]
    assert stream.produced(), "the producer wrote every record"
    shards = [
        s
        for r in await stored_events(bus, JOB)
        if isinstance(r.event, ev.StreamShardsAdded)
        for s in r.event.shards
    ]
    produced = {(s.partition, o) for s in shards for o in range(s.start, s.end)}
    assert len(produced) == RECORDS, f"the bridges cut {len(produced)} of {RECORDS} records"
    count = collections.Counter(lineage(trace))
    assert set(count) == produced, f"missing: {sorted(produced - set(count))[:10]}"
    repeated = {k: n for k, n in count.items() if n > 1}
    assert not repeated, f"trained more than once in the lineage: {list(repeated.items())[:10]}"
    if {"worker", "agent"} & set(done_actions):
        restored = [
            r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.DataRestored)
        ]
        assert any(e.step for e in restored), "a round resumed the stream from a checkpoint"
    await mirrored_the_committed_checkpoint(bus, stream.bootstrap)
    by_round = {r["round"]: r["world"] for r in rows(trace) if "world" in r}
    return [by_round[k] for k in sorted(by_round)]
