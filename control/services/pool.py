"""The pool registry: long-lived `rove agent` daemons that a scaler assigns to jobs.

One JetStream key-value bucket (`rove_pool`), one key per daemon
(`<pool>.<agent>`), holding a `PoolEntry`. Every change is a compare-and-set
on the key's revision, so two scalers can never assign one daemon twice, and
a daemon never overwrites an assignment it has not seen:

    idle  --(scaler: assign job J, node N)-->  assigned  --(daemon starts N)-->  running
    running --(scaler: release)--> releasing --(daemon stops N)--> idle
    running --(N ends on its own)--> idle        (the daemon reports node_gone)

A daemon refreshes its entry every few seconds (`seen`); a scaler only assigns
daemons seen recently. `ran` keeps the last nodes a daemon ran, so a plan
applied again never starts a node name a second time.
"""

from __future__ import annotations

import enum
from typing import Final

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects

POOL_BUCKET: Final = "rove_pool"
#: How many nodes a daemon remembers having run.
RAN_KEPT: Final = 64


class PoolState(enum.StrEnum):
    IDLE = "idle"
    ASSIGNED = "assigned"
    RUNNING = "running"
    RELEASING = "releasing"


class PoolEntry(msgspec.Struct, frozen=True, kw_only=True):
    pool: str
    agent: str
    host: str
    capacity: ev.Resources
    state: PoolState = PoolState.IDLE
    seen: float = 0.0
    job: str = ""
    node: str = ""
    spec: ev.NodeLaunch | None = None
    workload: ev.Workload | None = None
    ran: tuple[str, ...] = ()
    note: str = ""
    #: an idle daemon whose standby node is ready (torch imported, its warm server
    #: started): scalers assign it first
    warm: bool = False

    @property
    def key(self) -> str:
        return key(self.pool, self.agent)


def key(pool: str, agent: str) -> str:
    return f"{subjects.check_name('pool', pool)}.{subjects.check_name('agent', agent)}"


def ran_key(job: str, node: str) -> str:
    return f"{job}/{node}"


_decoder = msgspec.msgpack.Decoder(PoolEntry)
_encoder = msgspec.msgpack.Encoder()


def encode(entry: PoolEntry) -> bytes:
    return _encoder.encode(entry)


def decode(data: bytes) -> PoolEntry:
    return _decoder.decode(data)


async def bucket(bus: Bus) -> KeyValue:
    """The pool bucket, created on first use."""
    try:
        return await bus.js.key_value(POOL_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await bus.js.create_key_value(
            KeyValueConfig(
                bucket=POOL_BUCKET,
                history=1,
                replicas=bus.options.replicas,
                storage=StorageType.FILE,
            )
        )
    except nats.js.errors.BadRequestError as exc:
        if exc.err_code != 10058:  # created concurrently
            raise
        return await bus.js.key_value(POOL_BUCKET)


async def entries(kv: KeyValue, pool: str) -> list[tuple[PoolEntry, int]]:
    """Every daemon of `pool` with its entry's revision."""
    out = []
    prefix = f"{subjects.check_name('pool', pool)}."
    try:
        keys = [k for k in await kv.keys() if k.startswith(prefix)]
    except nats.js.errors.NoKeysError:
        return []
    for k in keys:
        try:
            got = await kv.get(k)
        except nats.js.errors.KeyNotFoundError:
            continue
        if got.value:
            try:
                out.append((decode(got.value), int(got.revision or 0)))
            except msgspec.DecodeError:
                continue
    return out
