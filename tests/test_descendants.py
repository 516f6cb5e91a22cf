"""A worker's descendants as signs of its life (`rove.agent.descendants`): real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from rove.agent.descendants import EVERY_S, Descendants, scan
from tests.support import patience

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < {}: pass\n"


def test_the_cpu_of_a_grandchild_counts_for_the_worker_that_started_it() -> None:
    # this test process plays the worker: a child that starts a busy grandchild
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY.format(30)!r}])"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        first = scan({0: os.getpid(), 1: child.pid})
        deadline = time.monotonic() + patience(30)
        while (later := scan({0: os.getpid(), 1: child.pid}))[0][0] < first[0][0] + 0.5:
            assert time.monotonic() < deadline, (first, later)
            time.sleep(0.1)
        assert later[1][0] > first[1][0], "the grandchild is the child's descendant too"
    finally:
        for process in [*psutil.Process(child.pid).children(recursive=True), child]:
            process.kill()
        child.wait()
    assert scan({0: child.pid}) == {0: (0.0, 0)}, "an exited worker has no descendants"


def test_the_live_descendants_are_scanned_at_most_every_few_seconds() -> None:
    now = [100.0]
    seen = Descendants(lambda: now[0])
    pids = {0: os.getpid()}
    first = seen.totals(pids)
    child = subprocess.Popen([sys.executable, "-c", BUSY.format(1)])
    child.wait()
    assert seen.totals(pids) is first, "kept between scans"
    now[0] += EVERY_S
    assert seen.totals(pids) is not first
