"""Helpers for tests: free ports, NATS clusters, master processes, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from rove.agent import ports
from rove.control.bus.embedded import EmbeddedServer


def rove_cli(
    *args: str, timeout: float = 30, check: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`rove ARGS...` in a subprocess, its output captured as text (as written: a
    carriage return stays one).

    `env` is added to this process's environment.
    """
    out = subprocess.run(
        [sys.executable, "-m", "rove.control.cli.main", *args],
        capture_output=True,
        timeout=patience(timeout),
        check=check,
        env={**os.environ, **env} if env else None,
    )
    return subprocess.CompletedProcess(
        out.args,
        out.returncode,
        out.stdout.decode("utf-8", "replace"),
        out.stderr.decode("utf-8", "replace"),
    )


def flip_byte(path: Path, at: int) -> None:
    """Invert one byte of a file (negative `at` counts from the end): silent corruption."""
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def leave_process_group() -> NoReturn:
    """End a spawned gloo worker: destroy its process group and exit at once.

    A worker that had passed every check once died of SIGABRT ("terminate called
    without an active exception") on its way out in CI. DDP and FSDP keep the
    process group in reference cycles, so it can outlive destroy_process_group()
    and be torn down, with gloo's threads, during interpreter finalization.
    Exiting with os._exit skips finalization; the checks are already written.
    """
    import torch.distributed as dist

    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shm_root() -> Path:
    """Where this test's shared-memory checkpoints are (conftest gives each test its own)."""
    return Path(os.environ.get("ROVE_SHM_DIR", "/dev/shm"))


def _session_slice() -> tuple[int, int]:
    """(index, count) of this pytest session among those `ROVE_TEST_PORTS` says run at
    once ("k/n", k from 1), else (0, 1)."""
    raw = os.environ.get("ROVE_TEST_PORTS", "").strip()
    if not raw:
        return 0, 1
    k, _, n = raw.partition("/")
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"ROVE_TEST_PORTS must be k/n with 1 <= k <= n, got {raw!r}")
    return int(k) - 1, int(n)


def _worker_slice() -> tuple[int, int]:
    """(index, count) of this pytest-xdist worker, else (0, 1)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if worker.startswith("gw") and worker[2:].isdigit() and workers > 1:
        return int(worker[2:]), workers
    return 0, 1


def free_port() -> int:
    """A loopback port nobody holds, below the ports agents offer their rounds.

    A port the kernel hands out (`bind(("", 0))`) is free only until it hands it out
    again: to another test's outgoing connection, between this test's pick and the
    server's bind (a 3-node cluster's route port was taken that way). Ports below the
    ephemeral range are never handed out, and the agents' own offers
    (`rove.agent.ports.offer_range`) lie just below it, so these come from below those:
    only another pick like this one can take it, and each pick is random among
    thousands. Under pytest-xdist each worker picks from a slice of its own: a test that
    restarts a NATS server on its port (the port free meanwhile) cannot lose it to a
    test beside it. Two pytest sessions run at once (`make test`: the tests that restart
    NATS beside those that run alone) each take a slice first (`ROVE_TEST_PORTS=k/n`,
    the k-th of n)."""
    low = ports.ephemeral_low()
    offers = ports.offer_range(low)
    low = offers.start if offers else low
    start = max(1024, low - 12000)
    for index, count in (_session_slice(), _worker_slice()):
        width = (low - start) // count
        start += index % count * width
        low = start + width
    for _ in range(200):
        port = random.randrange(start, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (a crowded range: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def nats_without_jetstream() -> Iterator[int]:
    """A nats-server without JetStream on a free loopback port (yields the port): a
    client connects, and every JetStream call fails as on a cluster without quorum."""
    from rove.control.bus.embedded import nats_server_binary

    port = free_port()
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield port
    finally:
        server.terminate()
        server.wait(10)


class Cluster:
    """Three `nats-server -js` nodes routed into one cluster on loopback."""

    def __init__(self, root: Path, size: int = 3, *, host: str = "127.0.0.1") -> None:
        """`host`: where clients connect (0.0.0.0: every address of this host, for
        clients in a network namespace); the routes stay on loopback."""
        self.client_ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.route_ports)
        self.nodes = [
            EmbeddedServer(
                root / f"n{i + 1}",
                host=host,
                port=self.client_ports[i],
                server_name=f"n{i + 1}",
                extra_args=[
                    "--cluster_name",
                    "rove-test",
                    "--cluster",
                    f"nats://127.0.0.1:{self.route_ports[i]}",
                    "--routes",
                    routes,
                ],
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return self.url_at("127.0.0.1")

    def url_at(self, ip: str) -> str:
        """The cluster's URL for a client that reaches this host at `ip`."""
        return ",".join(f"nats://{ip}:{p}" for p in self.client_ports)

    def start(self) -> None:
        for n in self.nodes:
            n.start()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def chaos_seeds(first: int) -> list[int]:
    """The seeds a chaos test runs with: `first` alone in the suite (CI's time budget),
    or `ROVE_CHAOS_RUNS` seeds from it for a longer soak (`ROVE_CHAOS_RUNS=10 make
    test-chaos`)."""
    runs = int(os.environ.get("ROVE_CHAOS_RUNS", "1") or 1)
    return list(range(first, first + max(1, runs)))


def patience(seconds: float) -> float:
    """`seconds` stretched by how busy the machine is now (and `ROVE_TEST_TIMEOUT_SCALE`).

    A bound that a quiet machine meets in `seconds` is given more on a loaded one:
    times the 1-minute load average per core, when that is above 1. Tests use it for
    every wait on real processes, so a busy CI machine does not fail them.
    """
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    scale = float(os.environ.get("ROVE_TEST_TIMEOUT_SCALE", "1") or 1)
    return seconds * max(1.0, load) * scale


def fresh_python(code: str, timeout: float = 60) -> str:
    """Run `code` in a fresh interpreter (this one's): what a process that imported
    nothing else sees (`sys.modules`, threads). Fails the test unless it exits 0;
    returns its stdout."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=patience(timeout),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def launcher_env() -> dict[str, str]:
    """This environment without the suite's `OMP_NUM_THREADS` (conftest): what a user's
    shell gives a launcher, for tests that compare what launchers set themselves."""
    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


async def eventually(
    check: Callable[[], Awaitable[Any] | Any], *, timeout: float = 20.0, every: float = 0.05
) -> Any:
    """Poll `check` until it returns a truthy value; return it, or fail after `timeout`
    (stretched by `patience`).

    Between two checks it waits `every`, or twice as long as the check took if that is
    longer (up to a second): a costly check (every stored event read and folded) polls
    at most a third of a core, which the job under test needs more on a busy machine."""
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        began = time.monotonic()
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(max(every, min(1.0, 2 * (time.monotonic() - began))))
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


#: Processes started by the running test (`RunProc`, `MasterProc`). conftest stops
#: whatever is still running when the test ends, and attaches the tail of each one's
#: log to the report of a failed test, so a multi-process failure shows its processes.
STARTED: list[Any] = []


def stacks(pid: int) -> str:
    """The Python stacks of `pid` and its descendants (py-spy), or why there are none:
    where a hung multi-process test's processes wait."""
    spy = Path(sys.executable).parent / "py-spy"
    if not spy.exists():
        return "(py-spy is not installed)"
    try:
        out = subprocess.run(
            [str(spy), "dump", "--pid", str(pid), "--subprocesses"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "(py-spy timed out)"
    lines = [
        line
        for line in (out.stdout + out.stderr).splitlines()
        if "site-packages/_pytest" not in line and "pluggy" not in line
    ]
    return "\n".join(lines[:200])


def _registered(proc: Any) -> None:
    STARTED.append(proc)


def log_tail(path: Path, limit: int = 6000) -> str:
    """The last `limit` characters of a log file ('' if there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return text if len(text) <= limit else "[...]\n" + text[-limit:]


class CliProc:
    """A `rove COMMAND ...` subprocess, its output captured to `log_path`, stopped (and its
    log attached to a failed test's report) by conftest."""

    name: str
    log_path: Path
    #: seconds `stop()` gives it after SIGTERM before SIGKILL
    grace_s = 20.0

    def _spawn(
        self,
        name: str,
        log_path: Path,
        *command: str,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        cwd: Path | None = None,
        append: bool = False,
    ) -> None:
        self.name = name
        self.log_path = log_path
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with log_path.open("ab" if append else "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rove.control.cli.main", *command],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                preexec_fn=preexec,
                cwd=cwd,
            )
        _registered(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # in case a test paused it
            self.proc.terminate()
            try:
                self.proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class MasterProc(CliProc):
    """A `rove master` subprocess with its log captured to a file."""

    grace_s = 15.0

    def __init__(self, url: str, job: str, master_id: str, log_dir: Path, *extra: str) -> None:
        self.master_id = master_id
        self._spawn(
            f"rove master {master_id}",
            log_dir / f"master-{master_id}.log",
            *("master", "--job", job, "--id", master_id, "--nats", url, *extra),
            env={"ROVE_LOG_FORMAT": "json"},
        )

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


class Agents:
    """Simulated agents publishing real events: steady nodes heartbeat, churn nodes go silent."""

    def __init__(
        self, bus: Any, job: str = "j1", interval: float = 0.2, deadline_s: float = 30.0
    ) -> None:
        from rove.control.catalogue import events as ev

        self.ev = ev
        self.bus = bus
        self.job = job
        self.interval = interval
        #: how long one heartbeat is retried (an agent's: 2 s, then a fresh one)
        self.deadline_s = deadline_s
        self.silent: set[str] = set()
        self.churned: list[str] = []
        self._churn_stopped = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _joined(self, node: str) -> Any:
        return self.ev.NodeJoined(
            job=self.job,
            id=f"{node}:joined",
            producer=f"agent:{node}",
            ts=time.time(),
            node=node,
            host="localhost",
            pid=os.getpid(),
            incarnation="i1",
        )

    async def join(self, node: str) -> None:
        await self.bus.publish(self._joined(node))

    async def heartbeat_forever(self, node: str) -> None:
        from rove.control.errors import PublishDeadlineError

        seq = 0
        while True:
            if node not in self.silent:
                seq += 1
                with contextlib.suppress(PublishDeadlineError):
                    await self.bus.publish(
                        self.ev.Heartbeat(
                            job=self.job,
                            id=f"{node}:hb:{seq}",
                            producer=f"agent:{node}",
                            ts=time.time(),
                            node=node,
                            incarnation="i1",
                            seq=seq,
                        ),
                        deadline_s=self.deadline_s,
                    )
            await asyncio.sleep(self.interval)

    async def steady(self, *nodes: str) -> None:
        for node in nodes:
            await self.join(node)
            self._tasks.append(asyncio.create_task(self.heartbeat_forever(node)))

    async def churn_forever(self, every: float = 0.1) -> None:
        """A new node joins every `every` seconds and never heartbeats (so it must be
        lost), until `stop_churn`."""
        i = 0
        while not self._churn_stopped.is_set():
            i += 1
            node = f"c{i}"
            await self.bus.publish(self._joined(node), deadline_s=30)
            self.churned.append(node)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._churn_stopped.wait(), every)

    def start_churn(self, every: float = 0.1) -> asyncio.Task[None]:
        task = asyncio.create_task(self.churn_forever(every))
        self._tasks.append(task)
        return task

    async def stop_churn(self, task: asyncio.Task[None]) -> list[str]:
        """End the churn between two joins (a cancel could land after a join was stored
        and before it was counted: CI saw a node lost that the test never churned), and
        return every node it joined."""
        self._churn_stopped.set()
        await task
        return list(self.churned)

    async def stop(self) -> None:
        # (re-cancels: a task whose publish swallowed the cancel, gh-86296, hung CI here)
        from rove.control.process import aio

        await aio.cancel_and_wait(self._tasks)


async def replicas_hold(bus: Any, stream: str, seq: int, timeout: float = 30) -> None:
    """Wait until every replica of `stream` holds its message `seq`: a direct get may be
    answered by any replica, and one that lags does not have what the leader just
    stored (on one server there is nothing to wait for)."""

    async def caught_up() -> bool:
        info = await bus.js.stream_info(stream)
        peers = info.cluster.replicas if info.cluster is not None else None
        return (info.state.last_seq or 0) >= seq and all(
            p.current and not p.lag for p in peers or []
        )

    await eventually(caught_up, timeout=timeout, every=0.1)


async def stored_events(bus: Any, job: str = "j1") -> list[Any]:
    """Every valid stored event of `job` as `Recorded`, in stream order."""
    from rove.control.catalogue import subjects

    got: list[Any] = []
    feed = await bus.subscribe(
        subjects.EVENTS_STREAM, subjects.job_events(job), got.append, lambda r: None
    )
    try:
        await asyncio.wait_for(feed.caught_up.wait(), patience(120))
    except TimeoutError:
        raise AssertionError(
            f"reading job {job}'s events did not catch up in {patience(120):.0f} s "
            f"({len(got)} read): is the bus answering?"
        ) from None
    finally:
        await feed.stop()
    return got


def fold_records(recs: list[Any], job: str = "j1", upto: int | None = None) -> Any:
    from rove.control.master.evolve import evolve
    from rove.control.master.state import initial

    state = initial(job)
    for r in recs:
        if upto is not None and r.seq > upto:
            break
        state = evolve(state, r.event, r.seq)
    return state


ROOT = Path(__file__).parent.parent
TRAIN = ROOT / "examples" / "train.py"


class RunProc(CliProc):
    """A `rove run` subprocess (one node), its output captured to a file: its whole log
    too (`ROVE_VERBOSE=1`; by default the console gets short sentences, and the log goes
    to the job's folder, which tests/test_demo.py checks)."""

    def __init__(
        self,
        log_dir: Path,
        name: str,
        *args: str,
        env: dict[str, str] | None = None,
        preexec: Callable[[], None] | None = None,
        cwd: Path | None = None,
    ):
        self._spawn(
            f"rove run {name}",
            log_dir / f"run-{name}.log",
            "run",
            *args,
            env={"ROVE_VERBOSE": "1", **(env or {})},
            preexec=preexec,
            cwd=cwd,
        )

    def wait(self, timeout: float = 180) -> int:
        """The exit code; fails (with the log tail in the report) after `patience(timeout)`."""
        return self.proc.wait(patience(timeout))


def trace_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a trace a test's ranks append to (read as they grow: `tests.lineage`)."""
    from tests import lineage

    return lineage.rows(path)


def pid_alive(pid: int) -> bool:
    import psutil

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


class ScalerProc(CliProc):
    """A `rove scaler` subprocess (local backend), its nodes' markers and logs in `state_dir`.

    `stop()` also kills every node it started: local nodes run in their own sessions
    and outlive their scaler on purpose.
    """

    def __init__(self, url: str, job: str, scaler_id: str, log_dir: Path, *extra: str) -> None:
        self.job = job
        self.state_dir = log_dir / "nodes"
        self._spawn(
            f"rove scaler {scaler_id}",
            log_dir / f"scaler-{scaler_id}.log",
            *("scaler", "--job", job, "--id", scaler_id, "--nats", url),
            *("--state-dir", str(self.state_dir), *extra),
            append=True,
        )

    def markers(self) -> dict[str, dict[str, Any]]:
        import json

        out = {}
        for path in sorted((self.state_dir / self.job).glob("*.json")):
            try:
                out[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
        return out

    def node_pid(self, node: str) -> int:
        return int(self.markers()[node]["pid"])

    def extra_logs(self) -> list[tuple[str, Path]]:
        return [(f"node {p.stem}", p) for p in sorted((self.state_dir / self.job).glob("*.log"))]

    def stop(self) -> int:
        code = super().stop()
        for marker in self.markers().values():
            if marker.get("pid"):
                try:
                    os.killpg(int(marker["pid"]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return code


async def job_events(bus: Any, job: str) -> list[Any]:
    """The events of `job` as stored (decoded), in stream order."""
    return [r.event for r in await stored_events(bus, job)]


class BridgeProc(CliProc):
    """A `rove kafka-bridge` subprocess for `job`, named `name`."""

    grace_s = 15.0

    def __init__(self, url: str, job: str, name: str, log_dir: Path, *args: str) -> None:
        self._spawn(
            f"rove kafka-bridge {name}",
            log_dir / f"bridge-{name}.log",
            *("kafka-bridge", "--job", job, "--id", name, "--nats", url, *args),
        )


class DaemonProc(CliProc):
    """A `rove agent --pool` subprocess."""

    grace_s = 30.0

    def __init__(self, url: str, pool: str, agent: str, log_dir: Path, *extra: str) -> None:
        self.state_dir = log_dir / f"nodes-{agent}"
        self._spawn(
            f"rove agent {agent}",
            log_dir / f"agent-{agent}.log",
            *("agent", "--pool", pool, "--id", agent, "--nats", url),
            *("--state-dir", str(self.state_dir), *extra),
            append=True,
        )

    def node_pid(self, job: str, node: str) -> int:
        import json

        return int(json.loads((self.state_dir / job / f"{node}.json").read_text())["pid"])

    def has(self, node: str) -> bool:
        """Whether this daemon ran `node` (of any job)."""
        return any(self.state_dir.glob(f"*/{node}.json"))

    def extra_logs(self) -> list[tuple[str, Path]]:
        return [(f"node {p.stem}", p) for p in sorted(self.state_dir.glob("*/*.log"))]


async def finished(
    bus: Any, job: str, nodes: dict[str, RunProc], procs: list[CliProc]
) -> dict[str, int]:
    """The nodes' exit codes. If they do not end, fail with a short diagnosis first
    (each process's last lines, the job's last events), before the full logs."""
    deadline = time.monotonic() + min(patience(150), 420)
    while time.monotonic() < deadline:
        if all(p.proc.poll() is not None for p in nodes.values()):
            return {n: p.proc.returncode for n, p in nodes.items()}
        await asyncio.sleep(0.5)
    tails = [
        f"--- {p.name} ({'running' if p.proc.poll() is None else p.proc.returncode}):\n"
        + "\n".join(p.log().splitlines()[-6:])
        for p in procs
    ]
    recent = [
        f"#{r.seq} {type(r.event).__name__} {r.event.producer}"
        for r in await stored_events(bus, job)
    ][-15:]
    stuck = [
        f"--- stacks of {p.name}:\n{stacks(p.proc.pid)}"
        for p in nodes.values()
        if p.proc.poll() is None
    ]
    import pytest

    pytest.fail(
        "the job did not end; last lines:\n"
        + "\n".join(tails)
        + "\nlast events:\n"
        + "\n".join(recent)
        + "\n"
        + "\n".join(stuck)
    )


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A local process's Prometheus metrics, as Prometheus parses them: (name, sorted
    labels) -> value ({} while nothing serves on `port`)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read()
    except OSError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }
