"""The network check a node runs before training: a timed matmul and allreduce.

Run by the agent as its own process, one per node, with RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT describing the node's check group (2 or 3 nodes,
or 1 for a single-node job). Prints one JSON line:
{"ok": true, "matmul_s": ..., "allreduce_s": ..., "elapsed_s": ...}.
gloo on CPU, NCCL when CUDA is available.

Two phases, so that a slow start on a busy machine is never mistaken for a
slow or broken network:

1. *start*: import torch, meet the group at its store (hosted by rank 0) and
   wait until every member is there. Bounded by `ROVE_NETCHECK_STARTUP_TIMEOUT`
   (generous: starting Python and importing torch takes seconds under load).
2. *check*: create the process group, time the matmul and the allreduce.
   Bounded by `ROVE_NETCHECK_TIMEOUT`; `elapsed_s` measures this phase only.

A member that fails says so in the store, and the others stop at once instead
of waiting out their timeout for it (a watchdog thread reads the store); a
member whose store went away (its host, rank 0, died) fails too. A failure
exits non-zero with `ok: false` and the error; the agent reports the node as
failed in this check round.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import threading
import time
from typing import Any

EXIT_FAILED = 3
EXIT_PEER_FAILED = 4
_FAILURES = "rove/netcheck/failures"


def _say(result: dict[str, Any]) -> None:
    print(json.dumps(result), flush=True)


def _watch_peers(store: Any, rank: int, world: int, stop: threading.Event) -> None:
    """Exit this process as soon as another member reports a failure."""
    while not stop.wait(0.2):
        try:
            failed = int(store.add(_FAILURES, 0))
            if failed:
                who = [
                    f"rank {r}: {store.get(f'rove/netcheck/failed/{r}').decode()}"
                    for r in range(world)
                    if r != rank and store.check([f"rove/netcheck/failed/{r}"])
                ]
                error = f"a peer of the check group failed ({'; '.join(who) or 'no detail'})"
            else:
                continue
        except Exception as exc:  # noqa: BLE001 - the store itself is gone: its host died
            if stop.is_set():
                return
            error = f"lost the check group's store (its host, rank 0, died?): {exc}"
        _say({"ok": False, "error": error})
        os._exit(EXIT_PEER_FAILED)


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    timeout = float(os.environ.get("ROVE_NETCHECK_TIMEOUT", "60"))
    startup = float(os.environ.get("ROVE_NETCHECK_STARTUP_TIMEOUT", str(max(120.0, timeout))))
    size = int(os.environ.get("ROVE_NETCHECK_MATMUL", "512"))
    elems = int(os.environ.get("ROVE_NETCHECK_ALLREDUCE", str(1 << 20)))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")

    # phase 1: meet the group (not timed)
    store = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=dt.timedelta(seconds=startup),
        wait_for_workers=False,
    )
    store.set(f"rove/netcheck/ready/{rank}", "1")
    store.wait([f"rove/netcheck/ready/{r}" for r in range(world)], dt.timedelta(seconds=startup))
    stop = threading.Event()
    # its own connection: the main thread's is busy inside the collectives
    peers = TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=dt.timedelta(seconds=startup),
    )
    watchdog = threading.Thread(
        target=_watch_peers, args=(peers, rank, world, stop), daemon=True, name="peers"
    )
    watchdog.start()

    # phase 2: the check itself (timed, bounded by the check timeout)
    started = time.perf_counter()
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=PrefixStore("rove/netcheck/pg", store),
            rank=rank,
            world_size=world,
            timeout=dt.timedelta(seconds=timeout),
        )
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
        expected = world**6  # each of 6 all_reduces multiplies by the world size
        ok = bool(torch.allclose(data[:8], torch.full((8,), float(expected), device=device)))
        elapsed = time.perf_counter() - started
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - any failure of the check is the check's result
        error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
        store.set(f"rove/netcheck/failed/{rank}", error)
        store.add(_FAILURES, 1)
        _say({"ok": False, "error": error})
        stop.set()
        if rank == 0:
            time.sleep(1.0)  # keep hosting the store while the others read why
        return EXIT_FAILED
    # rank 0 hosts the store: it leaves last
    store.set(f"rove/netcheck/done/{rank}", "1")
    stop.set()
    if rank == 0:
        store.wait([f"rove/netcheck/done/{r}" for r in range(world)], dt.timedelta(seconds=timeout))
    _say(
        {
            "ok": ok,
            "matmul_s": round(matmul, 4),
            "allreduce_s": round(allreduce, 4),
            "elapsed_s": round(elapsed, 4),
        }
    )
    return 0 if ok else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
