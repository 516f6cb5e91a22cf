"""What a worker sees of how it was started, as one JSON file per rank in OUT.

    LAUNCHER ... probe.py OUT

Written in the style of a script from elsewhere: nothing rove-specific. Records the
launcher-set environment, how the script runs (`__name__`, argv, sys.path[0], cwd),
signal dispositions, the multiprocessing start method, logging, threads, open file
descriptors, and random draws: unseeded (must differ across ranks, as under torchrun)
and seeded (must equal torchrun's exactly).
"""

import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch

out = Path(sys.argv[1])

LAUNCHER_ENV = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
]


def disposition(sig):
    handler = signal.getsignal(sig)
    if isinstance(handler, signal.Handlers):
        return handler.name
    return getattr(handler, "__name__", str(handler))


def open_fds():
    fds = []
    for entry in Path("/proc/self/fd").iterdir():
        try:
            target = str(entry.readlink())
        except OSError:
            continue  # the listing's own descriptor
        if int(entry.name) > 2 and not target.startswith(("/proc", "anon_inode")):
            fds.append(target)
    return sorted(fds)


report = {
    "env": {k: os.environ.get(k) for k in LAUNCHER_ENV},
    "env_master_port_set": "MASTER_PORT" in os.environ,
    "env_error_file_set": "TORCHELASTIC_ERROR_FILE" in os.environ,
    "name": __name__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "cwd": str(Path.cwd()),
    "signals": {
        s.name: disposition(s)
        for s in (
            signal.SIGINT,
            signal.SIGTERM,
            signal.SIGPIPE,
            signal.SIGCHLD,
            signal.SIGHUP,
            signal.SIGQUIT,
            signal.SIGUSR1,
        )
    },
    "start_method": multiprocessing.get_start_method(),
    "logging_handlers": len(logging.getLogger().handlers),
    "logging_level": logging.getLogger().level,
    "threads": threading.active_count(),
    "own_session": os.getsid(0) == os.getpid(),
    "open_files": open_fds(),
    "torch_threads": torch.get_num_threads(),
    "draws": {
        "torch": torch.rand(2).tolist(),
        "numpy": np.random.rand(2).tolist(),
        "random": [random.random(), random.random()],
    },
    "torch_initial_seed": torch.initial_seed(),
}
random.seed(1234)
np.random.seed(1234)
torch.manual_seed(1234)
report["seeded"] = {
    "torch": torch.rand(2).tolist(),
    "numpy": np.random.rand(2).tolist(),
    "random": [random.random(), random.random()],
}
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(report, sort_keys=True))
print(f"rank {os.environ['RANK']} probed", flush=True)
