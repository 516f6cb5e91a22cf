"""Writes whether `localmod` (a `--preload` module in the working folder) was imported
before this worker's first line to OUT/<restart>-<rank>.json. In the first round both
ranks wait until the full warm server is ready (its file under TMPDIR,
rove.agent.forkservers), then rank 1 fails, so that the next round is forked from it."""

import sys

found = "localmod" in sys.modules

import json  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

out = Path(sys.argv[1])
restart, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
(out / f"{restart}-{rank}.json").write_text(json.dumps({"localmod": found}))
if restart == "0":
    deadline = time.monotonic() + 300
    scratch = Path(tempfile.gettempdir())
    while not list(scratch.glob("rove-warm-full-*/ready")) and time.monotonic() < deadline:
        time.sleep(0.05)
    if rank == "1":
        sys.exit(3)
