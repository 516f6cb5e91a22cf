"""The network check a node runs before training: a timed matmul and allreduce.

Run by the agent as its own process, one per node, with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT describing the node's check group (2 or 3 nodes,
or 1 for a single-node job). Prints one JSON line:
{"ok": true, "matmul_s": ..., "allreduce_s": ..., "elapsed_s": ...}.
gloo on CPU, NCCL when CUDA is available. A failure to connect, a collective
error or a timeout exits non-zero; the agent reports the node as failed.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import time


def main() -> int:
    import torch
    import torch.distributed as dist

    timeout = float(os.environ.get("ROVE_NETCHECK_TIMEOUT", "60"))
    size = int(os.environ.get("ROVE_NETCHECK_MATMUL", "512"))
    elems = int(os.environ.get("ROVE_NETCHECK_ALLREDUCE", str(1 << 20)))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    started = time.perf_counter()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=dt.timedelta(seconds=timeout))
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    (a @ b).sum().item()  # warm up
    t = time.perf_counter()
    for _ in range(10):
        c = a @ b
    c.sum().item()
    matmul = time.perf_counter() - t
    data = torch.ones(elems, device=device)
    dist.all_reduce(data)  # warm up
    t = time.perf_counter()
    for _ in range(5):
        dist.all_reduce(data)
    data.sum().item()
    allreduce = time.perf_counter() - t
    expected = dist.get_world_size() ** 6  # each of 6 all_reduces multiplies by the world size
    ok = bool(torch.allclose(data[:8], torch.full((8,), float(expected), device=device)))
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "ok": ok,
                "matmul_s": round(matmul, 4),
                "allreduce_s": round(allreduce, 4),
                "elapsed_s": round(time.perf_counter() - started, 4),
            }
        ),
        flush=True,
    )
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
