"""Small helpers the benchmarks share: free ports, trainers' JSON-lines traces, waiting,
a job's master on an embedded NATS server, a simulated agent's heartbeat, a CPU-bound
process beside a measurement.

Imported as `common` (a benchmark runs as `python benchmarks/NAME.py`, so this
folder is on its path).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rove.agent import ports
from rove.control.catalogue import events as ev


def free_port() -> int:
    """A port for a benchmark's server, from the ones rove's agents offer (below the
    kernel's ephemeral range, where no outgoing connection takes it before the bind)."""
    return ports.free_ports("127.0.0.1", 1)[0]


def trace_rows(trace: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of `trace` ([] before it exists)."""
    out = []
    if trace.exists():
        for line in trace.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line being written right now
    return out


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM to `proc` (a launcher: it stops its job), SIGKILL after `timeout`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """`check()`'s first truthy value, polled every 50 ms.

    Raises:
        TimeoutError: naming `what`, after `timeout` seconds.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(f"gave up waiting for {what} after {timeout:.0f}s")


@contextlib.contextmanager
def cpu_bound_beside(on: bool = True) -> Iterator[str]:
    """One CPU-bound process (a busy loop) while the block runs, as a machine whose
    other work keeps a core busy; yields what to record as `beside`."""
    if not on:
        yield "nothing"
        return
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield "1 CPU-bound process"
    finally:
        burner.kill()
        burner.wait()


@contextlib.contextmanager
def job_master(
    folder: Path, job: str, level: str = "warning", *, sync_always: bool = True
) -> Iterator[tuple[str, list[int]]]:
    """An embedded `nats-server -js` in `folder` (fsyncing every message, as rove's
    embedded server does, unless `sync_always` is False) and a `rove master` of `job` on
    it: yields the server's URL and both pids. Stops both on the way out; on an error,
    the master's last log lines go to stderr first."""
    from rove.control.bus.embedded import EmbeddedServer

    server = EmbeddedServer(folder / "nats", sync_always=sync_always)
    server.start()
    assert server.url is not None and server.proc is not None
    log = folder / "master.log"
    master = subprocess.Popen(
        [
            *(sys.executable, "-m", "rove.control.cli.main", "master"),
            *("--job", job, "--nats", server.url),
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "ROVE_LOG_LEVEL": level},
    )
    try:
        yield server.url, [master.pid, server.proc.pid]
    except BaseException:
        sys.stderr.write(log.read_text()[-3000:])
        raise
    finally:
        master.terminate()
        master.wait(20)
        server.stop()


def sim_heartbeat(job: str, node: str, incarnation: str, seq: int, ts: float) -> ev.Heartbeat:
    """Heartbeat `seq` of a simulated agent: a busy node, no workers' figures."""
    return ev.Heartbeat(
        **ev.node_envelope(job, node, incarnation, ts, "hb", seq),
        seq=seq,
        cpu_percent=50.0,
        mem_used_bytes=2**34,
        mem_total_bytes=2**36,
        ranks=(),
    )
