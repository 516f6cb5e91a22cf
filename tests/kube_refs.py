"""What rendered Kubernetes objects refer to that is not among them (pure): the
references a platform engineer's `kubectl apply -k` of an overlay plus an example
must find, or the pods never start (a volume's ConfigMap or Secret, an env's Secret
key, a service account, a priority class, a binding's subjects and role, the
namespace itself), and the namespaced objects with no namespace (they land in the
kubectl context's namespace, where nothing of rove looks for them)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

#: Kinds with no namespace.
CLUSTER_KINDS = frozenset(
    {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "CustomResourceDefinition"}
)
#: Namespaces every cluster has.
BUILTIN_NAMESPACES = frozenset({"default", "kube-system", "kube-public"})
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


@dataclass(frozen=True)
class Missing:
    """`where` refers to `kind` `namespace/name` (its `key`, for a Secret's key)."""

    where: str
    kind: str
    namespace: str | None
    name: str
    key: str | None = None

    def __str__(self) -> str:
        key = f" (key {self.key})" if self.key else ""
        return f"{self.where}: {self.kind} {self.namespace}/{self.name}{key} does not exist"


def _refs(d: dict[str, Any]) -> Iterator[tuple[str, str | None, str, str | None]]:
    """(kind, namespace, name, key) of each object `d` refers to."""
    ns = d["metadata"].get("namespace")
    if d["kind"] in WORKLOADS:
        spec = d["spec"]["template"]["spec"]
        for v in spec.get("volumes", []):
            for field, kind, name in (
                ("configMap", "ConfigMap", "name"),
                ("secret", "Secret", "secretName"),
                ("persistentVolumeClaim", "PersistentVolumeClaim", "claimName"),
            ):
                source = v.get(field)
                if source and not source.get("optional"):
                    yield kind, ns, source[name], None
            for src in (v.get("projected") or {}).get("sources", []):
                for field, kind in (("secret", "Secret"), ("configMap", "ConfigMap")):
                    if field in src and not src[field].get("optional"):
                        yield kind, ns, src[field]["name"], None
        for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
            for e in c.get("env", []):
                vf = e.get("valueFrom") or {}
                for field, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap")):
                    if field in vf and not vf[field].get("optional"):
                        yield kind, ns, vf[field]["name"], vf[field]["key"]
            for e in c.get("envFrom", []):
                for field, kind in (("secretRef", "Secret"), ("configMapRef", "ConfigMap")):
                    if field in e and not e[field].get("optional"):
                        yield kind, ns, e[field]["name"], None
        account = spec.get("serviceAccountName")
        if account and account != "default":
            yield "ServiceAccount", ns, account, None
        priority = spec.get("priorityClassName")
        if priority and not priority.startswith("system-"):
            yield "PriorityClass", None, priority, None
    if d["kind"] in ("RoleBinding", "ClusterRoleBinding"):
        for s in d.get("subjects", []):
            if s["kind"] == "ServiceAccount":
                yield "ServiceAccount", s.get("namespace", ns), s["name"], None
        role = d["roleRef"]
        yield role["kind"], ns if role["kind"] == "Role" else None, role["name"], None


def _mounts(d: dict[str, Any]) -> Iterator[str]:
    """Problems of a workload's own: a mount of a volume its pod does not have."""
    if d["kind"] not in WORKLOADS:
        return
    spec = d["spec"]["template"]["spec"]
    have = {v["name"] for v in spec.get("volumes", [])}
    have |= {t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])}
    for c in [*spec.get("initContainers", []), *spec.get("containers", [])]:
        for m in c.get("volumeMounts", []):
            if m["name"] not in have:
                where = f"{d['kind']}/{d['metadata']['name']}/{c['name']}"
                yield f"{where}: mounts {m['name']}, which its pod does not have"


def check(docs: list[dict[str, Any]]) -> tuple[list[str], list[Missing]]:
    """What is wrong in `docs` (objects of one `kubectl apply`): problems, and the
    objects they refer to that are not among them."""
    have: set[tuple[str, str | None, str]] = set()
    problems: list[str] = []
    for d in docs:
        ns = None if d["kind"] in CLUSTER_KINDS else d["metadata"].get("namespace")
        have.add((d["kind"], ns, d["metadata"]["name"]))
        if d["kind"] not in CLUSTER_KINDS and ns is None:
            problems.append(
                f"{d['kind']}/{d['metadata']['name']}: no namespace (it would land in the "
                "kubectl context's namespace)"
            )
    keys = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): {
            *(d.get("data") or {}),
            *(d.get("stringData") or {}),
            *(d.get("binaryData") or {}),
        }
        for d in docs
        if d["kind"] in ("Secret", "ConfigMap")
    }
    namespaces = {name for kind, _, name in have if kind == "Namespace"} | BUILTIN_NAMESPACES
    missing: list[Missing] = []
    for d in docs:
        where = f"{d['kind']}/{d['metadata']['name']}"
        ns = d["metadata"].get("namespace")
        if d["kind"] not in CLUSTER_KINDS and ns is not None and ns not in namespaces:
            problems.append(f"{where}: namespace {ns} does not exist")
        problems.extend(_mounts(d))
        for kind, rns, name, key in _refs(d):
            if (kind, rns, name) not in have:
                missing.append(Missing(where, kind, rns, name, key))
            elif key is not None and key not in keys.get((kind, rns, name), {key}):
                problems.append(f"{where}: {kind} {rns}/{name} has no key {key}")
    return problems, missing
