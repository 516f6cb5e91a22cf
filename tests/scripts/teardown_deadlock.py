"""Forces torch's gloo teardown deadlock on rank 0 (rove.agent.groups), deterministically.

Rank 0 starts an all-reduce that rank 1 joins 2 s later, its work holding a Python
object torch stashed in its thread-local state (as every backward does); it then
destroys the group and drops the DDP module that held the group's last reference.
Without rove's hold on process groups, `~ProcessGroupGloo` runs under the GIL and
joins the gloo thread, which waits for the GIL to free the stashed object: rank 0
never prints "done". Rank 1 lets its own work finish first and returns.
"""

from __future__ import annotations

import gc
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class Stashed:
    """A plain Python object: its last decref needs the GIL."""


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")
    model = DistributedDataParallel(torch.nn.Linear(4, 4), process_group=group)
    model(torch.randn(2, 4)).sum().backward()
    print(f"rank {rank}: trained", flush=True)
    if rank == 0:
        time.sleep(0.5)  # the backward's own works are freed first: only this one is left
        torch._C._stash_obj_in_tls("context", Stashed())
        work = dist.all_reduce(torch.zeros(1), async_op=True, group=group)
        torch._C._remove_obj_from_tls("context")
        del work
    else:
        time.sleep(2)
        dist.all_reduce(torch.zeros(1), group=group)
        time.sleep(1)  # its own finished work is freed before it lets the group go
    dist.destroy_process_group(group)
    del group, model
    gc.collect()  # rank 0: ~Reducer -> ~ProcessGroupGloo under the GIL, without the hold
    if rank == 0:
        time.sleep(2)  # held: the all-reduce completes once rank 1 joins it
    print(f"rank {rank}: done", flush=True)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
