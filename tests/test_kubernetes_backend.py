"""The `kubernetes` backend beyond the shared contract (tests/test_backends.py).

The pod it asks for (pure, `rove.control.scaler.pods`), and, through the
official client against `kmock`'s API emulator over HTTP: what an unplaceable
pod reports, and how refusals and server errors map to rove's errors.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import kmock
import msgspec
import pytest

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError, PermanentError, TemporaryError
from rove.control.scaler import pods
from rove.control.scaler.kubernetes import load_template
from tests.kubelet import backend_for
from tests.support import eventually
from tests.test_backends import kubernetes_backend, workload

GIB = ev.GIB


def launch(
    node: str = "n2-a1", memory: int = 3 * GIB, cpu: float = 1.5, gpus: int = 0
) -> ev.NodeLaunch:
    return ev.NodeLaunch(
        node=node,
        slot=2,
        attempt=1,
        resources=ev.Resources(cpu=cpu, memory_bytes=memory, gpus=gpus),
        replaces="n2-a0",
    )


def build(template: dict[str, object] | None = None, **kw: object) -> dict[str, object]:
    w = ev.Workload(
        argv=("--nproc-per-node", "2", "train.py"), cwd="/app", min_nodes=1, max_nodes=4
    )
    return pods.pod(
        job="demo",
        namespace="rove-jobs",
        spec=launch(**kw),  # type: ignore[arg-type]
        workload=w,
        nats_url="nats://rove-nats.rove-system:4222",
        image="ghcr.io/rove/rove:1",
        owner_uid="uid-1",
        template=template,
    )


def test_a_node_pod_is_named_per_attempt_guaranteed_never_restarted_and_owned_by_the_job() -> None:
    pod = build(gpus=1)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "rove-demo-n2-a1"  # type: ignore[index]
    assert build()["metadata"]["name"] == meta["name"]  # type: ignore[index]  # deterministic
    assert meta["labels"]["rove.dev/attempt"] == "1"  # type: ignore[index]
    assert meta["ownerReferences"] == [  # type: ignore[index]
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": "rove-demo",
            "uid": "uid-1",
            "blockOwnerDeletion": False,
        }
    ]
    assert spec["restartPolicy"] == "Never"  # type: ignore[index]
    [c] = spec["containers"]  # type: ignore[index]
    assert c["resources"]["requests"] == c["resources"]["limits"]
    assert c["resources"]["limits"] == {
        "cpu": "1500m",
        "memory": str(3 * GIB),
        "nvidia.com/gpu": "1",
    }
    assert c["command"] == ["rove"]
    assert c["args"][:7] == [
        "run",
        "--job",
        "demo",
        "--node-id",
        "n2-a1",
        "--nats",
        "nats://rove-nats.rove-system:4222",
    ]
    assert c["args"][7:] == ["--nproc-per-node", "2", "train.py"]
    assert c["workingDir"] == "/app"
    # a node that fails says its last line in the pod's status (the scaler reads it)
    assert c["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_the_pod_template_keeps_placement_and_volumes_and_rove_sets_the_rest() -> None:
    template = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"labels": {"team": "vision"}},
        "spec": {
            "restartPolicy": "Always",
            "nodeSelector": {"rove.dev/training": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "volumes": [{"name": "shm", "hostPath": {"path": "/dev/shm"}}],
            "containers": [
                {
                    "name": "node",
                    "image": "my/image:2",
                    "command": ["sh"],
                    "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
                },
                {"name": "sidecar", "image": "busybox"},
            ],
        },
    }
    pod = build(template)
    spec = pod["spec"]
    assert spec["restartPolicy"] == "Never"  # type: ignore[index]
    assert spec["nodeSelector"] == {"rove.dev/training": "true"}  # type: ignore[index]
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"  # type: ignore[index]
    node, sidecar = spec["containers"]  # type: ignore[index]
    assert node["image"] == "my/image:2" and node["command"] == ["rove"]
    assert node["volumeMounts"] == [{"name": "shm", "mountPath": "/dev/shm"}]
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    assert pod["metadata"]["labels"]["team"] == "vision"  # type: ignore[index]
    assert template["spec"]["restartPolicy"] == "Always"  # type: ignore[index]  # not mutated


def test_names_are_dns_labels_and_long_or_odd_job_names_never_collide() -> None:
    long_a = pods.pod_name("a" * 80 + "_x", "n0-a0")
    long_b = pods.pod_name("a" * 80 + "_y", "n0-a0")
    for name in (long_a, long_b, pods.pod_name("My_Job", "n1-a0")):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
    assert long_a != long_b
    assert pods.pod_name("My_Job", "n1-a0") != pods.pod_name("my-job", "n1-a0")


def test_a_bad_pod_template_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("kind: Deployment\n")
    with pytest.raises(ConfigError, match="must hold one Pod"):
        load_template(bad)
    with pytest.raises(ConfigError, match="cannot read the pod template"):
        load_template(tmp_path / "missing.yaml")


@pytest.mark.slow
async def test_a_pod_the_scheduler_cannot_place_is_reported_once_with_its_message(
    bus: Bus, tmp_path: Path
) -> None:
    async with kubernetes_backend(bus, tmp_path, memory=GIB, pending_timeout_s=0.5) as backend:
        deadline = time.monotonic() + 30
        await backend.launch("contract", launch(memory=2 * GIB), workload(tmp_path), deadline)
        found = await eventually(lambda: backend.pending("contract"), timeout=30, every=0.2)
        assert [p.node for p in found] == ["n2-a1"]
        assert "Insufficient memory" in found[0].reason and "unschedulable for" in found[0].reason
        assert await backend.pending("contract") == []  # once
        assert [n.running for n in await backend.nodes("contract")] == [True]  # still pending
        await backend.remove("contract", "n2-a1", deadline)
        await backend.close()


@pytest.mark.parametrize(
    ("status", "error", "says"),
    [
        (403, PermanentError, r"403.*may not do this in namespace rove-jobs.*rbac.yaml"),
        (422, PermanentError, r"422"),
        (503, TemporaryError, r"503.*retrying"),
        (429, TemporaryError, r"429.*retrying"),
    ],
)
async def test_refusals_and_server_errors_become_rove_errors_that_say_what_to_do(
    status: int, error: type[Exception], says: str
) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        backend = backend_for(server)
        w = ev.Workload(argv=("train.py",), cwd="", min_nodes=1, max_nodes=1)
        emulator["post", re.compile(r".*/pods$")] << status
        with pytest.raises(error, match=says) as raised:
            await backend.launch("j", launch("n0-a0"), w, time.monotonic() + 10)
        assert isinstance(raised.value, PermanentError) != (status in (429, 503))
        with pytest.raises(TemporaryError, match="deadline passed"):
            await backend.launch("j", launch("n1-a0"), w, time.monotonic() - 1)
        await backend.close()


def test_a_parameter_servers_node_pod_runs_its_roles_command_with_its_own_size() -> None:
    ps = ev.PsNodes(
        count=1,
        resources=ev.Resources(cpu=4, memory_bytes=16 * GIB),
        argv=("--tf-ps", "--tf-role", "ps", "--nproc-per-node", "1", "coordinator.py"),
    )
    w = ev.Workload(
        argv=("--tf-ps", "--nproc-per-node", "2", "coordinator.py"),
        cwd="/app",
        min_nodes=2,
        max_nodes=3,
        ps=ps,
    )
    spec = ev.NodeLaunch(node="n0-a0", slot=0, attempt=0, resources=ps.resources, role="ps")
    common = dict(
        job="demo",
        namespace="rove-jobs",
        workload=w,
        nats_url="nats://n:4222",
        image="rove:1",
        owner_uid="uid-1",
        template=None,
    )
    pod = pods.pod(spec=spec, **common)  # type: ignore[arg-type]
    [c] = pod["spec"]["containers"]  # type: ignore[index]
    assert c["args"][-6:] == [
        "--tf-ps",
        "--tf-role",
        "ps",
        "--nproc-per-node",
        "1",
        "coordinator.py",
    ]
    assert c["resources"]["limits"]["memory"] == str(16 * GIB)
    worker = msgspec.structs.replace(spec, node="n1-a0", slot=1, role="")
    [w_c] = pods.pod(spec=worker, **common)["spec"]["containers"]  # type: ignore[arg-type,index]
    assert w_c["args"][-4:] == ["--tf-ps", "--nproc-per-node", "2", "coordinator.py"]


def test_a_failed_node_pods_last_words_are_its_termination_messages_last_line() -> None:
    def pod_with(message: str, name: str = "node") -> dict[str, object]:
        done = {"exitCode": 2, "reason": "Error", "message": message}
        return {"status": {"containerStatuses": [{"name": name, "state": {"terminated": done}}]}}

    said = "rove run: training script /app/train.py not found"
    assert pods.last_words(pod_with(f"starting\n{said}\n\n")) == said
    assert pods.last_words(pod_with("x" * 5000)) == "x" * 400  # (a reason, not a log)
    assert pods.last_words(pod_with(said, name="sidecar")) == ""
    assert pods.last_words(pod_with("")) == ""
