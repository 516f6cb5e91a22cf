"""A 2-rank job whose first round's rendezvous store port is taken: in round 1, rank 0
writes its MASTER_PORT to DIR/port and waits for DIR/held (the test then listens on that
port), then every rank joins the process group, which rank 0's store cannot serve. In
any later round every rank joins, runs an all-reduce and returns.

    rove run --standalone --nproc-per-node 2 --max-restarts 0 store_port_taken.py DIR
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

here = Path(sys.argv[1])
rank = int(os.environ["RANK"])
first = not (here / f"joined-{rank}").exists()
(here / f"joined-{rank}").write_text(os.environ["MASTER_PORT"])
if first and rank == 0:
    (here / "port").write_text(os.environ["MASTER_PORT"])
    while not (here / "held").exists():
        time.sleep(0.05)
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {rank} on port {os.environ['MASTER_PORT']}: {t.item():g}", flush=True)
dist.destroy_process_group()
