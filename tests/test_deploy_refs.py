"""An overlay applied with an example finds everything its objects refer to
(`tests.kube_refs`): the ConfigMaps and Secrets of volumes and env, service accounts,
priority classes, bindings' subjects and roles, namespaces; and no namespaced object
lacks a namespace. The dev overlay brings everything; the prod overlay leaves out
only the Secrets docs/kubernetes.md has the operator create first, with the keys it
creates."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import kube_refs
from tests.support import ROOT
from tests.test_deploy import pod_specs, render

DOCS = ROOT / "docs" / "kubernetes.md"


def documented_secrets() -> dict[tuple[str, str], set[str]]:
    """(namespace, name) -> keys of each `kubectl -n NS create secret generic NAME`
    command in docs/kubernetes.md."""
    text = DOCS.read_text().replace("\\\n", " ")
    found = {}
    for m in re.finditer(r"kubectl -n (\S+) create secret generic (\S+)([^\n]*)", text):
        keys = re.findall(r"--from-(?:literal|file)=([^=\s]+)", m[3])
        found[(m[1], m[2])] = {Path(k).name for k in keys}
    return found


def undocumented(missing: list[kube_refs.Missing]) -> list[str]:
    """What is referred to and missing, but for the Secrets (and keys) the docs create."""
    documented = documented_secrets()
    assert documented, "docs/kubernetes.md says which Secrets to create"
    return [
        str(m)
        for m in missing
        if m.kind != "Secret"
        or (m.namespace or "", m.name) not in documented
        or (m.key is not None and m.key not in documented[(m.namespace or "", m.name)])
    ]


#: Each overlay with the examples made for it.
PAIRS = [("dev", "pool"), ("dev", "pods"), ("prod", "pool-prod"), ("prod", "pods-prod")]


@pytest.mark.parametrize(("overlay", "example"), PAIRS)
def test_an_overlay_with_an_example_finds_everything_it_refers_to(
    overlay: str, example: str
) -> None:
    problems, missing = kube_refs.check(
        render(f"overlays/{overlay}") + render(f"examples/{example}")
    )
    assert problems == []
    if overlay == "dev":
        assert [str(m) for m in missing] == [], "the dev overlay brings everything"
    assert undocumented(missing) == [], "referred to, and neither applied nor created by the docs"


def test_the_check_finds_a_generated_config_map_outside_its_readers_namespace() -> None:
    """What the pods example did: its ConfigMap had no namespace, and the scaler in
    rove-system mounted it under its name without the generator's hash."""
    docs = [
        {"kind": "Namespace", "metadata": {"name": "rove-system"}},
        {"kind": "ConfigMap", "metadata": {"name": "tpl-h4sh"}, "data": {"a": "b"}},
        {
            "kind": "Deployment",
            "metadata": {"name": "scaler", "namespace": "rove-system"},
            "spec": {
                "template": {
                    "spec": {
                        "volumes": [{"name": "t", "configMap": {"name": "tpl"}}],
                        "containers": [
                            {
                                "name": "c",
                                "volumeMounts": [{"name": "t"}, {"name": "gone"}],
                                "env": [
                                    {
                                        "name": "P",
                                        "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}},
                                    }
                                ],
                            }
                        ],
                        "serviceAccountName": "nobody",
                    }
                }
            },
        },
    ]
    problems, missing = kube_refs.check(docs)
    assert problems == [
        "ConfigMap/tpl-h4sh: no namespace (it would land in the kubectl context's namespace)",
        "Deployment/scaler/c: mounts gone, which its pod does not have",
    ]
    assert [str(m) for m in missing] == [
        "Deployment/scaler: ConfigMap rove-system/tpl does not exist",
        "Deployment/scaler: Secret rove-system/s (key k) does not exist",
        "Deployment/scaler: ServiceAccount rove-system/nobody does not exist",
    ]


def test_the_image_carries_what_the_manifests_and_their_jobs_run() -> None:
    """The default image has every extra a torch job's pods use (the Kafka bridge and
    StreamIterable included); a TensorFlow image is one build argument away, and each
    extra named is one rove's pyproject defines."""
    import tomllib

    text = (ROOT / "deploy" / "Dockerfile").read_text()
    default = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M)
    assert default is not None, "the image's extras are a build argument"
    extras = set(default[1].split(","))
    assert extras == {"torch", "kubernetes", "gpu", "kafka"}
    tf = re.search(r"--build-arg EXTRAS=(\S+)", text)
    assert tf is not None and "tensorflow" in tf[1].split(",") and "torch" not in tf[1]
    defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert extras | set(tf[1].split(",")) <= set(defined["optional-dependencies"])
    assert 'pip install ".[${EXTRAS}]"' in text
    assert tf[0] in DOCS.read_text(), "docs/kubernetes.md gives the TensorFlow image's build"


@pytest.mark.parametrize("example", ["pool-prod", "pods-prod"])
def test_under_prod_every_nats_client_uses_tls_and_trusts_a_mounted_ca(example: str) -> None:
    """The prod servers refuse plain connections: every rove container of the overlay and
    of its examples (the node pods' template too) names a tls:// address if it names
    one, and a CA file inside a volume it mounts."""
    docs = render("overlays/prod") + render(f"examples/{example}")
    checked = []
    for d, spec in pod_specs(docs):
        for c in spec.get("containers", []):
            template = d["kind"] == "ConfigMap"
            if c.get("command") != ["rove"] and not template:
                continue  # the NATS servers themselves
            where = f"{d['kind']}/{d['metadata']['name']}/{c['name']}"
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            url = env.get("ROVE_NATS_URL")
            assert url is None or url.startswith("tls://"), (where, url)
            ca = env.get("ROVE_NATS_TLS_CA")
            assert ca, f"{where}: no ROVE_NATS_TLS_CA"
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert any(ca.startswith(m.rstrip("/") + "/") for m in mounts), (where, ca, mounts)
            checked.append(where)
    names = {w.split("/")[1] for w in checked}
    wanted = {"rove-agent", "rove-master-example", "rove-scaler-example", "rove-submit-example"}
    assert wanted <= names, checked
    if example == "pods-prod":
        assert any(w.startswith("ConfigMap/rove-pod-template") for w in checked), checked
