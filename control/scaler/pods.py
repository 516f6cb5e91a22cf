"""What the `kubernetes` backend asks the API server for, as plain dicts (pure).

One pod per node, named after (job, node) so a relaunch (a new attempt, a new
node name `n<slot>-a<attempt>`) is a new pod and the same attempt is the same
pod: a create sent twice meets `409 AlreadyExists` instead of a second pod.

    pod_name("demo", "n3-a1")  ->  "rove-demo-n3-a1"

Pods have `restartPolicy: Never` (rove restarts workers inside the pod, and a
dead pod is relaunched as a new attempt by a plan), requests equal to limits
(Guaranteed QoS: the memory an OOM relaunch asks for is the memory it gets),
and an owner reference to the job's *anchor*, a ConfigMap that also records
every node name ever launched (the duplicate-relaunch guard: a pod that ran
and was deleted is not created again). Deleting the anchor deletes the job's
pods through Kubernetes' garbage collector.

A user's pod template (`--pod-template`, YAML) is the starting point: its
nodeSelector, tolerations, volumes (a hostPath `/dev/shm` for flash
checkpoints that outlive the pod), service account and image are kept; rove
sets the container's command, resources, labels and restart policy.
"""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

from rove.control.catalogue import events as ev
from rove.control.scaler.backend import last_line

#: Labels on every object the backend creates.
APP = "app.kubernetes.io/name"
MANAGED = "app.kubernetes.io/managed-by"
JOB = "rove.dev/job"
NODE = "rove.dev/node"
SLOT = "rove.dev/slot"
ATTEMPT = "rove.dev/attempt"
#: The anchor's data key listing every node name launched (one per line).
LAUNCHED_KEY = "launched"
#: The GPU resource name (the NVIDIA device plugin's).
GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "node"

_DNS = re.compile(r"[^a-z0-9-]+")


def dns_name(*parts: str, limit: int = 63) -> str:
    """A DNS-1123 label made of `parts`: lower case, `-` for anything else, at most
    `limit` characters (a long name keeps a hash of the whole so two never collide)."""
    raw = "-".join(parts)
    name = _DNS.sub("-", raw.lower()).strip("-") or "x"
    if len(name) <= limit and name == raw:
        return name
    digest = hashlib.sha256(raw.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def anchor_name(job: str) -> str:
    return dns_name("rove", job)


def pod_name(job: str, node: str) -> str:
    return dns_name("rove", job, node)


def job_labels(job: str) -> dict[str, str]:
    return {APP: "rove", MANAGED: "rove-scaler", JOB: dns_name(job)}


def selector(job: str) -> str:
    return ",".join(f"{k}={v}" for k, v in job_labels(job).items())


def quantities(r: ev.Resources) -> dict[str, str]:
    """Kubernetes quantities for `r` (unset fields are left out)."""
    out: dict[str, str] = {}
    if r.cpu:
        out["cpu"] = f"{round(r.cpu * 1000)}m"
    if r.memory_bytes:
        out["memory"] = str(r.memory_bytes)
    if r.gpus:
        out[GPU_RESOURCE] = str(r.gpus)
    return out


def anchor(job: str, namespace: str) -> dict[str, Any]:
    """The job's anchor ConfigMap: owner of its pods, and the list of nodes launched."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": anchor_name(job), "namespace": namespace, "labels": job_labels(job)},
        "data": {"job": job, LAUNCHED_KEY: ""},
    }


def launched(anchor_obj: dict[str, Any]) -> list[str]:
    text = (anchor_obj.get("data") or {}).get(LAUNCHED_KEY) or ""
    return [line for line in text.splitlines() if line]


def with_launched(anchor_obj: dict[str, Any], node: str) -> dict[str, Any]:
    """The patch that adds `node` to the anchor, valid only against the version read
    (`resourceVersion`: if another scaler wrote in between, the server answers 409)."""
    names = [*launched(anchor_obj), node]
    meta = anchor_obj.get("metadata") or {}
    patch: dict[str, Any] = {"data": {LAUNCHED_KEY: "\n".join(names) + "\n"}}
    if meta.get("resourceVersion"):
        patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
    return patch


def pod(
    *,
    job: str,
    namespace: str,
    spec: ev.NodeLaunch,
    workload: ev.Workload,
    nats_url: str,
    image: str,
    owner_uid: str,
    template: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The pod that runs node `spec.node` of `job`: `rove run --job J --node-id N <argv>`."""
    body: dict[str, Any] = copy.deepcopy(template) if template else {}
    meta = body.setdefault("metadata", {})
    meta["name"] = pod_name(job, spec.node)
    meta["namespace"] = namespace
    meta["labels"] = {
        **(meta.get("labels") or {}),
        **job_labels(job),
        NODE: dns_name(spec.node),
        SLOT: str(spec.slot),
        ATTEMPT: str(spec.attempt),
    }
    meta["annotations"] = {**(meta.get("annotations") or {}), "rove.dev/node-id": spec.node}
    meta["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": anchor_name(job),
            "uid": owner_uid,
            "blockOwnerDeletion": False,
        }
    ]
    pod_spec = body.setdefault("spec", {})
    pod_spec["restartPolicy"] = "Never"
    containers = pod_spec.setdefault("containers", [])
    ours = next((c for c in containers if c.get("name") == CONTAINER), None)
    if ours is None:
        ours = {"name": CONTAINER}
        containers.insert(0, ours)
    ours.setdefault("image", image)
    # (a node that fails says its last line in its pod's status: `rove run`'s refusal)
    ours.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
    ours["command"] = ["rove"]
    ours["args"] = [
        "run",
        *("--job", job, "--node-id", spec.node, "--nats", nats_url),
        *ev.node_argv(workload, spec),
    ]
    if workload.cwd and "workingDir" not in ours:
        ours["workingDir"] = workload.cwd
    env = [e for e in ours.get("env") or [] if e.get("name") != "ROVE_NODE_RESOURCES"]
    env.append({"name": "ROVE_NODE_RESOURCES", "value": spec.resources.describe()})
    ours["env"] = env
    wanted = quantities(spec.resources)
    if wanted:
        # requests = limits: Guaranteed QoS, and the scheduler places the node on a machine
        # that has what the plan asked for.
        ours["resources"] = {"requests": dict(wanted), "limits": dict(wanted)}
    return body


def node_of(pod_obj: dict[str, Any]) -> str:
    meta = pod_obj.get("metadata") or {}
    return str((meta.get("annotations") or {}).get("rove.dev/node-id") or meta.get("name", ""))


def phase(pod_obj: dict[str, Any]) -> str:
    return str((pod_obj.get("status") or {}).get("phase") or "Pending")


def exit_of(pod_obj: dict[str, Any]) -> tuple[int | None, str]:
    """The node container's exit code and the reason Kubernetes gives (OOMKilled, Error)."""
    for status in (pod_obj.get("status") or {}).get("containerStatuses") or []:
        if status.get("name") != CONTAINER:
            continue
        done = (status.get("state") or {}).get("terminated")
        if done:
            code = done.get("exitCode")
            return (int(code) if code is not None else None, str(done.get("reason") or ""))
    return None, str((pod_obj.get("status") or {}).get("reason") or "")


def last_words(pod_obj: dict[str, Any]) -> str:
    """The last line the node container wrote before it failed (its termination message:
    the pod's `terminationMessagePolicy: FallbackToLogsOnError` makes it its log's tail),
    "" when it said nothing."""
    for status in (pod_obj.get("status") or {}).get("containerStatuses") or []:
        done = (status.get("state") or {}).get("terminated") or {}
        if status.get("name") == CONTAINER:
            return last_line(str(done.get("message") or ""))
    return ""


def unschedulable(pod_obj: dict[str, Any]) -> tuple[str, str] | None:
    """(since, message) when the scheduler could not place a pending pod, else None."""
    if phase(pod_obj) != "Pending":
        return None
    for cond in (pod_obj.get("status") or {}).get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == "Unschedulable"
        ):
            return str(cond.get("lastTransitionTime") or ""), str(cond.get("message") or "")
    return None
