"""The agent's heartbeat: liveness, progress and resource use, every interval.

One `heartbeat` per interval on the node's subject of the heartbeat stream
(only the newest per node is kept). It carries the node's CPU and memory, and
for each worker its step, throughput (samples per second between two
heartbeats), CPU, memory and, on GPUs, memory and utilisation (pynvml), plus
fresh free ports the next round's store may use. A heartbeat that cannot be
sent is skipped: the next one supersedes it.

Heartbeats keep their interval while JetStream is slow to acknowledge them (a stream
electing its leader, a cluster restarting): each goes out as the tick comes, and its
acknowledgement is waited for beside the next ticks (at most `IN_FLIGHT` at once).
The leader hears them live either way; waiting for each acknowledgement before the
next tick made one heartbeat every interval plus 2 s exactly when a node's silence
is being judged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from rove.agent.facts import NodeFacts
from rove.agent.metrics import Sampler
from rove.agent.ports import free_ports
from rove.agent.runtime import WorkerRuntime
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import PublishDeadlineError
from rove.control.process import aio, metrics

log = structlog.get_logger("rove.agent")

#: Heartbeats a second a job is kept to when the interval is left to rove: a leader
#: folded 25,000 a second in 0.46 cores beside its server on a 2-core machine, and
#: 50,000 a second saturated it (docs/operations.md, "What a job of N nodes needs").
HEARTBEATS_PER_S = 25_000

#: heartbeats waiting for their acknowledgement at once; a tick with this many waiting
#: is skipped (the bus is away: its reconnection buffer would only hold stale ones)
IN_FLIGHT = 3


def interval_for(max_nodes: int, node_timeout_s: float) -> float:
    """The heartbeat interval when `--heartbeat-interval` is not given: 1 s up to
    25,000 nodes (`--nnodes MAX`), above that as long as keeps the job at 25,000
    heartbeats a second, and never over a fifth of the node timeout (nor under 1 s)."""
    adapted = max(1.0, max_nodes / HEARTBEATS_PER_S)
    return min(adapted, max(1.0, node_timeout_s / 5))


@dataclass
class _RankRate:
    samples: float = 0.0
    at: float = 0.0
    rate: float = 0.0
    step: int = 0
    busy_s: float = 0.0
    busy_per_step: float | None = None


class Heartbeat:
    """Builds and publishes this node's heartbeats.

    `where()` tells the current round and the first global rank of this
    node's workers (0 and 0 outside a round).
    """

    def __init__(
        self,
        bus: Bus,
        facts: NodeFacts,
        runtime: WorkerRuntime,
        addr: str,
        where: Callable[[], tuple[int, int]],
        *,
        interval_s: float = 1.0,
        sampler: Sampler | None = None,
        ports: int = 2,
        on_stored: Callable[[], None] = lambda: None,
    ) -> None:
        self.bus = bus
        self.ports = ports
        self.facts = facts
        self.runtime = runtime
        self.addr = addr
        self.where = where
        self.interval_s = interval_s
        self.sampler = sampler or Sampler()
        #: told each heartbeat that reached the bus (the storage fence)
        self.on_stored = on_stored
        self._seq = 0
        self._rates: dict[int, _RankRate] = {}
        self._rates_round = -1

    async def run(self) -> None:
        sending: set[asyncio.Task[None]] = set()
        try:
            while True:
                for task in [t for t in sending if t.done()]:
                    sending.discard(task)
                    task.result()  # an error of its own (not "bus away") ends the loop
                if len(sending) < IN_FLIGHT:
                    sending.add(asyncio.create_task(self._send(self.event())))
                await asyncio.sleep(self.interval_s)
        finally:
            await aio.cancel_and_wait(sending)

    async def _send(self, hb: ev.Heartbeat) -> None:
        try:
            await self.bus.publish(hb, deadline_s=2.0)
        except PublishDeadlineError:
            log.debug("heartbeat not sent: bus unavailable", node=self.facts.node)
            return
        self.on_stored()

    def event(self) -> ev.Heartbeat:
        self._seq += 1
        rnd, first = self.where()
        if rnd != self._rates_round:
            self._rates, self._rates_round = {}, rnd
        cpu, used, total = self.sampler.node()
        pids = self.runtime.pids() if self.runtime.running else {}
        progress = self.runtime.progress() if pids else {}
        gpus = {g.gpu: g for g in self.sampler.devices()}  # local rank i uses GPU i
        ranks = []
        for local_rank, pid in sorted(pids.items()):
            pcpu, rss = self.sampler.process(pid)
            p = progress.get(local_rank)
            rate = self._rates.setdefault(local_rank, _RankRate())
            if p is not None and rate.at and p.at > rate.at:
                rate.rate = (p.samples - rate.samples) / (p.at - rate.at)
                if p.step > rate.step and p.busy_s > rate.busy_s:
                    rate.busy_per_step = (p.busy_s - rate.busy_s) / (p.step - rate.step)
            if p is not None:
                rate.samples, rate.at, rate.step, rate.busy_s = p.samples, p.at, p.step, p.busy_s
            gpu = gpus.get(local_rank)
            ranks.append(
                ev.RankStat(
                    rank=first + local_rank,
                    local_rank=local_rank,
                    pid=pid,
                    step=p.step if p else 0,
                    samples_per_s=round(rate.rate, 2),
                    cpu_percent=pcpu,
                    rss_bytes=rss,
                    gpu_mem_bytes=None if gpu is None else gpu.memory_used,
                    gpu_util_percent=None if gpu is None else gpu.util_percent,
                    busy_s=None if rate.busy_per_step is None else round(rate.busy_per_step, 4),
                )
            )
        self.sampler.forget(set(pids.values()))
        hb = ev.Heartbeat(
            **self.facts.envelope("hb", self._seq),
            seq=self._seq,
            cpu_percent=cpu,
            mem_used_bytes=used,
            mem_total_bytes=total,
            ranks=tuple(ranks),
            round=rnd,
            ports=free_ports(self.addr, self.ports),
            capacity=self.sampler.capacity(),
        )
        metrics.from_heartbeat(hb)
        metrics.from_gpus(list(gpus.values()))
        return hb
