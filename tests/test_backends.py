"""The backend contract (`rove.control.scaler.backend.Backend`), against every backend.

Real processes and a real nats-server: `local` starts `rove run` processes;
`pool` assigns them to real `rove agent --pool` daemons; `kubernetes` creates
pods through the official client against `kmock`'s API emulator over HTTP, and
`tests.kubelet` runs those pods as local `rove run` processes (no real API
server or kubelet can run here). The node processes
here never train (no master runs): the contract is about creating and stopping
nodes, not about the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import TemporaryError
from rove.control.scaler.backend import Backend, Ended
from rove.control.scaler.kubernetes import KubernetesBackend
from rove.control.scaler.local import LocalBackend
from rove.control.scaler.pool import PoolBackend
from tests.kubelet import Kubelet, backend_for
from tests.support import DaemonProc, MasterProc, eventually, job_events, patience, pid_alive

pytestmark = pytest.mark.slow

JOB = "contract"


def workload(tmp: Path, *extra: str) -> ev.Workload:
    script = tmp / "idle.py"
    script.write_text("import time\ntime.sleep(3600)\n")
    return ev.Workload(
        argv=("--nproc-per-node", "1", *extra, str(script)), cwd=str(tmp), min_nodes=1, max_nodes=4
    )


def spec(node: str, memory: int = 0) -> ev.NodeLaunch:
    return ev.NodeLaunch(node=node, slot=0, attempt=0, resources=ev.Resources(memory_bytes=memory))


@pytest.fixture(params=["local", "pool", "kubernetes"])
async def backend(
    request: pytest.FixtureRequest, bus: Bus, tmp_path: Path
) -> AsyncIterator[Backend]:
    if request.param == "kubernetes":
        async with kubernetes_backend(bus, tmp_path) as made_k8s:
            yield made_k8s
            await _remove_all(made_k8s)
        return
    made: Backend
    if request.param == "local":
        made = LocalBackend(bus.url, state_dir=tmp_path / "nodes")
    else:
        for agent in ("a1", "a2"):
            DaemonProc(bus.url, "p", agent, tmp_path)
        made = PoolBackend(bus, "p")
        from rove.control.services import pool as registry

        kv = await registry.bucket(bus)
        await eventually(lambda: _idle(kv), timeout=60, every=0.2)
    yield made
    await _remove_all(made)


async def _remove_all(made: Backend) -> None:
    for info in await made.nodes(JOB):
        if info.running:
            await made.remove(JOB, info.node, time.monotonic() + patience(30))
    await made.close()


@contextlib.asynccontextmanager
async def kubernetes_backend(
    bus: Bus, tmp_path: Path, memory: int = 0, pending_timeout_s: float = 120.0
) -> AsyncIterator[KubernetesBackend]:
    async with (
        kmock.KubernetesEmulator() as emulator,
        kmock.Server(emulator) as server,
        Kubelet(emulator, "rove-jobs", tmp_path, memory=memory),
    ):
        yield backend_for(server, bus.url, pending_timeout_s=pending_timeout_s)


async def _idle(kv: Any) -> bool:
    from rove.control.services import pool as registry

    return len([e for e, _ in await registry.entries(kv, "p") if e.state.value == "idle"]) == 2


def deadline(seconds: float = 30) -> float:
    return time.monotonic() + patience(seconds)


async def launch(backend: Backend, node: str, w: ev.Workload) -> str:
    """`backend.launch`, retried on `TemporaryError` as the scaler retries it (the pool's
    registry read can come back empty for a moment on a busy machine)."""
    end = deadline()
    while True:
        try:
            return await backend.launch(JOB, spec(node), w, end)
        except TemporaryError:
            if time.monotonic() > end:
                raise
            await asyncio.sleep(0.5)


async def running(backend: Backend) -> set[str]:
    return {n.node for n in await backend.nodes(JOB) if n.running}


async def test_launch_is_idempotent_and_remove_stops_the_node(
    backend: Backend, tmp_path: Path
) -> None:
    w = workload(tmp_path)
    first = await launch(backend, "n0-a0", w)
    again = await launch(backend, "n0-a0", w)
    assert "before" in again or "found" in again, (first, again)
    await eventually(lambda: running(backend), timeout=30)
    assert await running(backend) == {"n0-a0"}
    assert [n.node for n in await backend.nodes(JOB)] == ["n0-a0"], "one node, not two"
    await backend.remove(JOB, "n0-a0", deadline())
    await eventually(lambda: _not_running(backend, "n0-a0"), timeout=30)
    await backend.remove(JOB, "n0-a0", deadline())  # already gone: still success
    await backend.remove(JOB, "never-was", deadline())


async def _not_running(backend: Backend, node: str) -> bool:
    return node not in await running(backend)


async def test_a_node_name_is_never_started_twice_even_after_it_ended(
    backend: Backend, tmp_path: Path
) -> None:
    w = workload(tmp_path)
    await launch(backend, "n1-a0", w)
    await eventually(lambda: running(backend), timeout=30)
    await backend.remove(JOB, "n1-a0", deadline())
    await eventually(lambda: _not_running(backend, "n1-a0"), timeout=30)
    where = await launch(backend, "n1-a0", w)
    assert "before" in where
    await asyncio.sleep(1.0)
    assert "n1-a0" not in await running(backend)


async def test_a_node_that_ends_on_its_own_is_reported(
    backend: Backend, bus: Bus, tmp_path: Path
) -> None:
    bad = ev.Workload(
        argv=("--nproc-per-node", "1", str(tmp_path / "missing.py")),
        cwd=str(tmp_path),
        min_nodes=1,
        max_nodes=1,
    )
    await launch(backend, "n2-a0", bad)
    seen: list[Ended | ev.NodeGone] = []

    async def reported() -> bool:
        seen.extend(e for e in await backend.ended(JOB) if e.node == "n2-a0")
        # (the pool's agent reports its node's end itself: a `node_gone`)
        seen.extend(
            e for e in await _events(bus) if isinstance(e, ev.NodeGone) and e.node == "n2-a0"
        )
        return bool(seen)

    await eventually(reported, timeout=60, every=0.2)
    # `rove run` refused the missing script (exit code 2), and its line is in the reason:
    # the master fails the job with it rather than launch the slot again
    assert seen[0].exit_code == ev.NODE_REFUSED_EXIT, seen
    assert "missing.py not found" in seen[0].reason, seen


async def _events(bus: Bus) -> list[Any]:
    try:
        return await job_events(bus, JOB)
    except Exception:
        return []


async def test_the_pool_says_when_no_agent_is_free_or_big_enough(bus: Bus, tmp_path: Path) -> None:
    DaemonProc(bus.url, "small", "s1", tmp_path, "--memory", "1G")
    pool = PoolBackend(bus, "small")
    from rove.control.services import pool as registry

    kv = await registry.bucket(bus)
    await eventually(lambda: registry.entries(kv, "small"), timeout=60, every=0.2)
    with pytest.raises(TemporaryError, match=r"no idle agent in pool small can run node n0-a0"):
        await pool.launch(JOB, spec("n0-a0", memory=2 * ev.GIB), workload(tmp_path), deadline())
    await pool.launch(JOB, spec("n1-a0", memory=ev.GIB // 2), workload(tmp_path), deadline())
    with pytest.raises(TemporaryError, match="0 idle"):
        await pool.launch(JOB, spec("n2-a0"), workload(tmp_path), deadline())
    await pool.remove(JOB, "n1-a0", deadline())


async def test_a_pool_agent_asked_to_stop_stops_its_node_and_leaves_the_pool(
    bus: Bus, tmp_path: Path
) -> None:
    """(Once 16 s: its node waited out deadlines for a bus the tests had stopped first.
    Measured here: about 0.7 s on a quiet machine.)"""
    import signal

    from rove.control.services import pool as registry

    daemon = DaemonProc(bus.url, "p", "a1", tmp_path)
    kv = await registry.bucket(bus)
    await eventually(
        lambda: _count(kv, "idle"),
        timeout=60,
        every=0.2,
    )
    pool = PoolBackend(bus, "p")
    await pool.launch(JOB, spec("n1"), workload(tmp_path), deadline())
    await eventually(lambda: daemon.has("n1"), timeout=60)
    node = daemon.node_pid(JOB, "n1")
    daemon.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(daemon.proc.wait, patience(10)) == 0, daemon.log()[-2000:]
    assert not pid_alive(node), "its node stopped with it"
    assert await registry.entries(kv, "p") == [], "it left the pool registry"
    await pool.close()


async def _count(kv: Any, state: str) -> int:
    from rove.control.services import pool as registry

    return len([e for e, _ in await registry.entries(kv, "p") if e.state.value == state])


def _standbys(daemon: DaemonProc) -> list[int]:
    """The pids of the standby nodes `daemon` keeps (its children running the module)."""
    import psutil

    from rove.control.scaler import standby

    out = []
    for child in psutil.Process(daemon.proc.pid).children():
        with contextlib.suppress(psutil.Error):
            if standby.MODULE in child.cmdline():
                out.append(child.pid)
    return out


def _address_space_limit(pid: int) -> int | None:
    import resource

    soft, _hard = resource.prlimit(pid, resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


async def test_a_pool_agent_hands_its_node_to_a_standby_that_imported_everything(
    bus: Bus, tmp_path: Path
) -> None:
    """While idle the daemon keeps a standby node whose warm server imported torch and
    DDP's modules, says so in the registry (`warm`), and that process becomes the
    node it is assigned: in the workload's folder, with the node's memory limit on it,
    on its warm server and on the workers, writing to the node's log. Once the node
    ends, a new standby gets ready; a daemon that stops takes its standby with it."""
    import signal

    from rove.control.services import pool as registry

    daemon = DaemonProc(bus.url, "p", "a1", tmp_path)
    MasterProc(bus.url, JOB, "m1", tmp_path)  # (its round starts the probe)
    kv = await registry.bucket(bus)

    async def warm() -> bool:
        return any(e.warm for e, _ in await registry.entries(kv, "p"))

    await eventually(warm, timeout=120, every=0.2)
    (standby,) = _standbys(daemon)
    folder = tmp_path / "work"
    folder.mkdir()
    probe = folder / "probe.py"
    probe.write_text(
        "import os, resource, sys, time\n"
        "soft = resource.getrlimit(resource.RLIMIT_AS)[0]\n"
        "warm = 'torch._dynamo' in sys.modules\n"
        "open('seen.tmp', 'w').write(f'{os.getcwd()} {soft} {warm}')\n"
        "os.replace('seen.tmp', 'seen.txt')\n"  # whole, never seen half-written
        "time.sleep(3600)\n"
    )
    w = ev.Workload(
        argv=("--nproc-per-node", "1", "probe.py"), cwd=str(folder), min_nodes=1, max_nodes=1
    )
    pool = PoolBackend(bus, "p")
    await pool.launch(JOB, spec("n1", memory=8 * ev.GIB), w, deadline())
    await eventually(lambda: (folder / "seen.txt").exists(), timeout=120)
    node = daemon.node_pid(JOB, "n1")
    assert node == standby, "the standby became the node"
    cwd, soft, imported = (folder / "seen.txt").read_text().split()
    assert cwd == str(folder)
    assert int(soft) == 8 * ev.GIB, "the worker runs under the node's memory limit"
    assert imported == "True", "the worker was forked from a server that imported DDP's modules"
    assert _address_space_limit(node) == 8 * ev.GIB
    log = (daemon.state_dir / JOB / "n1.log").read_text()
    assert f"rove: job {JOB}, node n1" in log, log[-2000:]
    assert not await warm(), "no standby is ready while the node runs"

    await pool.remove(JOB, "n1", deadline())
    await eventually(warm, timeout=120, every=0.2)  # a new one, for the next node
    (again,) = _standbys(daemon)
    assert again != standby and not pid_alive(standby)
    daemon.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(daemon.proc.wait, patience(30)) == 0, daemon.log()[-2000:]
    await eventually(lambda: not pid_alive(again), timeout=30)
    await pool.close()
