"""The tasks of a TensorFlow parameter-server round, and each task's `TF_CONFIG` (pure).

A TensorFlow job (`rove run --tf-ps`) is a rendezvous round like any other:
its world is the sum of its members' local processes. The master gives every
rank a role, in rank order: rank 0 is the **chief** (the coordinator, which
runs the user's script with a `ClusterCoordinator`), the next `num_ps` ranks
are **parameter servers**, and the rest are **workers**. Each task serves on
its node's address at a port its node offered when it joined (one per local
process), so a task restarted within the round keeps its address:

    node a (2 processes)      node b (2 processes)
    rank 0 chief  a:41001     rank 2 worker 0  b:42001
    rank 1 ps 0   a:41002     rank 3 worker 1  b:42002

Nodes started with `rove run --tf-role ps` host the parameter servers instead (each
of their processes is one), so they can be sized for them (memory for the
variables, no accelerator); the chief is then the first process of the other nodes.

The tasks ride in `round_completed.tasks`; agents build `TF_CONFIG` from them.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence

from rove.control.catalogue.events import RoundMember, TfTask
from rove.control.domain.words import counted

CHIEF = "chief"
PS = "ps"
WORKER = "worker"
ROLES = (CHIEF, PS, WORKER)


def role_of(rank: int, num_ps: int) -> tuple[str, int]:
    """(role, index in the role) of `rank`."""
    if rank == 0:
        return CHIEF, 0
    if rank <= num_ps:
        return PS, rank - 1
    return WORKER, rank - 1 - num_ps


def problem(world: int, num_ps: int) -> str | None:
    """Why a round of `world` processes cannot run a job of `num_ps` parameter servers."""
    if world < num_ps + 2:
        return (
            f"a TensorFlow job with {counted(num_ps, 'parameter server')} "
            f"needs at least {num_ps + 2} processes (a chief, the parameter servers and a "
            f"worker); this round has {world}: add nodes or --nproc-per-node"
        )
    return None


def assign(
    members: Sequence[RoundMember],
    ports: Mapping[str, Sequence[int]],
    num_ps: int,
    ps_nodes: Collection[str] = frozenset(),
) -> tuple[TfTask, ...] | str:
    """The round's tasks, by rank, or why there are none (too few processes, or a node
    that offered fewer ports than it runs processes).

    Roles follow rank order, unless some members host parameter servers (`ps_nodes`,
    `rove run --tf-role ps`: nodes sized for them): then their processes are the
    parameter servers, the first process of the other nodes is the chief and the rest
    are workers."""
    world = sum(m.nproc for m in members)
    why = problem(world, num_ps)
    if why is not None:
        return why
    hosts = [m for m in members if m.node in ps_nodes]
    if hosts:
        offered = sum(m.nproc for m in hosts)
        names = ", ".join(m.node for m in hosts)
        if offered != num_ps:
            return (
                f"the nodes that host parameter servers (--tf-role ps: {names}) run "
                f"{counted(offered, 'process', 'processes')} for "
                f"{counted(num_ps, 'parameter server')} (--num-ps): a round waits until they match"
            )
    tasks = []
    ps_index, other = 0, 0
    for m in members:
        offered_ports = ports.get(m.node, ())
        if len(offered_ports) < m.nproc:
            return (
                f"node {m.node} offered {len(offered_ports)} free ports for its {m.nproc} "
                "TensorFlow tasks; it joins again with more"
            )
        for local in range(m.nproc):
            rank = m.first_rank + local
            if not hosts:
                role, index = role_of(rank, num_ps)
            elif m.node in ps_nodes:
                role, index, ps_index = PS, ps_index, ps_index + 1
            else:
                role, index = (CHIEF, 0) if other == 0 else (WORKER, other - 1)
                other += 1
            tasks.append(TfTask(role, index, rank, m.node, m.addr, offered_ports[local]))
    return tuple(tasks)


def cluster(tasks: Sequence[TfTask]) -> dict[str, list[str]]:
    """The cluster spec: each role's addresses, by index."""
    spec: dict[str, list[str]] = {}
    for role in ROLES:
        mine = sorted((t for t in tasks if t.role == role), key=lambda t: t.index)
        if mine:
            spec[role] = [f"{t.addr}:{t.port}" for t in mine]
    return spec


def tf_config(tasks: Sequence[TfTask], rank: int) -> str:
    """`TF_CONFIG` for the task of `rank` (gRPC: what `TFConfigClusterResolver` gives
    `ParameterServerStrategy`)."""
    task = next(t for t in tasks if t.rank == rank)
    return json.dumps(
        {
            "cluster": cluster(tasks),
            "task": {"type": task.role, "index": task.index},
            "rpc_layer": "grpc",
        },
        sort_keys=True,
    )


def chief(tasks: Sequence[TfTask]) -> TfTask | None:
    return next((t for t in tasks if t.role == CHIEF), None)


def describe(tasks: Sequence[TfTask]) -> str:
    """'chief n0:41001; ps 0 n0:41002; worker 0 n1:42001, ...' for logs and status."""
    return "; ".join(
        f"{t.role}{'' if t.role == CHIEF else f' {t.index}'} on {t.node} ({t.addr}:{t.port})"
        for t in tasks
    )
