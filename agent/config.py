"""What a node's agent is told to do (`rove run`'s arguments, checked and resolved by
the launcher): the job, the node, its workers and their restarts, the duties' timings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rove.agent.faults import Fault
from rove.control.catalogue import events as ev


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    job: str
    node: str
    addr: str
    nproc: int
    params: ev.RdzvParams
    #: A command, or a function (warm start: forked from the warm server).
    entrypoint: str | Callable[..., None]
    args: list[str]
    logs_specs: Any
    state_dir: Path
    max_restarts: int
    #: TensorFlow: how often one worker is restarted in place per round (`--max-worker-restarts`)
    max_task_restarts: int = 10
    role: str = "default"
    heartbeat_s: float = 1.0
    #: How often checkpoints are reported/persisted and hangs looked for.
    duty_s: float = 0.25
    hang_timeout_s: float = 0.0
    #: A worker quiet this long after it or a peer returned from its script is stuck
    #: on its way out (`rove.agent.exit_watch`).
    exit_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0
    start_method: str = "spawn"
    #: Extra modules the warm server imports (warm start only).
    preload: tuple[str, ...] = ()
    #: The warm server for restarts also imports what the workers imported (warm start
    #: only; `rove.agent.imports`, `--no-learn-imports` turns it off).
    learn_imports: bool = True
    #: TensorFlow: keep spare tasks that imported TensorFlow (`rove.agent.tf_spare`)
    tf_spares: bool = True
    #: TensorFlow: "ps" when this node hosts parameter servers only (`--tf-role ps`)
    tf_role: str = ""
    #: where flash checkpoints persist: a directory or an object store's URL (s3://...)
    checkpoint_dir: str | None = None
    save_at_breakpoint: bool = False
    keep_checkpoints: int = 3
    persist_every: int = 1
    #: peers each flash checkpoint is sent to, into their memory (`--peer-replicas`; 0: none)
    replicas: int = 1
    #: the most bytes of its peers' replicas this node's agent holds (`--peer-memory`)
    replica_budget: int = 8 << 30
    #: this node's failure domain: replicas go to peers of another one first
    failure_domain: str = ""
    #: More environment for the workers (e.g. ROVE_KAFKA_BOOTSTRAP from `--kafka-*`).
    worker_env: tuple[tuple[str, str], ...] = ()
    #: Where a TensorFlow round's task logs go (default: under the state dir).
    log_dir: Path | None = None
    #: The workers' own credentials (`rove.control.bus.auth`, the trainer role), when the
    #: agent's are not theirs to use (a standalone job: the agent's are the master's too)
    worker_auth: Path | None = None
    #: Faults to inject on purpose (`--inject-fault`, `rove.agent.faults`).
    faults: tuple[Fault, ...] = ()

    @property
    def ports_offered(self) -> int:
        """Free ports a node offers when it joins: one per task in a TensorFlow job
        (each task serves on one), else two (the next round's rendezvous store)."""
        return self.nproc + 1 if self.params.tf_ps else 2
