"""A 2-rank job that waits for a gate: rank 1 fails on its first attempt, then every
rank waits until the file GATE exists and returns (a job to read while it runs and after).

    rove run --standalone --nproc-per-node 2 --max-restarts 1 gated.py GATE
"""

import os
import sys
import time
from pathlib import Path

gate = Path(sys.argv[1])
rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"rank {rank} attempt {attempt}", flush=True)
if rank == "1" and attempt == "0":
    raise RuntimeError("the first attempt fails on purpose")
(gate.parent / f"waiting-{rank}").write_text(attempt)
while not gate.exists():
    time.sleep(0.05)
