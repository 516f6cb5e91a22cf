"""The worker runtime port: how an agent runs its node's worker processes.

The agent decides *when* workers start and stop (rounds, failures, signals);
a `WorkerRuntime` knows *what* a worker is and how to run it: torch
(`rove.agent.workers.TorchRuntime`: torchrun's way of starting workers, the
`@record` error file, fresh or warm-started interpreters) or TensorFlow
(`rove.agent.tf_runtime.TfRuntime`: a parameter-server round's chief, parameter
servers and workers, a worker restarted in place).
"""

from __future__ import annotations

import abc
import signal
from collections.abc import Callable
from dataclasses import dataclass

from rove.agent.diagnosis import Diagnosis
from rove.agent.progress import Progress
from rove.agent.stuck import Activity


@dataclass(frozen=True)
class RootFailure:
    """The failure that ended a round's workers on this node (not the teardown it caused)."""

    local_rank: int
    pid: int
    exit_code: int
    diagnosis: Diagnosis
    log_tail: str
    #: its stderr's file, where there is one
    log_path: str = ""
    #: where the script raised ("train.py:42"), where a traceback says
    where: str = ""
    #: the port of this node the round gave it that another process held (it could not
    #: listen there): rove's pick failed, not the worker; 0 otherwise
    port_taken: int = 0


@dataclass(frozen=True)
class TaskRestart:
    """A worker process that ended and was started again in place, in the same round
    (`restarts`: how many times so far in the round)."""

    local_rank: int
    role: str
    index: int
    exit_code: int
    diagnosis: Diagnosis
    restarts: int


@dataclass(frozen=True)
class WorkersEnded:
    """How one round's workers on this node ended: all with code 0, or `failure`."""

    round: int
    failure: RootFailure | None


class WorkerRuntime(abc.ABC):
    """Runs one round's worker processes on this node, one per local rank.

    The whole contract:

    * `start(round, envs)` starts one process per local rank, each with its
      environment, and returns local rank -> pid. It is only called while no
      workers run (the agent stops the previous round's first).
    * `wait()` returns once the round's workers ended: every one with code 0,
      or one failed and the others were torn down, with the failure that
      started it (diagnosed). It waits on the processes themselves (no polling
      loop) and may be cancelled at any time; a cancelled `wait` leaves the
      workers running.
    * `stop(sig, timeout_s)` ends every worker: `sig`, then SIGKILL after
      `timeout_s`. It blocks (call it from a thread) and does nothing when no
      workers run.
    * `running`, `round`, `pids()` and `progress()` (each local rank's last
      reported step) describe the workers now; `progress()` reads files and
      may be called from any thread.
    * `activity()` says what each live worker has done so far (CPU, I/O, steps,
      whether its script returned), for the agent's watch on workers stuck on their
      way out (`rove.agent.stuck`); `end(local_rank)` kills one such worker whose
      work was done: the round still counts as succeeded. Runtimes whose workers
      are not watched this way return {} and are never asked to `end` one.
    * `close()` lets go of what the runtime keeps between rounds (TensorFlow's spare
      tasks), once, as the agent ends.

    Implementations are safe to call from several threads: `wait` does its
    blocking work in one while `stop` may run in another.

    A runtime that restarts a process in place, without ending the round (a
    TensorFlow worker), tells `listener` of each restart.

    Raises:
        OSError: `start` could not start a process (the message names it).
    """

    listener: Callable[[TaskRestart], None] | None = None

    @property
    @abc.abstractmethod
    def running(self) -> bool: ...

    @property
    @abc.abstractmethod
    def round(self) -> int: ...

    @abc.abstractmethod
    def start(self, round_: int, envs: dict[int, dict[str, str]]) -> dict[int, int]: ...

    @abc.abstractmethod
    async def wait(self) -> WorkersEnded: ...

    @abc.abstractmethod
    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None: ...

    @abc.abstractmethod
    def pids(self) -> dict[int, int]: ...

    @abc.abstractmethod
    def progress(self) -> dict[int, Progress]: ...

    def activity(self) -> dict[int, Activity]:
        return {}

    def end(self, local_rank: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not end single workers")

    def close(self) -> None:
        """Let go of what the runtime keeps between rounds (the agent is ending)."""
        return  # (most keep nothing)
