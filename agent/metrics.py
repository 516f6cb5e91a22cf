"""Resource use of a node and of its worker processes: psutil, and pynvml on GPUs.

A node's capacity (what heartbeats report and plans size) is its CPUs (the
affinity mask), its memory limit (cgroup v2 `memory.max`, else the address-space
limit `RLIMIT_AS`, else the machine's memory) and its GPUs.
"""

from __future__ import annotations

import contextlib
import os
import resource
from typing import Any

import psutil
import structlog

from rove.control.catalogue import events as ev
from rove.control.process import cgroups, metrics

log = structlog.get_logger("rove.metrics")


class Sampler:
    """Samples CPU and memory of the node and of given pids; GPU memory and use per device."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}
        psutil.cpu_percent(None)
        self._nvml: Any = None
        self._capacity: ev.Resources | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            self.gpus = pynvml.nvmlDeviceGetCount()
        except Exception:  # noqa: BLE001 - no driver, no library, no GPU: all mean "no GPU metrics"
            self.gpus = 0

    def node(self) -> tuple[float, int, int]:
        mem = psutil.virtual_memory()
        return psutil.cpu_percent(None), int(mem.total - mem.available), int(mem.total)

    def process(self, pid: int) -> tuple[float, int]:
        """(cpu percent since the last call, resident bytes), zeros once it is gone."""
        proc = self._procs.get(pid)
        try:
            if proc is None:
                proc = self._procs[pid] = psutil.Process(pid)
                proc.cpu_percent(None)
            return proc.cpu_percent(None), int(proc.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            self._procs.pop(pid, None)
            return 0.0, 0

    def devices(self) -> list[metrics.GpuReading]:
        """Every GPU's use, memory, power and temperature (empty without pynvml or GPUs)."""
        out = []
        nvml = self._nvml
        for index in range(self.gpus if nvml is not None else 0):
            with contextlib.suppress(Exception):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                power = temp = None
                with contextlib.suppress(Exception):  # not every board reports these
                    power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0
                with contextlib.suppress(Exception):
                    temp = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
                out.append(
                    metrics.GpuReading(
                        index, float(util.gpu), int(mem.used), int(mem.total), power, temp
                    )
                )
        return out

    def capacity(self) -> ev.Resources:
        """What this node has: CPUs, its memory limit, GPUs."""
        if self._capacity is None:
            self._capacity = ev.Resources(
                cpu=float(len(os.sched_getaffinity(0))),
                memory_bytes=memory_limit(),
                gpus=self.gpus,
            )
        return self._capacity

    def forget(self, keep: set[int]) -> None:
        for pid in list(self._procs):
            if pid not in keep:
                del self._procs[pid]


def memory_limit() -> int:
    """The memory this process may use: cgroup v2 `memory.max`, `RLIMIT_AS`, or all of it."""
    limits = [int(psutil.virtual_memory().total)]
    own = cgroups.own_dir()
    if own is not None:
        with contextlib.suppress(OSError, ValueError):
            text = (own / "memory.max").read_text().strip()
            if text != "max":
                limits.append(int(text))
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        limits.append(int(soft))
    return min(limits)
