"""A pool agent's standby node: its assignment, and a local backend whose standby nodes
keep dying.

(The standby becoming a node, with a real pool daemon, master and nats-server, is
tests/test_backends.py's `test_a_pool_agent_hands_its_node_to_a_standby...`.)"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rove.control.scaler import local, standby
from rove.control.scaler.local import LocalBackend


def test_an_assignment_is_one_json_line_that_reads_back_the_same() -> None:
    a = standby.Assignment(
        argv=("--job", "j1", "--node-id", "n1", "train.py", "--lr", "0.1"),
        cwd="/work",
        log="/logs/n1.log",
        memory=2**31,
    )
    line = standby.encode(a)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert standby.decode(line) == a


@pytest.mark.parametrize("line", [b"not json\n", b'{"cwd": "/x"}\n', b'{"argv": "run"}\n'])
def test_a_line_that_is_no_assignment_is_refused(line: bytes) -> None:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        standby.decode(line)


def test_standby_nodes_that_end_unasked_are_given_up_after_a_few(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A standby that cannot start (here `false` stands for its interpreter) is started
    again a few times, then the backend says so and starts nodes as new processes."""
    monkeypatch.setattr(local, "STANDBY_RESPAWN_S", 0.0)
    backend = LocalBackend("nats://127.0.0.1:1", state_dir=tmp_path, python="false", standby=True)
    started = 0
    deadline = time.monotonic() + 30
    while backend.standby and time.monotonic() < deadline:
        before = backend._standby
        backend.prepare()
        if backend._standby is not None and backend._standby is not before:
            started += 1
            backend._standby.wait(10)
    assert not backend.standby, "it gave standby nodes up"
    assert started == local.STANDBY_TRIES
    assert not backend.standby_ready()
    backend.prepare()
    assert backend._standby is None, "and starts none after that"


async def test_an_assignment_refused_because_the_daemon_refreshed_its_entry_is_tried_again(
    bus: Any,
) -> None:
    """A daemon writes its entry (seen, warm) while a scaler assigns it; the scaler's
    compare-and-set is refused, and the launch reads the pool again instead of saying
    no agent is free (seen in the contract test once daemons said they were warm)."""
    from rove.control.catalogue import events as ev
    from rove.control.scaler.pool import PoolBackend
    from rove.control.services import pool as registry

    kv = await registry.bucket(bus)
    entry = registry.PoolEntry(
        pool="p", agent="a1", host="h", capacity=ev.Resources(cpu=2), seen=time.time()
    )
    await kv.put(entry.key, registry.encode(entry))

    class Refreshed(PoolBackend):
        reads = 0

        async def _entries(self) -> list[tuple[registry.PoolEntry, int]]:
            got = await super()._entries()
            Refreshed.reads += 1
            if Refreshed.reads == 1:  # the daemon says it is warm right after our read
                warm = msgspec.structs.replace(entry, warm=True, seen=time.time())
                await kv.put(entry.key, registry.encode(warm))
            return got

    pool = Refreshed(bus, "p")
    node = ev.NodeLaunch(node="n1", slot=0, attempt=0, resources=ev.Resources())
    work = ev.Workload(argv=("x.py",), cwd="/", min_nodes=1, max_nodes=1)
    where = await pool.launch("j1", node, work, time.monotonic() + 30)
    assert where == "agent a1 on h" and Refreshed.reads == 2
    ((assigned, _),) = await registry.entries(kv, "p")
    assert (assigned.state, assigned.node, assigned.warm) == (
        registry.PoolState.ASSIGNED,
        "n1",
        False,
    )
