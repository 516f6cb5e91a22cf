"""Helpers for tests: free ports, NATS clusters, master processes, waiting."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rove.control.embedded import EmbeddedServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """Three `nats-server -js` nodes routed into one cluster on loopback."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.client_ports = [free_port() for _ in range(size)]
        self.route_ports = [free_port() for _ in range(size)]
        routes = ",".join(f"nats://127.0.0.1:{p}" for p in self.route_ports)
        self.nodes = [
            EmbeddedServer(
                root / f"n{i + 1}",
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
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)

    def start(self) -> None:
        for n in self.nodes:
            n.start()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


async def eventually(
    check: Callable[[], Awaitable[Any] | Any], *, timeout: float = 20.0, every: float = 0.05
) -> Any:
    """Poll `check` until it returns a truthy value; return it, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


class MasterProc:
    """A `rove master` subprocess with its log captured to a file."""

    def __init__(self, url: str, job: str, master_id: str, log_dir: Path, *extra: str) -> None:
        self.master_id = master_id
        self.log_path = log_dir / f"master-{master_id}.log"
        env = {**os.environ, "ROVE_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rove.control.cli.main",
                    "master",
                    "--job",
                    job,
                    "--id",
                    master_id,
                    "--nats",
                    url,
                    *extra,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
