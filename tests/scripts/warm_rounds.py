"""Writes what this warm worker found imported to OUT/<restart>-<rank>.json. In the
first round, rank 1 waits until the full warm server says it is ready (its file under
TMPDIR, rove.agent.forkservers) and then fails, so that the next round is forked from
it."""

import sys

found = {
    "dynamo": "torch._dynamo" in sys.modules,
    "torch": "torch" in sys.modules,
    "launcher_main": "rove.control.cli.main" in sys.modules or "nats" in sys.modules,
}

import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

out = Path(sys.argv[1])
restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
(out / f"{restart}-{rank}.json").write_text(json.dumps({**found, "ppid": os.getppid()}))
if restart == "0" and rank == "1":
    deadline = time.monotonic() + 300
    scratch = Path(tempfile.gettempdir())
    while not list(scratch.glob("rove-warm-full-*/ready")) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)
