"""The `pool` backend: nodes are idle `rove agent --pool P` daemons, assigned by CAS.

`launch` finds an idle daemon of the pool, seen recently, whose capacity fits
the node's resources, and assigns it the node with a compare-and-set on its
registry entry (`rove.control.services.pool`): two scalers cannot take the same daemon,
and a node name that any daemon runs or has run is never assigned again.
`remove` asks the daemon running the node to release it and waits until it is
idle. The daemons report their nodes' ends themselves (`node_gone`), so `ended`
has nothing to add.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import TemporaryError
from rove.control.scaler.backend import Backend, Ended, NodeInfo
from rove.control.services import pool as registry
from rove.control.services.pool import PoolEntry, PoolState

log = structlog.get_logger("rove.scaler.pool")

#: A daemon not seen for this long is not assigned anything.
STALE_S = 10.0
#: How many times a launch reads the pool when every idle daemon's entry changed since.
ASSIGN_READS = 3


def fits(capacity: ev.Resources, wanted: ev.Resources) -> bool:
    """Whether a daemon with `capacity` can run a node that wants `wanted` (0: any)."""
    return (
        (
            not wanted.memory_bytes
            or not capacity.memory_bytes
            or capacity.memory_bytes >= wanted.memory_bytes
        )
        and (not wanted.cpu or capacity.cpu >= wanted.cpu)
        and capacity.gpus >= wanted.gpus
    )


class PoolBackend(Backend):
    name = "pool"

    def __init__(self, bus: Bus, pool: str) -> None:
        self.bus = bus
        self.pool = pool
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            self._kv = await registry.bucket(self.bus)
        return self._kv

    async def _entries(self) -> list[tuple[PoolEntry, int]]:
        try:
            return await registry.entries(await self._bucket(), self.pool)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            raise TemporaryError(f"cannot read pool {self.pool}: {exc}") from exc

    async def launch(
        self, job: str, spec: ev.NodeLaunch, workload: ev.Workload, deadline: float
    ) -> str:
        wanted = registry.ran_key(job, spec.node)
        # A daemon refreshes its entry (seen, warm) as a scaler assigns it: a refused
        # compare-and-set is read again, a few times, before no agent is said free.
        for _ in range(ASSIGN_READS):
            entries = await self._entries()
            for entry, _rev in entries:
                if (entry.job, entry.node) == (job, spec.node) or wanted in entry.ran:
                    return f"agent {entry.agent} on {entry.host} (assigned before)"
            now = time.time()
            idle = [
                (e, rev)
                for e, rev in entries
                if e.state is PoolState.IDLE
                and now - e.seen < STALE_S
                and fits(e.capacity, spec.resources)
            ]
            if not idle:
                break
            got = await self._assign(idle, job, spec, workload)
            if got is not None:
                return got
        free = sum(1 for e, _ in entries if e.state is PoolState.IDLE and now - e.seen < STALE_S)
        raise TemporaryError(
            f"no idle agent in pool {self.pool} can run node {spec.node} "
            f"({spec.resources.describe()}): {len(entries)} agents, {free} idle; start more "
            f"with `rove agent --pool {self.pool}`",
            retry_after=1.0,
        )

    async def _assign(
        self,
        idle: list[tuple[PoolEntry, int]],
        job: str,
        spec: ev.NodeLaunch,
        workload: ev.Workload,
    ) -> str | None:
        """Assign the node to the first of `idle` whose entry is unchanged (None: every
        one changed since it was read)."""
        kv = await self._bucket()
        # a daemon whose standby node is ready first: its node trains seconds sooner
        for entry, rev in sorted(idle, key=lambda x: (not x[0].warm, x[0].agent)):
            assigned = msgspec.structs.replace(
                entry,
                state=PoolState.ASSIGNED,
                job=job,
                node=spec.node,
                spec=spec,
                workload=workload,
                note="",
                warm=False,
            )
            try:
                await kv.update(entry.key, registry.encode(assigned), last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                continue  # another scaler took it, or the daemon refreshed: try the next
            log.info("node assigned", job=job, node=spec.node, agent=entry.agent)
            return f"agent {entry.agent} on {entry.host}"
        return None

    async def remove(self, job: str, node: str, deadline: float) -> None:
        while True:
            entries = await self._entries()
            found = [(e, r) for e, r in entries if (e.job, e.node) == (job, node)]
            if not found:
                return  # not there (or released and idle again)
            entry, rev = found[0]
            if entry.state is not PoolState.RELEASING:
                kv = await self._bucket()
                released = msgspec.structs.replace(entry, state=PoolState.RELEASING, note="plan")
                try:
                    await kv.update(entry.key, registry.encode(released), last=rev)
                except nats.js.errors.KeyWrongLastSequenceError:
                    pass  # changed under us: look again
            if time.monotonic() > deadline:
                raise TemporaryError(f"agent {entry.agent} has not released node {node} yet")
            await asyncio.sleep(0.2)

    async def nodes(self, job: str) -> list[NodeInfo]:
        return [
            NodeInfo(
                node=e.node,
                where=f"agent {e.agent} on {e.host}",
                running=e.state is PoolState.RUNNING,
            )
            for e, _ in await self._entries()
            if e.job == job and e.node
        ]

    async def ended(self, job: str) -> list[Ended]:
        return []  # the daemons publish node_gone themselves
