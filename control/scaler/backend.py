"""The backend port: how a scaler starts and stops the nodes of a managed job.

A backend is the only part of rove that creates or destroys nodes. The scaler
(`rove.control.scaler.service`) calls it for each `scale_plan` and reports the
outcome; everything a backend needs to know comes from the plan and the
submitted workload. Backends: `local` (processes on this machine), `pool`
(idle `rove agent` daemons), and, in its own module, `kubernetes`.
"""

from __future__ import annotations

import abc

import msgspec

from rove.control.catalogue import events as ev


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A node a backend created for a job."""

    node: str
    where: str
    running: bool
    exit_code: int | None = None


#: At most this much of a failed node's last line goes into its `node_gone` reason.
LAST_WORDS_CHARS = 400


def last_line(text: str) -> str:
    """The last line of `text` that says something, cut to `LAST_WORDS_CHARS`."""
    lines = [x.strip() for x in text.splitlines()]
    return next((x for x in reversed(lines) if x), "")[:LAST_WORDS_CHARS]


class Ended(msgspec.Struct, frozen=True, kw_only=True):
    """A node whose process (pod, assignment) ended; a failed one's `reason` ends with
    the last line it wrote, where the backend can read it (`rove run`'s refusal)."""

    node: str
    reason: str
    exit_code: int | None = None


class Pending(msgspec.Struct, frozen=True, kw_only=True):
    """A node the backend cannot place (no machine has room for it), and why."""

    node: str
    reason: str


class Backend(abc.ABC):
    """Creates and stops nodes. The whole contract:

    * `launch(job, spec, workload, deadline)`: node `spec.node` exists and runs
      `rove run --job job --node-id spec.node <workload.argv>` in `workload.cwd`
      with `spec.resources` as its limits, connected to the scaler's NATS.
      **Idempotent, at most once**: a node of that name that exists, or existed
      (it ran and ended), is success and is not started again. Returns where the
      node runs, in words (a pid, a daemon, a pod).
    * `remove(job, node, deadline)`: the node is asked to stop (SIGTERM, a pod
      deletion), then stopped by force after its grace period. A node that is
      not there is success.
    * `nodes(job)`: every node this backend created for `job`, running or not:
      what a restarted scaler finds.
    * `ended(job)`: nodes of `job` whose process ended since the last call
      (each reported once), so the scaler can tell the master without waiting
      for heartbeats to time out.
    * `pending(job)`: nodes that the backend knows cannot be placed (a pod the
      scheduler finds no room for), each reported once; optional (default: none,
      the master then only sees that the node never joined).
    * Errors: `TemporaryError` (retrying may succeed: no room yet, an API
      unavailable; `retry_after` when the backend knows), `PermanentError`
      (retrying cannot help: a bad spec). Nothing else escapes.
    * Every call returns or raises `TemporaryError` by `deadline` (a
      `time.monotonic()` value): the scaler's total budget for the plan.
    * `close()` releases clients; it never stops nodes.
    """

    #: the backend's name in events and logs
    name: str = "backend"

    @abc.abstractmethod
    async def launch(
        self, job: str, spec: ev.NodeLaunch, workload: ev.Workload, deadline: float
    ) -> str: ...

    @abc.abstractmethod
    async def remove(self, job: str, node: str, deadline: float) -> None: ...

    @abc.abstractmethod
    async def nodes(self, job: str) -> list[NodeInfo]: ...

    @abc.abstractmethod
    async def ended(self, job: str) -> list[Ended]: ...

    async def pending(self, job: str) -> list[Pending]:
        return []

    async def close(self) -> None:  # noqa: B027 - optional
        """Release clients; nodes keep running."""
