"""Fixtures: real nats-server processes (one node, or a 3-node JetStream cluster)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rove.control.bus.client import Bus, BusOptions
from rove.control.bus.embedded import EmbeddedServer
from rove.control.catalogue import subjects
from rove.control.process import logs
from tests import support
from tests.kafkamock import KafkaCluster
from tests.s3server import S3Server
from tests.support import Cluster

logs.configure("warning")

#: One OpenMP thread per process the tests start, unless a test asks for more. The suite
#: simulates several nodes, each with its own workers, agent and servers, on one small
#: machine: a worker that takes every core's thread (torch's default, and torchrun's
#: too with one process per node) spins in OpenMP's barriers while the others hold the
#: cores, and a 30-s job burned 18 CPU-seconds per worker instead of 3. Tests that
#: compare launchers' own defaults take it out of their launchers' environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: Lease TTL used by the tests' buses and masters (short, so failovers are quick).
TEST_LEASE_TTL = 2.0


@pytest.fixture(autouse=True)
def _rove_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROVE_HOME", str(tmp_path / "rove-home"))
    monkeypatch.delenv("ROVE_NATS_URL", raising=False)


@pytest.fixture(autouse=True)
def _shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Each test's shared-memory checkpoints in a folder of its own on /dev/shm (tests
    that want another set ROVE_SHM_DIR themselves): two tests that run at once on two
    lanes with one job name saw each other's segments and locks."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = Path(tempfile.mkdtemp(prefix="rove-test-", dir=root))
    monkeypatch.setenv("ROVE_SHM_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _started_processes() -> Iterator[None]:
    """Stop every `rove run` / `rove master` a test started, whatever its outcome."""
    support.STARTED.clear()
    yield
    _stop_started()
    support.STARTED.clear()


def _stop_started() -> None:
    """Stop the processes a test started. The NATS fixtures call it before they stop
    their servers (this autouse fixture is torn down after them), so that processes
    leave while the bus is there, as they do in production, instead of each waiting out
    its deadlines for a bus that is gone."""
    for proc in reversed(support.STARTED):
        proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report ends with the log tail of every process it started."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.failed and report.when in ("setup", "call"):
        for proc in support.STARTED:
            report.sections.append(
                (f"log of {proc.name} ({proc.log_path})", support.log_tail(proc.log_path))
            )
            for name, path in getattr(proc, "extra_logs", list)():
                report.sections.append((f"log of {name} ({path})", support.log_tail(path)))
        # last, so that a cut output keeps them: where the processes still running wait
        for proc in support.STARTED:
            if proc.proc.poll() is None:
                report.sections.append(
                    (f"stacks of {proc.name} (pid {proc.proc.pid})", support.stacks(proc.proc.pid))
                )


#: UTC+05:30 all year (a POSIX zone: no tz database needed): a local time shown as UTC,
#: or read as UTC, is off by an amount no rounding hides
ZONE = "XST-5:30"


@pytest.fixture
def zone_ahead() -> Iterator[str]:
    """This process, and the processes it starts, in `ZONE`; its own zone again after."""
    before = os.environ.get("TZ")
    os.environ["TZ"] = ZONE
    time.tzset()
    yield ZONE
    if before is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = before
    time.tzset()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path / "nats")
    server.start()
    yield server
    _stop_started()
    server.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "cluster")
    cluster.start()
    yield cluster
    _stop_started()
    cluster.stop()


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """One 3-node cluster for the session (started on first use): tests that need the
    production shape but do not hurt the cluster share it (`cluster_bus`)."""
    cluster = Cluster(tmp_path_factory.mktemp("shared-cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


async def _cluster_bus(cluster: Cluster) -> Bus:
    """A bus on `cluster` (R3 streams) whose streams are made afresh (deleted, not purged:
    a purged stream still remembers the message ids of its deduplication window)."""
    b = await Bus.connect(BusOptions(url=cluster.url, replicas=3, lease_ttl_s=TEST_LEASE_TTL))
    for stream in (  # (connect waited for JetStream to have a leader, creating them)
        subjects.EVENTS_STREAM,
        subjects.HEARTBEAT_STREAM,
        subjects.ANSWER_STREAM,
        subjects.SNAPSHOT_STREAM,
        f"KV_{subjects.LEASE_BUCKET}",
    ):
        await b.js.delete_stream(stream)
    await b.ensure_streams()
    return b


@pytest.fixture
async def cluster_bus(shared_cluster: Cluster) -> AsyncIterator[Bus]:
    """A bus on the shared 3-node cluster (R3 streams), its streams emptied first."""
    b = await _cluster_bus(shared_cluster)
    yield b
    await b.close()


@pytest.fixture(params=["one server", "3-node cluster"])
async def any_bus(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Bus]:
    """The same test on one server (R1) and on a 3-node cluster (R3)."""
    server = None
    if request.param == "one server":
        server = EmbeddedServer(tmp_path / "nats")
        server.start()
        assert server.url is not None
        b = await Bus.connect(BusOptions(url=server.url, lease_ttl_s=TEST_LEASE_TTL))
    else:
        b = await _cluster_bus(request.getfixturevalue("shared_cluster"))
    yield b
    await b.close()
    if server is not None:
        server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedServer) -> AsyncIterator[Bus]:
    assert nats_server.url is not None
    b = await Bus.connect(BusOptions(url=nats_server.url, lease_ttl_s=TEST_LEASE_TTL))
    yield b
    await b.close()


@pytest.fixture
def kafka() -> Iterator[KafkaCluster]:
    """A librdkafka mock cluster held by a helper process (tests/kafkamock.py)."""
    c = KafkaCluster()
    yield c
    c.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One S3 server (moto's emulator, a process of its own) for the session."""
    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket's URL (with a prefix), and the environment that reaches it, as a
    user would set it for any S3-compatible store."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_server.bucket()}/ckpt"
