"""Prometheus metrics of rove's processes (`prometheus_client`), served by `serve`.

* **Job metrics** come from the master's fold (`rove.control.master.metrics`):
  every master (leader and standbys) folds the same events, so each exports
  the same figures;
  `rove_master_leader` tells which one leads (dashboards take `max by (job)`).
  They count what the master replayed: a master that restarts from a snapshot
  starts its counters again (Prometheus's `rate()` handles resets), and its
  `rove_goodput_ratio` covers the events since that snapshot; `rove goodput`
  gives the job's whole life.
* **Node metrics** come from the agent: its heartbeat's view of the node and
  its workers, checkpoint persist times, and GPUs through pynvml where present.
* **Bus metrics**: publishes that failed, by subject class.

Labels stay few-valued: job, a state or bucket, an enum's value (failure kind,
round cause, plan rule), a local rank or GPU index. Never a pod, node or global
rank on a counter: the scrape's `instance` label already says which process.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import prometheus_client
import structlog

from rove.control.catalogue import events as ev

_SECONDS = (0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)

# ----------------------------------------------------------------------------- job

MASTER_LEADER = prometheus_client.Gauge(
    "rove_master_leader", "1 while this master process leads the job", ["job"]
)
ROUNDS = prometheus_client.Counter(
    "rove_rounds", "Rendezvous rounds formed, by why", ["job", "cause"]
)
RESTARTS = prometheus_client.Counter(
    "rove_restarts",
    "Restarts by scope (process: one task in place; job: every worker in a new round; "
    "node: a node lost, gone or excluded) and reason",
    ["job", "scope", "reason"],
)
WORKER_FAILURES = prometheus_client.Counter(
    "rove_worker_failures", "Worker processes that ended badly, by diagnosis", ["job", "kind"]
)
RECOVERY = prometheus_client.Histogram(
    "rove_recovery_seconds",
    "From a failure being known to the first training step after it",
    ["job"],
    buckets=_SECONDS,
)
DETECT = prometheus_client.Histogram(
    "rove_detect_seconds",
    "From the last training step before a failure to the failure being known",
    ["job"],
    buckets=_SECONDS,
)
CKPT_COMMITTED = prometheus_client.Counter(
    "rove_ckpt_committed", "Checkpoint steps committed to storage", ["job"]
)
CKPT_FAILED = prometheus_client.Counter(
    "rove_ckpt_failures", "Checkpoint persists that failed on a node", ["job"]
)
SHARDS_REQUEUED = prometheus_client.Counter(
    "rove_shards_requeued",
    "Leased shards given back to todo, by reason (lease_expired: its holder went silent)",
    ["job", "reason"],
)
SCALE_PLANS = prometheus_client.Counter(
    "rove_scale_plans", "Scale plans made, by rule and cause", ["job", "decision", "reason"]
)

# ----------------------------------------------------------------------------- node

NODE_CPU = prometheus_client.Gauge("rove_node_cpu_percent", "The node's CPU use", ["job"])
NODE_MEMORY = prometheus_client.Gauge(
    "rove_node_memory_used_bytes", "The node's memory in use", ["job"]
)
WORKER_STEP = prometheus_client.Gauge(
    "rove_worker_step", "Last step each local worker reported", ["job", "local_rank"]
)
WORKER_RATE = prometheus_client.Gauge(
    "rove_worker_samples_per_second", "Each local worker's throughput", ["job", "local_rank"]
)
WORKER_RSS = prometheus_client.Gauge(
    "rove_worker_rss_bytes", "Each local worker's resident memory", ["job", "local_rank"]
)
LEADERLESS = prometheus_client.Gauge(
    "rove_job_leaderless_seconds",
    "Seconds since this node last saw a master hold its job's leader lease (0: one leads)",
    ["job"],
)
NODE_WORKER_FAILURES = prometheus_client.Counter(
    "rove_node_worker_failures",
    "This node's worker processes that ended badly, by diagnosis",
    ["job", "kind"],
)
CKPT_PERSIST = prometheus_client.Histogram(
    "rove_ckpt_persist_seconds",
    "Persisting one checkpoint step from shared memory to storage (in the background)",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
CKPT_BLOCKING = prometheus_client.Counter(
    "rove_ckpt_blocking_seconds",
    "Seconds this node's slowest worker spent blocked in checkpoint saves",
    ["job"],
)
GPU_UTIL = prometheus_client.Gauge("rove_gpu_utilization_percent", "GPU use (pynvml)", ["gpu"])
GPU_MEMORY_USED = prometheus_client.Gauge(
    "rove_gpu_memory_used_bytes", "GPU memory in use (pynvml)", ["gpu"]
)
GPU_MEMORY_TOTAL = prometheus_client.Gauge(
    "rove_gpu_memory_total_bytes", "GPU memory (pynvml)", ["gpu"]
)
GPU_POWER = prometheus_client.Gauge("rove_gpu_power_watts", "GPU power draw (pynvml)", ["gpu"])
GPU_TEMPERATURE = prometheus_client.Gauge(
    "rove_gpu_temperature_celsius", "GPU temperature (pynvml)", ["gpu"]
)

# ----------------------------------------------------------------------------- bus

PUBLISH_ERRORS = prometheus_client.Counter(
    "rove_bus_publish_errors",
    "Publishes that failed (after retries, or refused), by subject class",
    ["subject_class"],
)


def subject_class(subject: str) -> str:
    """`node`, `master`, `data`, `cmd`, `hb`, ... of a rove subject (few values)."""
    tokens = subject.split(".")
    if len(tokens) > 3 and tokens[1] == "ev":
        return tokens[3]
    return tokens[1] if len(tokens) > 1 else subject


# ----------------------------------------------------------------------------- serving

log = structlog.get_logger("rove.metrics")
_served: dict[int, object] = {}
_lock = threading.Lock()


def serve(port: int, addr: str = "0.0.0.0") -> int | None:
    """Serve this process's metrics on `port` (0: a free one); the port served, or None
    (with a warning) when it cannot be bound: metrics never stop a job. Once per
    process and port: a standalone job's master and agent share it."""
    with _lock:
        if port and port in _served:
            return port
        try:
            server, _thread = prometheus_client.start_http_server(port, addr)
        except OSError as exc:
            log.warning(
                f"cannot serve metrics on port {port}: {exc}; the job goes on without them "
                "(choose a free port with --metrics-port)"
            )
            return None
        bound = int(server.server_port)
        _served[bound] = server
        log.info("serving Prometheus metrics", url=f"http://{addr}:{bound}/metrics")
        return bound


# ----------------------------------------------------------------------------- node updates


class GpuReading(NamedTuple):
    gpu: int
    util_percent: float
    memory_used: int
    memory_total: int
    power_watts: float | None
    temperature_c: float | None


def from_heartbeat(hb: ev.Heartbeat) -> None:
    """The node gauges from the agent's heartbeat."""
    NODE_CPU.labels(hb.job).set(hb.cpu_percent)
    NODE_MEMORY.labels(hb.job).set(hb.mem_used_bytes)
    for r in hb.ranks:
        rank = str(r.local_rank)
        WORKER_STEP.labels(hb.job, rank).set(r.step)
        WORKER_RATE.labels(hb.job, rank).set(r.samples_per_s)
        WORKER_RSS.labels(hb.job, rank).set(r.rss_bytes)


def from_gpus(readings: list[GpuReading]) -> None:
    """The GPU gauges from pynvml readings (`rove.agent.metrics.Sampler.devices`)."""
    for g in readings:
        gpu = str(g.gpu)
        GPU_UTIL.labels(gpu).set(g.util_percent)
        GPU_MEMORY_USED.labels(gpu).set(g.memory_used)
        GPU_MEMORY_TOTAL.labels(gpu).set(g.memory_total)
        if g.power_watts is not None:
            GPU_POWER.labels(gpu).set(g.power_watts)
        if g.temperature_c is not None:
            GPU_TEMPERATURE.labels(gpu).set(g.temperature_c)
