"""What one job's control plane costs as the cluster grows: a real `nats-server`
(default settings: 1 MiB max_payload), a leader and a standby `rove master`, and N
simulated agents.

The agents are simulated, many per process in several processes, with rove's own
event types, subjects and client: each process joins its nodes (`node_joined`,
`rdzv_joined`), heartbeats every one of them at the agents' default interval (1 s
up to 25,000 nodes, then longer: `rove.agent.heartbeat.interval_for`;
as core NATS publishes into the heartbeat stream, which is what the server stores
of an agent's acknowledged one), reports checkpoints (`ckpt_in_memory`,
`ckpt_persisted`) and finishes the workers (`workers_succeeded`). The benchmark
waits for what the leader decides, and prints one JSON line per N with:

- `leader_cores`, `standby_cores`, `leader_rss_mib`, `standby_rss_mib`: over a
  window of steady heartbeats after the round formed;
- `round_s`: from the last node's join to the full round;
- `lost_one_s` and `lost_tenth_s`: from a node (then 10% of the nodes) falling
  silent to the round without it, with `node_timeout_s` beside them;
- `commit_s`: from the first checkpoint report to `ckpt_committed` of N nodes
  (`commit_sent_s`: until the simulator had sent the N reports, acknowledged);
- `failover_s`: from the leader's SIGKILL to the standby's `master_elected`, with
  `lease_ttl_s` beside it;
- `restart_ready_s`: a master started afresh (a `Replica`) until it has loaded the
  newest snapshot and replayed the tail after it (`restart_tail_events`), which is
  what a restarted `rove master` does before it stands by; `restart_leader_ready_s`
  the same and the newest heartbeat of every node read, as a master taking over
  does; `restart_snapshot_s` the snapshot alone (`snapshot_bytes`, encoded);
- `finish_s`: from the first `workers_succeeded` to `job_ended` (`finish_sent_s`:
  until the simulator had sent them);
- `fold_wave_s`: folding a wave of N `workers_succeeded` and of N `ckpt_persisted`
  in one process (the pure fold, no bus);
- `largest_msg_bytes`: the largest message on the job's subjects.

    python benchmarks/scale.py --nodes 1000,5000,10000 [--procs 3] [--node-timeout 10]

On a 2-core machine the simulator shares the cores with the server and both
masters; where it is the limit the JSON says so (`sim_cores`, and `hb_rate` the
heartbeats per second the simulator reached against the `hb_target`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from common import sim_heartbeat

from rove.agent.heartbeat import interval_for
from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.master import snapshots
from rove.control.master.evolve import evolve
from rove.control.master.replica import Replica
from rove.control.master.state import encode_state, initial

JOB = "scale"
NAME = "gke-training-pool-a100-highmem-8-{:05d}-7f9c2b1d"  # a long, Kubernetes-like name
NPROC = 8


def node_name(i: int) -> str:
    return NAME.format(i)


# ---------------------------------------------------------------------------- simulator


def _fact(node: str, ts: float, *parts: object) -> dict[str, Any]:
    return dict(ev.node_envelope(JOB, node, "inc1", ts, *parts))


async def _sim(
    url: str, first: int, count: int, total: int, every_s: float, conn: Connection
) -> None:
    """Agents `first`..`first+count-1`: joins, heartbeats, and what `conn` asks."""
    bus = await Bus.connect(BusOptions(url=url, create_streams=False, name=f"sim-{first}"))
    nodes = list(range(first, first + count))
    silent: set[int] = set()
    params = ev.RdzvParams(min_nodes=1, max_nodes=total, last_call_s=2.0, max_restarts=100)
    loop = asyncio.get_running_loop()
    sent = 0

    async def heartbeats() -> None:
        nonlocal sent
        seq = 0
        while True:
            started = time.monotonic()
            seq += 1
            now = time.time()
            for i in nodes:
                if i in silent:
                    continue
                node = node_name(i)
                hb = sim_heartbeat(JOB, node, "inc1", seq, now)
                await bus.nc.publish(subjects.heartbeat(JOB, node), ev.encode(hb))
                sent += 1
            await bus.nc.flush()
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - started)))

    beat = asyncio.create_task(heartbeats())
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        now = time.time()
        if cmd == "join":
            await bus.publish_many(
                ev.NodeJoined(
                    **_fact(node_name(i), now, "joined"), host="h", pid=i, nproc_per_node=NPROC
                )
                for i in nodes
            )
            await bus.publish_many(
                ev.RdzvJoined(
                    **_fact(node_name(i), now, "rdzv", now),
                    addr=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}",
                    nproc_per_node=NPROC,
                    ports=(29500,),
                    params=params,
                )
                for i in nodes
            )
        elif cmd == "silence":
            silent.update(i for i in arg if first <= i < first + count)
        elif cmd == "ckpt":
            rnd, step, members = arg
            live = [i for i in nodes if i not in silent]
            await bus.publish_many(
                ev.CkptPersisted(
                    **_fact(node_name(i), now, "persisted", step, rnd),
                    step=step,
                    ranks=tuple(range(rank0, rank0 + NPROC)),
                    world_size=world,
                    location="/ckpt",
                    round=rnd,
                )
                for i, rank0, world in _ranks(live, members)
            )
        elif cmd == "succeed":
            rnd = arg
            await bus.publish_many(
                ev.WorkersSucceeded(**_fact(node_name(i), now, "succeeded", rnd), round=rnd)
                for i in nodes
                if i not in silent
            )
        elif cmd == "sent":
            pass
        elif cmd == "stop":
            beat.cancel()
            await bus.close()
            conn.send(("stopped", sent))
            return
        conn.send(("ok", sent))


def _ranks(live: list[int], members: dict[int, tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(node index, its first rank, world size) of each live member of the round."""
    return [(i, *members[i]) for i in live if i in members]


def _sim_main(
    url: str, first: int, count: int, total: int, every_s: float, conn: Connection
) -> None:
    asyncio.run(_sim(url, first, count, total, every_s, conn))


# ---------------------------------------------------------------------------- measuring


class Cpu:
    """CPU seconds and RSS of a process, from /proc."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.TICK

    def rss_mib(self) -> float:
        pages = int(Path(f"/proc/{self.pid}/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class Watch:
    """The leader's decisions as they arrive, and the largest message on the job."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.rounds: list[tuple[float, ev.RoundCompleted]] = []
        self.commits: list[tuple[float, int]] = []
        self.elected: list[tuple[float, str]] = []
        self.ended: float | None = None
        self.largest = 0
        self.largest_subject = ""

    async def start(self) -> None:
        async def size(msg: Any) -> None:
            if len(msg.data) > self.largest:
                self.largest, self.largest_subject = len(msg.data), msg.subject

        await self.bus.nc.subscribe(f"{subjects.EVENTS_ROOT}.{JOB}.>", cb=size)
        await self.bus.nc.subscribe(f"{subjects.SNAPSHOT_ROOT}.{JOB}", cb=size)
        await self.bus.subscribe(
            subjects.EVENTS_STREAM, subjects.master(JOB, ">"), self._on, lambda _r: None
        )

    def _on(self, rec: Any) -> None:
        now = time.monotonic()
        match rec.event:
            case ev.RoundCompleted():
                self.rounds.append((now, rec.event))
            case ev.CkptCommitted(step=step):
                self.commits.append((now, step))
            case ev.MasterElected(master=master):
                self.elected.append((now, master))
            case ev.JobEnded():
                self.ended = now

    async def until(self, check: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            await asyncio.sleep(0.02)
        raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f} s")


def fold_wave_s(n: int) -> dict[str, float]:
    """Folding a wave of n `workers_succeeded` and of n `ckpt_persisted` (no bus)."""
    state, seq = initial(JOB), 0

    def fold(e: ev.Event) -> None:
        nonlocal state, seq
        seq += 1
        state = evolve(state, e, seq)

    now = time.time()
    envelope = ev.decision_envelope(JOB, 1, "m", now, "elected")
    fold(ev.MasterElected(**envelope, master="m"))
    members = tuple(
        ev.RoundMember(
            node=node_name(i),
            incarnation="inc1",
            addr="10.0.0.1",
            nproc=NPROC,
            first_rank=NPROC * i,
        )
        for i in range(n)
    )
    for i in range(n):
        fold(ev.NodeJoined(**_fact(node_name(i), now, "j"), host="h", pid=i, nproc_per_node=NPROC))
    fold(
        ev.RoundCompleted(
            **ev.decision_envelope(JOB, 1, "m", now, "round", 1),
            round=1,
            members=members,
            world_size=NPROC * n,
            master_addr="10.0.0.1",
            master_port=29500,
        )
    )
    persisted = [
        ev.CkptPersisted(
            **_fact(node_name(i), now, "p", 10),
            step=10,
            ranks=tuple(range(NPROC * i, NPROC * i + NPROC)),
            world_size=NPROC * n,
            location="/c",
            round=1,
        )
        for i in range(n)
    ]
    succeeded = [ev.WorkersSucceeded(**_fact(node_name(i), now, "s"), round=1) for i in range(n)]
    out = {}
    for name, wave in (("ckpt_persisted", persisted), ("workers_succeeded", succeeded)):
        started = time.perf_counter()
        for e in wave:
            fold(e)
        out[name] = round(time.perf_counter() - started, 3)
    return out


def master_proc(
    url: str, master_id: str, folder: Path, args: argparse.Namespace
) -> subprocess.Popen[bytes]:
    logs = Path(args.logs) if args.logs else folder
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{master_id}-{args.current}.log"
    return subprocess.Popen(
        [
            *(sys.executable, "-m", "rove.control.cli.main", "master"),
            *("--job", JOB, "--id", master_id, "--nats", url),
            *("--node-timeout", str(args.node_timeout), "--lease-ttl", str(args.lease_ttl)),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "ROVE_LOG_LEVEL": "info" if args.logs else "warning"},
    )


async def measure(n: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    server = EmbeddedServer(folder / "nats")
    server.start()
    assert server.url is not None and server.proc is not None
    url = server.url
    bus = await Bus.connect(BusOptions(url=url, name="scale-bench"))
    watch = Watch(bus)
    await watch.start()
    leader = master_proc(url, "m1", folder, args)
    await watch.until(lambda: watch.elected, 60, "the first master's election")
    standby = master_proc(url, "m2", folder, args)
    procs = max(1, min(args.procs, n))
    conns: list[Connection] = []
    sims: list[mp.Process] = []
    share = -(-n // procs)
    for p in range(procs):
        first, count = p * share, min(share, n - p * share)
        ours, theirs = mp.Pipe()
        proc = mp.Process(
            target=_sim_main, args=(url, first, count, n, args.heartbeat_s, theirs), daemon=True
        )
        proc.start()
        conns.append(ours)
        sims.append(proc)

    def ask(cmd: str, arg: Any = None) -> list[int]:
        for c in conns:
            c.send((cmd, arg))
        return [c.recv()[1] for c in conns]

    result: dict[str, Any] = {"nodes": n, "procs": procs, "node_timeout_s": args.node_timeout}
    result["lease_ttl_s"] = args.lease_ttl
    result["heartbeat_s"] = args.heartbeat_s
    try:
        joined_at = await asyncio.to_thread(lambda: (ask("join"), time.monotonic())[1])
        full = await watch.until(
            lambda: next((r for t, r in watch.rounds if len(r.members) == n), None),
            args.timeout,
            f"a round of {n} nodes",
        )
        result["round_s"] = round(next(t for t, r in watch.rounds if r is full) - joined_at, 3)
        # steady heartbeats: what the masters cost (the standby's start-up done)
        await asyncio.sleep(3.0)
        cpus = {"leader": Cpu(leader.pid), "standby": Cpu(standby.pid)}
        sim_cpu = [Cpu(p.pid) for p in sims if p.pid is not None]
        before = {k: c.seconds() for k, c in cpus.items()}
        sim_before, sent_before = sum(c.seconds() for c in sim_cpu), sum(ask("sent"))
        t0 = time.monotonic()
        await asyncio.sleep(args.window)
        span = time.monotonic() - t0
        for k, c in cpus.items():
            result[f"{k}_cores"] = round((c.seconds() - before[k]) / span, 3)
            result[f"{k}_rss_mib"] = round(c.rss_mib(), 1)
        result["sim_cores"] = round((sum(c.seconds() for c in sim_cpu) - sim_before) / span, 3)
        result["hb_rate"] = round((sum(ask("sent")) - sent_before) / span)
        result["hb_target"] = round(n / args.heartbeat_s)

        members = {
            int(m.node.rsplit("-", 2)[1]): (m.first_rank, full.world_size) for m in full.members
        }
        t0 = time.monotonic()
        await asyncio.to_thread(ask, "ckpt", (full.round, 10, members))
        result["commit_sent_s"] = round(time.monotonic() - t0, 3)  # the simulator's share
        await watch.until(
            lambda: any(s == 10 for _, s in watch.commits), args.timeout, "the commit"
        )
        result["commit_s"] = round(next(t for t, s in watch.commits if s == 10) - t0, 3)

        async def lose(victims: list[int], what: str) -> float:
            names = {node_name(i) for i in victims}
            size = len(watch.rounds[-1][1].members)
            t0 = time.monotonic()
            await asyncio.to_thread(ask, "silence", victims)
            await watch.until(
                lambda: any(
                    t > t0 and len(r.members) == size - len(names) for t, r in watch.rounds
                ),
                args.node_timeout * 3 + args.timeout,
                f"the round without {what}",
            )
            return round(next(t for t, r in watch.rounds if t > t0) - t0, 3)

        result["lost_one_s"] = await lose([n - 1], "one node")
        tenth = list(range(0, n - 1, 10))
        result["lost_tenth_s"] = await lose(tenth, f"{len(tenth)} nodes")

        # the leader now (a busy leader may have lost the lease before: said in `elections`)
        result["elections_before_failover"] = len(watch.elected)
        now_leading = watch.elected[-1][1]
        victim, heir = (leader, standby) if now_leading == "m1" else (standby, leader)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        await watch.until(
            lambda: any(t > t0 for t, _ in watch.elected), args.timeout, "the standby's election"
        )
        result["failover_s"] = round(next(t for t, _ in watch.elected if t > t0) - t0, 3)
        result["new_leader_rss_mib"] = round(Cpu(heir.pid).rss_mib(), 1)

        # a master restarted now: ready to stand by once it has loaded the snapshot and
        # the tail (as `rove master` does), ready to lead once it has read the newest
        # heartbeat of every node too (what a standby does when it takes over)
        t0 = time.monotonic()
        loaded = await snapshots.load(bus, JOB)
        result["restart_snapshot_s"] = round(time.monotonic() - t0, 3)
        result["snapshot_bytes"] = len(encode_state(loaded.state)) if loaded is not None else 0
        for key, heartbeats in (("restart_ready_s", False), ("restart_leader_ready_s", True)):
            t0 = time.monotonic()
            replica = Replica(bus, JOB, heartbeats=heartbeats)
            await replica.start()
            result[key] = round(time.monotonic() - t0, 3)
            result["restart_tail_events"] = replica.state.applied_seq - replica.snapshot_seq
            await replica.stop()

        rnd = watch.rounds[-1][1].round
        t0 = time.monotonic()
        await asyncio.to_thread(ask, "succeed", rnd)
        result["finish_sent_s"] = round(time.monotonic() - t0, 3)
        await watch.until(lambda: watch.ended, args.timeout, "the job's end")
        assert watch.ended is not None
        result["finish_s"] = round(watch.ended - t0, 3)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(ask, "stop")
        for sim in sims:
            sim.join(10)
            if sim.is_alive():
                sim.kill()
        for m in (leader, standby):
            if m.poll() is None:
                m.kill()
            m.wait(10)
        await bus.close()
        server.stop()
    result["largest_msg_bytes"] = watch.largest
    result["largest_msg_subject"] = watch.largest_subject.replace(f".{JOB}.", ".<job>.")
    result["fold_wave_s"] = fold_wave_s(n)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--nodes", default="1000,5000,10000", help="comma-separated N (default 1000,5000,10000)"
    )
    p.add_argument("--procs", type=int, default=2, help="simulator processes (default 2)")
    p.add_argument("--node-timeout", type=float, default=10.0, help="the masters' --node-timeout")
    p.add_argument(
        "--heartbeat-s",
        type=float,
        default=None,
        help="the agents' heartbeat interval (default: rove run's for N nodes)",
    )
    p.add_argument("--lease-ttl", type=float, default=6.0, help="the masters' --lease-ttl")
    p.add_argument(
        "--window", type=float, default=10.0, help="seconds of steady heartbeats measured"
    )
    p.add_argument("--timeout", type=float, default=120.0, help="the longest wait for one step")
    p.add_argument("--logs", help="keep the masters' logs (at info level) in this folder")
    args = p.parse_args()
    interval = args.heartbeat_s
    for n in (int(x) for x in args.nodes.split(",")):
        args.current = n
        args.heartbeat_s = interval or interval_for(n, args.node_timeout)
        with tempfile.TemporaryDirectory(prefix="rove-scale-") as tmp:
            try:
                row = asyncio.run(measure(n, args, Path(tmp)))
            except TimeoutError as exc:
                row = {"nodes": n, "error": str(exc)}
                for log in Path(tmp).glob("m*.log"):
                    sys.stderr.write(f"--- {log.name}\n{log.read_text()[-3000:]}\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
