"""`rove agent --pool P`: a long-lived agent per machine that a scaler assigns to jobs.

The form the Kubernetes DaemonSet runs. The daemon announces itself idle in the
pool registry (`rove.control.services.pool`) with its capacity, and refreshes that every
`refresh_s`. When a scaler assigns it node N of job J (a compare-and-set on its
entry), it starts N exactly as `rove run` would, a `rove run` process with the
job's workload and N's memory limit (`rove.control.scaler.local` does the
starting), and marks itself running. While idle it keeps a standby node
(`rove.agent.standby`): a process that imported what `rove run` needs and started its
full warm server, which becomes N when N is assigned (`standby=False`: a new process
each time, as before). When N ends (the job finished, N was
excluded, it crashed) the daemon reports `node_gone` unless the node exited with
status 0 (its job finished), and goes back to idle; when a scaler releases it, it stops N first.

Everything it changes in its entry is a compare-and-set on the revision it last
saw, so an assignment is never overwritten unseen.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from rove.agent.metrics import Sampler
from rove.control.bus import retry
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import plain
from rove.control.process import aio
from rove.control.scaler.local import LocalBackend
from rove.control.services import pool as registry
from rove.control.services.pool import PoolEntry, PoolState

log = structlog.get_logger("rove.daemon")


class PoolDaemon:
    def __init__(
        self,
        bus: Bus,
        pool: str,
        agent: str,
        *,
        memory_bytes: int = 0,
        state_dir: Path | None = None,
        refresh_s: float = 2.0,
        standby: bool = True,
    ) -> None:
        self.bus = bus
        self.pool = pool
        self.agent = agent
        self.refresh_s = refresh_s
        capacity = Sampler().capacity()
        if memory_bytes:
            capacity = msgspec.structs.replace(capacity, memory_bytes=memory_bytes)
        self.capacity = capacity
        self.backend = LocalBackend(
            bus.url, state_dir=state_dir, die_with_parent=True, standby=standby
        )
        self.key = registry.key(pool, agent)
        self.entry = PoolEntry(pool=pool, agent=agent, host=socket.gethostname(), capacity=capacity)
        self.revision = 0
        self._stopping = asyncio.Event()
        self.log = log.bind(pool=pool, agent=agent)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        kv: KeyValue | None = None
        try:  # started while JetStream has no quorum: it waits, until a stop
            kv = await aio.unless(
                self._stopping,
                retry.wait_out(
                    lambda: registry.bucket(self.bus), what=f"the registry of pool {self.pool}"
                ),
            )
            await aio.unless(
                self._stopping,
                retry.wait_out(lambda: self._announce(kv), what=f"announcing {self.agent}"),
            )
        except aio.Stopped:
            self.log.info("stopped before the agent joined the pool")
            if kv is not None:  # an announcement cut short may have been stored
                await self._leave(kv, timeout_s=2.0)
            await self.backend.close()
            return
        self.log.info("agent in the pool, idle", capacity=self.capacity.describe())
        try:
            said = 0.0
            while not self._stopping.is_set():
                try:
                    await self._step(kv)
                except Exception as exc:
                    if not retry.backoff(exc):
                        raise
                    if time.monotonic() - said > 60:  # a bus outage: ride it out
                        said = time.monotonic()
                        self.log.warning("the bus did not answer; trying again", error=plain(exc))
                try:
                    await asyncio.wait_for(self._stopping.wait(), 0.25)
                except TimeoutError:
                    pass
        finally:
            if self.entry.state is not PoolState.IDLE and self.entry.spec is not None:
                await self._stop_node("the pool agent is stopping")
            await self._leave(kv)
            await self.backend.close()

    async def _leave(self, kv: KeyValue, timeout_s: float | None = None) -> None:
        """Take this agent's entry out of the pool's registry (best effort: a scaler
        also forgets an entry that is not refreshed)."""
        try:
            await asyncio.wait_for(kv.delete(self.key), timeout_s)
        except (nats.js.errors.Error, nats.errors.Error, TimeoutError):
            pass

    # ------------------------------------------------------------------ registry

    async def _announce(self, kv: KeyValue) -> None:
        self.entry = msgspec.structs.replace(self.entry, state=PoolState.IDLE, seen=time.time())
        self.revision = await kv.put(self.key, registry.encode(self.entry))

    async def _write(self, kv: KeyValue, entry: PoolEntry) -> bool:
        """CAS-write `entry`; False if someone changed it since we read it."""
        try:
            self.revision = await kv.update(self.key, registry.encode(entry), last=self.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        self.entry = entry
        return True

    async def _read(self, kv: KeyValue) -> PoolEntry | None:
        try:
            got = await kv.get(self.key)
        except nats.js.errors.KeyNotFoundError:
            return None
        self.revision = int(got.revision or 0)
        return registry.decode(got.value) if got.value else None

    # ------------------------------------------------------------------ one step

    async def _step(self, kv: KeyValue) -> None:
        current = await self._read(kv)
        if current is None:  # deleted (or never written): announce again
            await self._announce(kv)
            return
        self.entry = current
        now = time.time()
        if current.state is PoolState.ASSIGNED and current.spec and current.workload:
            await self._start(kv, current)
        elif current.state is PoolState.RELEASING:
            await self._stop_node(f"released by a scaler ({current.note or 'plan'})")
            await self._write(kv, _idle(current, now))
        elif current.state is PoolState.RUNNING:
            ended = await self.backend.ended(current.job)
            if any(e.node == current.node for e in ended):
                gone = next(e for e in ended if e.node == current.node)
                if gone.exit_code != 0:  # (0: the job finished, or the node was let go)
                    await self._report_gone(current, gone.reason, gone.exit_code)
                await self._write(kv, _idle(current, now))
                self.log.info(
                    "node ended: back in the pool, idle", job=current.job, node=current.node
                )
            elif now - current.seen > self.refresh_s:
                await self._write(kv, msgspec.structs.replace(current, seen=now))
        elif now - current.seen > self.refresh_s:
            await self._write(kv, msgspec.structs.replace(current, seen=now))
        if self.entry.state is PoolState.IDLE:
            self.backend.prepare()  # the next node, ready before it is asked for
            warm = self.backend.standby_ready()
            if warm != self.entry.warm:
                await self._write(kv, msgspec.structs.replace(self.entry, warm=warm))

    async def _start(self, kv: KeyValue, entry: PoolEntry) -> None:
        assert entry.spec is not None and entry.workload is not None
        self.log.info("assigned to a job", job=entry.job, node=entry.node)
        try:
            where = await self.backend.launch(
                entry.job, entry.spec, entry.workload, time.monotonic() + 60.0
            )
        except Exception as exc:  # noqa: BLE001 - told to the scaler through the entry
            self.log.error(
                "could not start the node", job=entry.job, node=entry.node, error=str(exc)
            )
            await self._write(kv, _idle(entry, time.time(), note=f"could not start: {exc}"))
            return
        running = msgspec.structs.replace(
            entry,
            state=PoolState.RUNNING,
            seen=time.time(),
            ran=(*entry.ran, registry.ran_key(entry.job, entry.node))[-registry.RAN_KEPT :],
            note=where,
        )
        if not await self._write(kv, running):
            self.log.warning("entry changed while starting; reading it again")

    async def _stop_node(self, why: str) -> None:
        entry = self.entry
        self.log.info(f"stopping node {entry.node}: {why}", job=entry.job)
        await self.backend.remove(entry.job, entry.node, time.monotonic() + 60.0)
        await self.backend.ended(entry.job)  # consume its end: no news, it was asked to go

    async def _report_gone(self, entry: PoolEntry, reason: str, code: int | None) -> None:
        event = ev.node_gone(
            entry.job,
            entry.node,
            reporter=f"pool:{self.agent}",
            reason=reason,
            ts=time.time(),
            exit_code=code,
        )
        try:
            await self.bus.publish(event, deadline_s=10.0)
        except Exception as exc:  # noqa: BLE001 - the heartbeat timeout still catches it
            self.log.warning("could not report the node's end", error=str(exc))


def _idle(entry: PoolEntry, now: float, note: str = "") -> PoolEntry:
    return msgspec.structs.replace(
        entry,
        state=PoolState.IDLE,
        warm=False,
        seen=now,
        job="",
        node="",
        spec=None,
        workload=None,
        note=note,
    )
