"""Fixtures: real nats-server processes (one node, or a 3-node JetStream cluster)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from rove.control import logs
from rove.control.bus import Bus, BusOptions
from rove.control.embedded import EmbeddedServer
from tests import support
from tests.kafkamock import KafkaCluster
from tests.support import Cluster

logs.configure("warning")

#: Lease TTL used by the tests' buses and masters (short, so failovers are quick).
TEST_LEASE_TTL = 2.0


@pytest.fixture(autouse=True)
def _rove_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROVE_HOME", str(tmp_path / "rove-home"))
    monkeypatch.delenv("ROVE_NATS_URL", raising=False)


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
