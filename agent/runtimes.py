"""Which `WorkerRuntime` runs an agent's workers: TensorFlow's for a parameter-server
job, torch's otherwise (each imported only when chosen: an agent of one runtime needs
nothing of the other)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rove.agent.runtime import WorkerRuntime

if TYPE_CHECKING:
    from rove.agent.config import AgentConfig


def tf_runtime(cfg: AgentConfig, incarnation: str) -> WorkerRuntime:
    """The TensorFlow runtime for `cfg` (a parameter-server job: `cfg.params.tf_ps`)."""
    from rove.agent.tf_runtime import TfRuntime

    assert isinstance(cfg.entrypoint, str), "a TensorFlow chief runs a command"
    return TfRuntime(
        [cfg.entrypoint, *cfg.args],
        cfg.log_dir or cfg.state_dir / "logs" / incarnation,
        cfg.state_dir / "progress" / incarnation,
        max_restarts=cfg.max_task_restarts,
        stop_timeout_s=cfg.stop_timeout_s,
        spares=cfg.tf_spares,
    )


def default_runtime(cfg: AgentConfig, incarnation: str) -> WorkerRuntime:
    """TensorFlow's for a parameter-server job, else torch's."""
    return (tf_runtime if cfg.params.tf_ps else torch_runtime)(cfg, incarnation)


def torch_runtime(cfg: AgentConfig, incarnation: str) -> WorkerRuntime:
    """The torch runtime for `cfg` (imported here: an agent of another runtime needs no torch)."""
    from rove.agent.workers import TorchRuntime

    return TorchRuntime(
        cfg.entrypoint,
        cfg.args,
        cfg.logs_specs,
        cfg.state_dir / "progress" / incarnation,
        start_method=cfg.start_method,
        name=cfg.role,
    )
