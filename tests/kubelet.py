"""The part of Kubernetes that `kmock` lacks: a kubelet that runs its pods here.

`kmock`'s emulator is an API server over real HTTP (objects stored, 409 on a
second create, deletions), but nothing schedules or runs the pods it stores.
`Kubelet` does, for the backend tests: every pod of its namespace whose
`rove` container asks for no more memory than the kubelet's capacity runs as
a real `rove ...` process (its args, env and workingDir), its status set to
Running, then to Succeeded / Failed with the container's exit code when the
process ends (and, for `terminationMessagePolicy: FallbackToLogsOnError`, its log's
tail as the termination message); a deleted pod's process gets SIGTERM, then SIGKILL after the
pod's grace period. A pod that does not fit stays Pending with the scheduler's
`PodScheduled=False, reason=Unschedulable` condition.

It is not a model of a real kubelet (no images, no volumes, no probes): only
what the scaler's backend reads from pod status is produced.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from pathlib import Path
from typing import Any

import kmock

from rove.control.scaler.kubernetes import KubernetesBackend, api_client
from tests.support import CliProc

PODS = kmock.resource("", "v1", "pods")


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 10**3, "M": 10**6, "G": 10**9}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


class PodProc(CliProc):
    """A pod's `rove` container, run as a local process."""

    grace_s = 10.0

    def __init__(self, name: str, container: dict[str, Any], log_dir: Path) -> None:
        self.container = container
        self.log_path = log_dir / f"pod-{name}.log"
        args = list(container.get("args") or [])
        env = {e["name"]: str(e.get("value", "")) for e in container.get("env") or []}
        cwd = container.get("workingDir")
        self._spawn(
            f"pod {name}",
            self.log_path,
            *args,
            env=env,
            cwd=Path(cwd) if cwd else None,
        )


class Kubelet:
    def __init__(
        self, emulator: kmock.KubernetesEmulator, namespace: str, log_dir: Path, memory: int = 0
    ) -> None:
        self.emulator = emulator
        self.namespace = namespace
        self.log_dir = log_dir
        self.memory = memory
        self.procs: dict[str, PodProc] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Kubelet:
        # a real API server lists no pods as an empty list; kmock wants them declared
        self.emulator.resources["v1/pods"] = {}
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for proc in self.procs.values():
            await asyncio.to_thread(proc.stop)

    async def _loop(self) -> None:
        while True:
            self.sync()
            await asyncio.sleep(0.1)

    def sync(self) -> None:
        for (resource, namespace, name), obj in list(self.emulator.objects.items()):
            if resource != PODS or namespace != self.namespace:
                continue
            proc = self.procs.get(name)
            if obj.deleted:
                if proc is not None and proc.proc.poll() is None:
                    proc.proc.terminate()  # stop() at exit escalates to SIGKILL
                continue
            if proc is None:
                if not (obj.get("status") or {}).get("phase"):
                    self._admit(name, obj)
                continue
            code = proc.proc.poll()
            phase = (obj.get("status") or {}).get("phase")
            if code is not None and phase == "Running":
                obj.patch({"status": _terminated(code, _message(proc, code))})

    def _admit(self, name: str, obj: Any) -> None:
        container = (obj.get("spec") or {}).get("containers", [{}])[0]
        wanted = ((container.get("resources") or {}).get("requests") or {}).get("memory")
        if self.memory and wanted and _bytes(wanted) > self.memory:
            if not (obj.get("status") or {}).get("conditions"):
                obj.patch({"status": _unschedulable(wanted)})
            return
        self.procs[name] = PodProc(name, container, self.log_dir)
        obj.patch(
            {
                "status": {
                    "phase": "Running",
                    "startTime": _now(),
                    "containerStatuses": [_status(container["name"], {"running": {}})],
                }
            }
        )


def _message(proc: PodProc, code: int) -> str:
    """The termination message: with `FallbackToLogsOnError`, a failed container's log
    tail (Kubernetes keeps its last 80 lines, at most 2048 bytes)."""
    if code == 0 or proc.container.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        tail = proc.log_path.read_bytes()[-2048:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(tail.splitlines()[-80:])


def _terminated(code: int, message: str = "") -> dict[str, Any]:
    return {
        "phase": "Succeeded" if code == 0 else "Failed",
        "containerStatuses": [
            _status(
                "node",
                {
                    "terminated": {
                        "exitCode": code if code >= 0 else 128 - code,
                        "reason": "Completed" if code == 0 else "Error",
                        "finishedAt": _now(),
                        **({"message": message} if message else {}),
                    }
                },
            )
        ],
    }


def _status(name: str, state: dict[str, Any]) -> dict[str, Any]:
    # every field the official client's model requires
    return {
        "name": name,
        "state": state,
        "ready": "running" in state,
        "restartCount": 0,
        "image": "rove:test",
        "imageID": "",
    }


def _unschedulable(memory: str) -> dict[str, Any]:
    return {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "lastTransitionTime": _now(),
                "message": f"0/1 nodes are available: 1 Insufficient memory (asked {memory}).",
            }
        ],
    }


def backend_for(
    server: kmock.Server, nats_url: str = "nats://127.0.0.1:4222", **kw: Any
) -> KubernetesBackend:
    """A kubernetes backend for namespace rove-jobs, talking to `server` over HTTP."""
    return KubernetesBackend(
        namespace="rove-jobs",
        image="rove:test",
        nats_url=nats_url,
        api=api_client(str(server.url).rstrip("/")),
        **kw,
    )
