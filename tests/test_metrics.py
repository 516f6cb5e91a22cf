"""Prometheus metrics: the master's job metrics from scripted events; the exporter served
over HTTP and parsed as Prometheus parses it."""

from __future__ import annotations

import argparse

import msgspec
import pytest
from prometheus_client import REGISTRY

from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp
from rove.control.flags import options as common
from rove.control.master.evolve import evolve
from rove.control.master.metrics import JobMetrics
from rove.control.master.state import initial
from rove.control.process import metrics
from tests import factories as f
from tests.support import scrape
from tests.test_goodput import at, one_failure


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def fold(job: str, events: list[ev.Event]) -> JobMetrics:
    m = JobMetrics(job)
    state = initial(job)
    for seq, e in enumerate(events, 1):
        e = msgspec.structs.replace(e, job=job)
        state = evolve(state, e, seq)
        m.observe(e, state)
    return m


def test_job_metrics_of_a_job_with_one_failure() -> None:
    job = "metrics-one"
    m = fold(job, one_failure())
    assert value("rove_rounds_total", job=job, cause="formed") == 2  # (as scripted)
    assert value("rove_worker_failures_total", job=job, kind="killed") == 1
    # the failure was known 2 s after the last step (50 s -> 52 s); training went on at
    # 60 s, 8 s after it
    assert value("rove_detect_seconds_count", job=job) == 1
    assert value("rove_detect_seconds_sum", job=job) == pytest.approx(2.0)
    assert value("rove_recovery_seconds_count", job=job) == 1
    assert value("rove_recovery_seconds_sum", job=job) == pytest.approx(8.0)
    assert value("rove_job_state", job=job, state="finished") == 1
    assert value("rove_job_state", job=job, state="running") == 0
    want = gp.report(gp.of_events(one_failure()), now=500.0)
    assert value("rove_goodput_ratio", job=job) == pytest.approx(want.goodput)
    assert value("rove_badput_seconds", job=job, bucket="wasted progress") == pytest.approx(8.0)
    m.leader(True)
    assert value("rove_master_leader", job=job) == 1
    m.close()
    assert value("rove_goodput_ratio", job=job) == 0.0, "a closed job is no longer exported"


def test_a_restart_round_counts_as_a_job_restart_with_the_failures_kind() -> None:
    job = "metrics-restart"
    events = [
        at(f.configured(1), 0.0),
        f.joined("n1", ts=1.0),
        msgspec.structs.replace(f.round_completed(1, 1, "n1"), ts=2.0),
        f.exited("n1", 1, ts=5.0, kind=ev.FailureKind.OOM, reason="out of memory"),
        msgspec.structs.replace(f.round_completed(2, 1, "n1"), ts=6.0, cause=ev.RoundCause.RESTART),
        msgspec.structs.replace(f.lost("n1", 1), ts=9.0),
        f.task_restarted("n1", 2, 3),
    ]
    fold(job, events)
    assert value("rove_restarts_total", job=job, scope="job", reason="oom") == 1
    assert value("rove_restarts_total", job=job, scope="node", reason="heartbeat_timeout") == 1
    assert value("rove_restarts_total", job=job, scope="process", reason="killed") == 1
    assert value("rove_rounds_total", job=job, cause="restart") == 1


def test_subject_classes_are_few() -> None:
    assert metrics.subject_class("rove.ev.j1.node.n1") == "node"
    assert metrics.subject_class("rove.ev.j1.master.round_completed") == "master"
    assert metrics.subject_class("rove.hb.j1.n1") == "hb"


def test_the_exporter_serves_what_prometheus_parses() -> None:
    port = metrics.serve(0, "127.0.0.1")
    assert port is not None
    job = "metrics-http"
    fold(job, one_failure())
    metrics.from_gpus([metrics.GpuReading(0, 87.0, 3 * 2**30, 80 * 2**30, 310.5, 61.0)])
    samples = scrape(port)
    assert samples[("rove_rounds_total", (("cause", "formed"), ("job", job)))] == 2
    assert samples[("rove_gpu_utilization_percent", (("gpu", "0"),))] == 87.0
    assert samples[("rove_gpu_power_watts", (("gpu", "0"),))] == 310.5
    assert 0 < samples[("rove_goodput_ratio", (("job", job),))] < 1


def test_a_busy_port_is_a_warning_not_a_failure() -> None:
    port = metrics.serve(0, "127.0.0.1")
    assert port is not None
    assert metrics.serve(port, "127.0.0.1") == port, "served once per process and port"
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert metrics.serve(busy, "127.0.0.1") is None


@pytest.mark.parametrize("text", ["-1", "65536", "http"])
def test_bad_metrics_ports_are_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="invalid port"):
        common.port_number(text)
