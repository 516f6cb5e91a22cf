"""The `kubernetes` backend: one pod per node, through the official `kubernetes` client.

What it asks of the API server is built by `rove.control.scaler.pods` (pure);
this module only talks to the server, in a worker thread per call (the
official client is synchronous), each call bounded by the plan's deadline.

* `launch`: make sure the job's anchor ConfigMap exists, record the node name
  in it (write first: a pod that ran and was deleted is never created again),
  then create the pod. `409 AlreadyExists` is "already there", not an error.
* `remove`: delete the pod with a grace period; `404` is success.
* `nodes`: the job's pods, plus names the anchor records whose pods are gone.
* `ended`: pods that succeeded or failed (with the container's exit code and
  Kubernetes' reason, `OOMKilled` included), and pods that vanished (evicted,
  deleted by someone else), each reported once.
* `pending`: pods the scheduler has not been able to place for
  `pending_timeout_s`, with the scheduler's message: the master's optimiser
  retries them smaller or goes on without them.

Errors: a refused request that retrying cannot fix (`400`, `403`, `404` on the
namespace, `422`) is a `PermanentError` that says which permission or field is
wrong; a server error, `429` (its `Retry-After` honoured) or a connection
failure is a `TemporaryError`, which the scaler retries with exponential
backoff inside the plan's deadline (`rove.control.bus.retry`).

The client is the official one, but these tests run it against an HTTP-level
emulator (`kmock`), not a live cluster: see docs/kubernetes.md for what that
leaves unexercised.
"""

from __future__ import annotations

import asyncio
import calendar
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog
import urllib3.exceptions
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError, PermanentError, TemporaryError
from rove.control.scaler import pods
from rove.control.scaler.backend import Backend, Ended, NodeInfo, Pending

log = structlog.get_logger("rove.scaler.kubernetes")

T = TypeVar("T")

#: Seconds a pod gets between SIGTERM and SIGKILL when a plan removes its node.
GRACE_S = 30


def api_client(host: str | None = None) -> k8s.ApiClient:
    """An API client: `host` (tests, a proxy), else in-cluster, else `~/.kube/config`."""
    if host:
        conf = k8s.Configuration()
        conf.host = host
        return k8s.ApiClient(conf)
    try:
        k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
    except k8s_config.ConfigException:
        try:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        except (k8s_config.ConfigException, FileNotFoundError) as exc:
            raise ConfigError(
                "no Kubernetes API to talk to: not in a pod with a service account, and no "
                f"usable ~/.kube/config ({exc}); run the scaler in the cluster (deploy/) or "
                "point KUBECONFIG at one"
            ) from exc
    return k8s.ApiClient()


def load_template(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        loaded = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the pod template {path}: {exc}") from exc
    if not isinstance(loaded, dict) or loaded.get("kind", "Pod") != "Pod":
        raise ConfigError(f"{path} must hold one Pod (kind: Pod), the template of every node")
    return loaded


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(
        self,
        *,
        namespace: str,
        image: str,
        nats_url: str,
        api: k8s.ApiClient | None = None,
        template: dict[str, Any] | None = None,
        pending_timeout_s: float = 120.0,
        grace_s: int = GRACE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.namespace = namespace
        self.image = image
        self.nats_url = nats_url
        self.api = api or api_client()
        self.core = k8s.CoreV1Api(self.api)
        self.template = template
        self.pending_timeout_s = pending_timeout_s
        self.grace_s = grace_s
        self.clock = clock
        self._anchor_uid: dict[str, str] = {}
        self._seen: dict[str, set[str]] = {}  # job -> node names seen with a pod
        self._reported: dict[str, set[str]] = {}  # job -> nodes reported ended
        self._flagged: dict[str, set[str]] = {}  # job -> nodes reported pending

    # ------------------------------------------------------------------ calls

    def _plain(self, model: Any) -> dict[str, Any]:
        """The client's model object as the API's JSON (camelCase keys)."""
        out: dict[str, Any] = self.api.sanitize_for_serialization(model)  # type: ignore[no-untyped-call]
        return out

    async def _call(
        self, what: str, deadline: float, fn: Callable[..., T], *a: Any, **kw: Any
    ) -> T:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TemporaryError(f"{what}: the plan's deadline passed")
        kw["_request_timeout"] = max(1.0, min(left, 30.0))
        try:
            return await asyncio.to_thread(fn, *a, **kw)
        except ApiException as exc:
            raise _api_error(what, self.namespace, exc) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TemporaryError(f"{what}: the Kubernetes API is unreachable ({exc})") from exc

    async def _read_anchor(self, job: str, deadline: float) -> dict[str, Any] | None:
        """The job's anchor ConfigMap, or None if there is none (nothing was launched)."""
        try:
            found = await self._call(
                f"read the anchor of job {job}",
                deadline,
                self.core.read_namespaced_config_map,
                pods.anchor_name(job),
                self.namespace,
            )
        except ApiRefused as exc:
            if exc.status != 404:
                raise
            return None
        return self._plain(found)

    async def _anchor(self, job: str, deadline: float) -> dict[str, Any]:
        """The job's anchor, created if it does not exist yet (before the first pod)."""
        obj = await self._read_anchor(job, deadline)
        if obj is None:
            try:
                made = await self._call(
                    f"create the anchor of job {job}",
                    deadline,
                    self.core.create_namespaced_config_map,
                    self.namespace,
                    pods.anchor(job, self.namespace),
                )
                obj = self._plain(made)
            except ApiRefused as conflict:
                if conflict.status != 409:
                    raise
                return await self._anchor(job, deadline)  # another scaler made it first
        self._anchor_uid[job] = (obj.get("metadata") or {}).get("uid") or ""
        return obj

    async def _pods(self, job: str, deadline: float) -> list[dict[str, Any]]:
        found = await self._call(
            f"list the pods of job {job}",
            deadline,
            self.core.list_namespaced_pod,
            self.namespace,
            label_selector=pods.selector(job),
        )
        items = self._plain(found).get("items") or []
        want = pods.job_labels(job)
        # filter here too: a label selector the server ignored must not leak other jobs' pods
        return [
            p
            for p in items
            if all(
                ((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in want.items()
            )
        ]

    # ------------------------------------------------------------------ the port

    async def launch(
        self, job: str, spec: ev.NodeLaunch, workload: ev.Workload, deadline: float
    ) -> str:
        name = pods.pod_name(job, spec.node)
        where = f"pod {self.namespace}/{name}"
        anchor = await self._anchor(job, deadline)
        names = pods.launched(anchor)
        if spec.node in names:
            existing = await self._read_pod(name, deadline)
            if existing is None:
                return f"{where} (launched before and gone: not created again)"
            return f"{where} (found, launched before: {pods.phase(existing)})"
        try:
            await self._call(
                f"record node {spec.node} in the anchor of job {job}",
                deadline,
                self.core.patch_namespaced_config_map,
                pods.anchor_name(job),
                self.namespace,
                pods.with_launched(anchor, spec.node),
            )
        except ApiRefused as exc:
            if exc.status != 409:
                raise
            # another scaler wrote the anchor since we read it: read it again, then retry
            raise TemporaryError(f"the anchor of job {job} changed meanwhile") from exc
        body = pods.pod(
            job=job,
            namespace=self.namespace,
            spec=spec,
            workload=workload,
            nats_url=self.nats_url,
            image=self.image,
            owner_uid=self._anchor_uid.get(job, ""),
            template=self.template,
        )
        try:
            await self._call(
                f"create pod {name}",
                deadline,
                self.core.create_namespaced_pod,
                self.namespace,
                body,
            )
        except ApiRefused as exc:
            if exc.status == 409:
                return f"{where} (found: already there)"
            raise
        self._seen.setdefault(job, set()).add(spec.node)
        return where

    async def _read_pod(self, name: str, deadline: float) -> dict[str, Any] | None:
        try:
            found = await self._call(
                f"read pod {name}", deadline, self.core.read_namespaced_pod, name, self.namespace
            )
        except ApiRefused as exc:
            if exc.status == 404:
                return None
            raise
        return self._plain(found)

    async def remove(self, job: str, node: str, deadline: float) -> None:
        name = pods.pod_name(job, node)
        try:
            await self._call(
                f"delete pod {name}",
                deadline,
                self.core.delete_namespaced_pod,
                name,
                self.namespace,
                grace_period_seconds=self.grace_s,
            )
        except ApiRefused as exc:
            if exc.status != 404:
                raise
        self._reported.setdefault(job, set()).add(node)  # stopped on purpose: no news

    async def nodes(self, job: str) -> list[NodeInfo]:
        deadline = time.monotonic() + 30.0
        listed = await self._pods(job, deadline)
        out = []
        for p in listed:
            code, _reason = pods.exit_of(p)
            out.append(
                NodeInfo(
                    node=pods.node_of(p),
                    where=f"pod {self.namespace}/{p['metadata']['name']}",
                    running=pods.phase(p) in ("Pending", "Running")
                    and not (p.get("metadata") or {}).get("deletionTimestamp"),
                    exit_code=code,
                )
            )
        have = {n.node for n in out}
        # names launched whose pods are gone: a read only, a job never launched has no anchor
        anchor = await self._read_anchor(job, deadline) or {}
        for node in pods.launched(anchor):
            if node not in have:
                out.append(NodeInfo(node=node, where="pod deleted", running=False))
        return sorted(out, key=lambda n: n.node)

    async def ended(self, job: str) -> list[Ended]:
        listed = await self._pods(job, time.monotonic() + 30.0)
        seen = self._seen.setdefault(job, set())
        reported = self._reported.setdefault(job, set())
        present = set()
        out = []
        for p in listed:
            node = pods.node_of(p)
            present.add(node)
            seen.add(node)
            state = pods.phase(p)
            if state not in ("Succeeded", "Failed") or node in reported:
                continue
            code, why = pods.exit_of(p)
            # (its last line says why it exited with a code; not a signal's kill, an OOM)
            if code is not None and 0 < code < 128 and (said := pods.last_words(p)):
                why = f"{why}: {said}" if why else said
            reported.add(node)
            out.append(
                Ended(
                    node=node,
                    reason=f"pod {state.lower()}" + (f" ({why})" if why else ""),
                    exit_code=code,
                )
            )
        for node in sorted(seen - present - reported):
            reported.add(node)
            out.append(Ended(node=node, reason="pod deleted (evicted, or removed by someone)"))
        return out

    async def pending(self, job: str) -> list[Pending]:
        listed = await self._pods(job, time.monotonic() + 30.0)
        flagged = self._flagged.setdefault(job, set())
        out = []
        for p in listed:
            stuck = pods.unschedulable(p)
            node = pods.node_of(p)
            if stuck is None or node in flagged:
                continue
            since = _parse_ts(stuck[0]) or _parse_ts(
                (p.get("metadata") or {}).get("creationTimestamp") or ""
            )
            waited = self.clock() - since if since else 0.0
            if waited < self.pending_timeout_s:
                continue
            flagged.add(node)
            out.append(
                Pending(node=node, reason=f"unschedulable for {waited:.0f}s: {stuck[1]}".strip())
            )
        return out

    async def close(self) -> None:
        await asyncio.to_thread(self.api.close)


def _parse_ts(text: str) -> float:
    try:
        return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return 0.0


class ApiRefused(PermanentError):
    """The API server refused a request with `status`; retrying the same one cannot help."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _api_error(what: str, namespace: str, exc: ApiException) -> Exception:
    status = int(exc.status or 0)
    detail = f"{what}: {status} {exc.reason}"
    if status == 403:
        return ApiRefused(
            f"{detail}: the scaler's service account may not do this in namespace "
            f"{namespace}; apply deploy/base/scaler/rbac.yaml (the Role lists what the "
            "scaler needs) or grant the verb to the account the scaler runs as",
            status,
        )
    if status == 429 or status >= 500 or status == 0:
        retry_after = 0.0
        try:
            retry_after = float((exc.headers or {}).get("Retry-After") or 0)
        except (TypeError, ValueError):
            pass
        return TemporaryError(f"{detail}: retrying", retry_after=retry_after)
    if status == 404 and "namespaces" in str(exc.body or ""):
        return ApiRefused(f"{detail}: does namespace {namespace} exist?", status)
    return ApiRefused(f"{detail}: {str(exc.body or '')[:300]}", status)
