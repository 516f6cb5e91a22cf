"""The environment each worker process gets, the same variables torchrun sets (pure); in
a TensorFlow round also its task's TF_CONFIG."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rove.control.catalogue.events import RestoreSource, RoundCompleted, RoundMember
from rove.control.domain import tf_cluster

if TYPE_CHECKING:
    from rove.agent.config import AgentConfig


def member_of(
    round_: RoundCompleted, node: str, incarnation: str
) -> tuple[int, RoundMember] | None:
    for group_rank, m in enumerate(round_.members):
        if m.node == node and m.incarnation == incarnation:
            return group_rank, m
    return None


def worker_envs(
    round_: RoundCompleted,
    group_rank: int,
    member: RoundMember,
    *,
    job: str,
    max_restarts: int,
    role: str = "default",
    extra: dict[str, str] | None = None,
) -> dict[int, dict[str, str]]:
    """local_rank -> environment, as torchrun's LocalElasticAgent builds it."""
    envs: dict[int, dict[str, str]] = {}
    for local_rank in range(member.nproc):
        rank = member.first_rank + local_rank
        env = {
            "LOCAL_RANK": str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(group_rank),
            "ROLE_RANK": str(rank),
            "ROLE_NAME": role,
            "LOCAL_WORLD_SIZE": str(member.nproc),
            "WORLD_SIZE": str(round_.world_size),
            "GROUP_WORLD_SIZE": str(len(round_.members)),
            "ROLE_WORLD_SIZE": str(round_.world_size),
            "MASTER_ADDR": round_.master_addr,
            "MASTER_PORT": str(round_.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(round_.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
            "TORCHELASTIC_RUN_ID": job,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "ROVE_JOB": job,
            "ROVE_ROUND": str(round_.round),
            "ROVE_NODE": member.node,
        }
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        if round_.tasks:
            env.update(tf_env(round_, rank))
        env.update(extra or {})
        envs[local_rank] = env
    return envs


#: TensorFlow's C++ log level in its tasks unless the user sets `TF_CPP_MIN_LOG_LEVEL`:
#: warnings and errors, no INFO.
TF_LOG_LEVEL = "1"


def tf_env(round_: RoundCompleted, rank: int) -> dict[str, str]:
    """A TensorFlow task's environment: its TF_CONFIG, role and index, gRPC set to fail
    fast (the coordinator learns of a dead task at once, as TF's docs require), and
    TensorFlow's own log at warnings and above unless the user said otherwise
    (`TF_CPP_MIN_LOG_LEVEL`: at its default the coordinator's console was half
    TensorFlow's INFO lines, one "Ignoring error status when releasing multi-device
    function handle" a step)."""
    task = next(t for t in round_.tasks if t.rank == rank)
    return {
        "TF_CONFIG": tf_cluster.tf_config(round_.tasks, rank),
        "ROVE_TF_ROLE": task.role,
        "ROVE_TF_INDEX": str(task.index),
        "GRPC_FAIL_FAST": "use_caller",
        "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", TF_LOG_LEVEL),
    }


def rove_env(
    r: RoundCompleted, cfg: AgentConfig, job_run: str, bus_env: dict[str, str]
) -> dict[str, str]:
    """What rove adds to every worker's environment in round `r`: where to restore
    from, the checkpoint folder, the node and the run, and (`bus_env`) how the data
    clients in the workers reach NATS; then the user's `cfg.worker_env`."""
    env = {
        "ROVE_RESTORE_STEP": "" if r.restore_step is None else str(r.restore_step),
        # (a peer's ranks are in this node's memory before the workers start)
        "ROVE_RESTORE_SOURCE": (
            "memory" if r.restore_source is RestoreSource.PEER else r.restore_source.value
        ),
        **bus_env,
        "ROVE_NODE": cfg.node,
        "ROVE_JOB_RUN": job_run,
    }
    if cfg.checkpoint_dir is not None:
        env["ROVE_CKPT_DIR"] = str(cfg.checkpoint_dir)
    if cfg.worker_auth is not None:
        env["ROVE_NATS_AUTH"] = str(cfg.worker_auth)
    env.update(cfg.worker_env)
    return env
