"""Writes what this warm worker found imported to OUT/<restart>-<rank>.json. Every
worker imports `manymods` (a package of many modules on PYTHONPATH, which no warm server
preloads: rove.agent.forkservers.LEARN_AT_LEAST). In the first round,
rank 0 returns at once (its list of imports is written as it ends) and rank 1 reports
enough steps for its list to settle, waits until the warm server that learned them says
it is ready (its file under TMPDIR, rove.agent.forkservers), then fails, so that the
next round is forked from it."""

import sys

found = {
    "dynamo": "torch._dynamo" in sys.modules,
    "torch": "torch" in sys.modules,
    "launcher_main": "rove.control.cli.main" in sys.modules or "rove.agent.launcher" in sys.modules,
    "manymods": "manymods" in sys.modules,
}

import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import manymods  # noqa: E402, F401

from rove.agent import imports, progress  # noqa: E402

out = Path(sys.argv[1])
restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
# (a server forked from another has that one's command line: the quick server's)
server = Path(f"/proc/{os.getppid()}/cmdline").read_text().replace("\0", " ")
(out / f"{restart}-{rank}.json").write_text(
    json.dumps({**found, "ppid": os.getppid(), "server": server})
)
if restart == "0" and rank == "1":
    for step in range(1, imports.FINAL_AFTER_STEPS + 1):
        progress.report(step)
    deadline = time.monotonic() + 300
    scratch = Path(tempfile.gettempdir())
    step = imports.FINAL_AFTER_STEPS
    while not list(scratch.glob("rove-warm-learned-*/ready")) and time.monotonic() < deadline:
        step += 1
        progress.report(step)  # (at work, not stuck: rank 0 returned)
        time.sleep(0.05)
    sys.exit(3)
