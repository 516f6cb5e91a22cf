"""`rove operator` and the RoveJob: the objects it makes, the status it writes.

The operator runs against `kmock`'s API emulator with the official client and a
real nats-server: a RoveJob created there gets its masters, scaler and submit Job
(with TLS), its status follows a scripted job on the bus (round formed, a node
lost, finished), an ended job's Deployments go to 0, a delete stops the job on the
bus and lets Kubernetes clean up, and an operator restarted, or refused by the API
server mid-reconcile, creates nothing twice. The CRD's schema is checked offline
(`jsonschema`, the example and bad specs); its immutability rule (CEL) needs a live
API server and is not exercised here (docs/kubernetes.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import kmock
import msgspec
import pytest
import yaml

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.cli.main import build_parser
from rove.control.domain import goodput as gp
from rove.control.errors import ConfigError
from rove.control.master import snapshots
from rove.control.operator import controller
from rove.control.operator import spec as rj
from rove.control.operator import status as st
from rove.control.scaler.kubernetes import api_client
from tests import factories as f
from tests.support import (
    ROOT,
    CliProc,
    eventually,
    fold_records,
    replicas_hold,
    stored_events,
)
from tests.test_deploy import VERBS

DEPLOY = ROOT / "deploy"
NS = "rove-system"
JOB = "rj1"
RESOURCE = "rove.dev/v1alpha1/rovejobs"
SITE = rj.Site(
    nats_url="tls://rove-nats.rove-system.svc:4222",
    ca_secret="rove-nats-tls",
    nodes_ca_secret="rove-nats-ca",
)


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load((DEPLOY / "base/operator/crd.yaml").read_text())
    [version] = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def example() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "examples/rovejob/job.yaml").read_text()))


def rovejob(name: str = JOB, **spec: Any) -> dict[str, Any]:
    obj = example()
    obj["metadata"] = {"name": name, "namespace": NS, "uid": f"uid-{name}", "generation": 1}
    obj["spec"].update(spec)
    return obj


# --------------------------------------------------------------------------- schema


def test_the_example_passes_the_crds_schema_and_bad_specs_are_refused() -> None:
    schema = crd_schema()
    jsonschema.validate(example(), schema)
    bad: dict[str, dict[str, Any]] = {
        "no image": {"image": None},
        "nnodes not MIN:MAX": {"nnodes": "2-4"},
        "no process per node": {"nprocPerNode": 0},
        "an unknown field": {"replicas": 3},
        "an unknown mode": {"mode": "slurm"},
        "memory not a quantity": {"resources": {"memory": "lots"}},
        "kafka without a topic": {"kafka": {"bootstrap": "k:9092"}},
        "a checkpoint url that is a path": {"checkpoint": {"url": "/ckpt"}},
    }
    for why, change in bad.items():
        obj = copy.deepcopy(example())
        for key, value in change.items():
            if value is None:
                del obj["spec"][key]
            else:
                obj["spec"][key] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(obj, schema)
            pytest.fail(f"the schema let through {why}")


def test_the_operator_refuses_what_the_schema_cannot_check() -> None:
    with pytest.raises(ConfigError, match="nnodes '4:2'"):
        rj.parse(rovejob(nnodes="4:2"))
    with pytest.raises(ConfigError, match="invalid job name"):
        rj.parse(rovejob(name="a.b"))
    with pytest.raises(ConfigError, match="use mode: pods"):
        rj.parse(rovejob(mode="pool", scheduling={"queue": "q"}))
    with pytest.raises(ConfigError, match="needs a dir"):
        rj.parse(rovejob(checkpoint={"persistentVolumeClaim": "ckpt"}))
    with pytest.raises(ConfigError, match="not both"):
        rj.parse(rovejob(checkpoint={"dir": "/ckpt", "url": "s3://b/j"}))
    with pytest.raises(ConfigError, match="is not an object store's URL"):
        rj.parse(rovejob(checkpoint={"url": "bucket/j"}))
    with pytest.raises(ConfigError, match="credentialsSecret needs a url"):
        rj.parse(rovejob(checkpoint={"credentialsSecret": "s3"}))
    with pytest.raises(ConfigError, match="use mode: pods"):
        rj.parse(rovejob(mode="pool", checkpoint={"url": "s3://b/j", "credentialsSecret": "s3"}))


def test_an_object_store_for_checkpoints_reaches_every_node_with_its_credentials() -> None:
    obj = rovejob(checkpoint={"url": "s3://bucket/jobs/j", "credentialsSecret": "s3-creds"})
    by_name = {c["metadata"]["name"]: c for c in rj.children(obj, rj.parse(obj), SITE)}
    submit = by_name[f"rove-submit-{JOB}"]["spec"]["template"]["spec"]["containers"][0]["args"]
    after = submit[submit.index("--") + 1 :]
    assert after[6:8] == ["--checkpoint-dir", "s3://bucket/jobs/j"]
    import yaml

    template = yaml.safe_load(by_name[f"rove-pod-template-{JOB}"]["data"]["pod-template.yaml"])
    [node] = template["spec"]["containers"]
    assert node["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]
    # peer replicas go to a node on another machine first: the machine is the domain
    domain = {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert {"name": "ROVE_FAILURE_DOMAIN", "valueFrom": domain} in node["env"]
    spill = {"name": "ROVE_SHM_SPILL_DIR", "value": "/var/lib/rove/spill/$(ROVE_FAILURE_DOMAIN)"}
    assert spill in node["env"], "slots spilled to disk: the machine's own folder"
    assert "checkpoints" not in {v["name"] for v in template["spec"]["volumes"]}


# --------------------------------------------------------------------------- children


def test_every_child_is_owned_runs_a_command_rove_parses_and_uses_tls() -> None:
    obj = rovejob(
        kafka={"bootstrap": "kafka:9093", "topic": "clicks", "configSecret": "kafka-client"},
        checkpoint={"dir": "/ckpt", "persistentVolumeClaim": "rove-ckpt"},
        scheduling={"priorityClassName": "training", "queue": "team-a", "podGroup": "pg"},
    )
    children = rj.children(obj, rj.parse(obj), SITE)
    by_name = {c["metadata"]["name"]: c for c in children}
    assert set(by_name) == {
        f"rove-{k}-{JOB}" for k in ("pod-template", "submit", "master", "scaler", "kafka-bridge")
    }
    parser = build_parser()
    for child in children:
        meta = child["metadata"]
        assert meta["namespace"] == NS and meta["labels"][rj.JOB_LABEL] == JOB
        [ref] = meta["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("RoveJob", f"uid-{JOB}", True)
        if child["kind"] == "ConfigMap":
            continue
        pod = child["spec"]["template"]["spec"]
        [c] = pod["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["ROVE_NATS_URL"].startswith("tls://"), meta["name"]
        assert env["ROVE_NATS_TLS_CA"] == "/etc/rove-tls/ca.crt"
        assert {"name": "nats-ca", "mountPath": "/etc/rove-tls", "readOnly": True} in c[
            "volumeMounts"
        ]
        assert any(v.get("secret", {}).get("secretName") == "rove-nats-tls" for v in pod["volumes"])
        assert pod["securityContext"]["runAsNonRoot"] is True
        parser.parse_args(c["args"])  # (SystemExit if rove would refuse it)
    submit = by_name[f"rove-submit-{JOB}"]["spec"]["template"]["spec"]["containers"][0]["args"]
    after = submit[submit.index("--") + 1 :]
    assert after[:6] == ["--nnodes", "1:4", "--nproc-per-node", "2", "--max-restarts", "10"]
    assert after[6:8] == ["--checkpoint-dir", "/ckpt"]
    bridge = by_name[f"rove-kafka-bridge-{JOB}"]["spec"]["template"]["spec"]
    assert {"name": "ROVE_KAFKA_CONFIG", "value": "/etc/rove-kafka/client.properties"} in bridge[
        "containers"
    ][0]["env"]
    # the nodes' pod template: what the kubernetes backend accepts, wired for the job
    from rove.control.scaler.kubernetes import load_template

    template_map = by_name[f"rove-pod-template-{JOB}"]["data"]["pod-template.yaml"]
    path = Path("/tmp") / f"rove-test-template-{JOB}.yaml"
    path.write_text(template_map)
    template = load_template(path)
    assert template is not None
    node = template["spec"]
    assert node["priorityClassName"] == "training"
    assert template["metadata"]["labels"][rj.KUEUE_QUEUE] == "team-a"
    assert template["metadata"]["labels"][rj.POD_GROUP] == "pg"
    volumes = {v["name"]: v for v in node["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "rove-ckpt"
    assert volumes["nats-ca"]["secret"]["secretName"] == "rove-nats-ca"
    assert volumes["kafka-config"]["secret"]["secretName"] == "kafka-client"
    mounts = {m["name"]: m["mountPath"] for m in node["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"] == "/ckpt" and mounts["kafka-config"] == "/etc/rove-kafka"


def test_a_pool_job_has_no_pod_template_and_its_scaler_no_api_token() -> None:
    obj = rovejob(mode="pool", pool="gpus")
    children = rj.children(obj, rj.parse(obj), rj.Site(nats_url="nats://n:4222"))
    kinds = sorted(c["kind"] for c in children)
    assert kinds == ["Deployment", "Deployment", "Job"]
    [scaler] = [c for c in children if c["metadata"]["name"].startswith("rove-scaler")]
    pod = scaler["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["containers"][0]["args"][-4:] == ["--backend", "pool", "--pool", "gpus"]
    assert "ROVE_NATS_TLS_CA" not in {e["name"] for e in pod["containers"][0]["env"]}


# --------------------------------------------------------------------------- status


def test_the_status_follows_the_job_and_names_its_last_failure() -> None:
    from rove.control.master.evolve import evolve
    from rove.control.master.state import initial

    state = initial(JOB)
    events: list[ev.Event] = [
        f.elected("m1", 1, job=JOB),
        f.joined("n1", job=JOB),
        f.joined("n2", n=1, job=JOB),
        f.round_completed(1, 1, "n1", "n2", job=JOB),
    ]
    for seq, e in enumerate(events, 1):
        state = evolve(state, e, seq)
    s = st.status(state, None, seen=True, generation=1, events_through=0, now=1000.0)
    assert (s["phase"], s["round"], s["nodes"], s["worldSize"]) == ("Running", 1, 2, 4)
    running = {c["type"]: c for c in s["conditions"]}["Running"]
    assert (running["status"], running["reason"]) == ("True", "RoundActive")
    state = evolve(state, f.exited("n2", 1, rank=3, job=JOB), 5)
    later = st.status(
        state, None, seen=True, generation=1, events_through=0, now=2000.0, previous=s
    )
    assert later["lastFailure"]["node"] == "n2" and later["lastFailure"]["rank"] == 3
    # a condition that still holds keeps the time it became true
    assert {c["type"]: c for c in later["conditions"]}["Running"]["lastTransitionTime"] == (
        running["lastTransitionTime"]
    )
    assert st.status(initial(JOB), None, seen=False, generation=1, events_through=0, now=0)[
        "phase"
    ] == ("Submitting")


# --------------------------------------------------------------------------- operator


class Cluster:
    """kmock's emulator, with the resources the operator lists declared."""

    def __init__(self, emulator: kmock.KubernetesEmulator, server: kmock.Server) -> None:
        self.emulator = emulator
        self.server = server
        emulator.resources[RESOURCE] = {}  # type: ignore[assignment]

    def api(self) -> Any:
        return api_client(str(self.server.url).rstrip("/"))

    def objects(self, plural: str) -> dict[str, dict[str, Any]]:
        out = {}
        for (resource, _ns, name), obj in self.emulator.objects.items():
            if resource.plural == plural and not obj.deleted:
                out[name] = obj.raw
        return out

    def rovejob(self) -> dict[str, Any] | None:
        return self.objects("rovejobs").get(JOB)


@contextlib.asynccontextmanager
async def operator(bus: Bus, cluster: Cluster) -> AsyncIterator[controller.Operator]:
    op = controller.Operator(bus, cluster.api(), NS, SITE, resync_s=0.5, status_every_s=0.2)
    task = asyncio.create_task(op.run())
    try:
        yield op
    finally:
        op.stop()
        await asyncio.wait_for(task, 30)


async def create(cluster: Cluster, obj: dict[str, Any]) -> None:
    from kubernetes import client as k8s

    api = k8s.CustomObjectsApi(cluster.api())
    await asyncio.to_thread(
        api.create_namespaced_custom_object, rj.GROUP, rj.VERSION, NS, rj.PLURAL, obj
    )


def status_of(cluster: Cluster) -> dict[str, Any]:
    return (cluster.rovejob() or {}).get("status") or {}


def event_reasons(cluster: Cluster) -> list[str]:
    events = cluster.objects("events").values()
    return sorted(e["reason"] for e in events if e["involvedObject"]["name"] == JOB)


async def test_a_rovejob_is_run_followed_and_stopped_through_the_bus(any_bus: Bus) -> None:
    bus = any_bus  # (one server, and the 3-node cluster users deploy)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob())
        async with operator(bus, cluster):
            await eventually(lambda: len(cluster.objects("deployments")) == 2, timeout=30)
            assert set(cluster.objects("jobs")) == {f"rove-submit-{JOB}"}
            assert set(cluster.objects("configmaps")) == {f"rove-pod-template-{JOB}"}
            await eventually(lambda: status_of(cluster).get("phase") == "Submitting", timeout=30)
            assert rj.FINALIZER in cluster.rovejob()["metadata"]["finalizers"]  # type: ignore[index]

            # a scripted job on the bus: a round of two nodes, one lost, a round of one
            for e in (
                f.elected("m1", 1, job=JOB),
                f.joined("n1", job=JOB),
                f.joined("n2", n=1, job=JOB),
                msgspec.structs.replace(f.round_completed(1, 1, "n1", "n2", job=JOB), ts=101.0),
                f.progressed("n1", 1, 40, 130.0, job=JOB),
            ):
                await bus.publish(e)
            await eventually(lambda: status_of(cluster).get("round") == 1, timeout=30)
            s = status_of(cluster)
            assert (s["phase"], s["nodes"], s["worldSize"], s["step"]) == ("Running", 2, 4, 40)
            await bus.publish(f.lost("n2", 1, job=JOB))
            await bus.publish(
                msgspec.structs.replace(f.round_completed(2, 1, "n1", job=JOB), ts=201.0)
            )
            await eventually(lambda: status_of(cluster).get("round") == 2, timeout=30)
            assert status_of(cluster)["nodes"] == 1
            await eventually(lambda: "NodeLost" in event_reasons(cluster), timeout=30)
            assert event_reasons(cluster).count("RoundFormed") == 2

            await bus.publish(
                msgspec.structs.replace(f.ended(1, ev.JobPhase.FINISHED, job=JOB), ts=300.0)
            )
            await eventually(lambda: status_of(cluster).get("phase") == "Finished", timeout=30)
            assert "goodput" in status_of(cluster)
            # an ended job's masters and scaler would exit and be restarted forever
            await eventually(
                lambda: all(
                    d["spec"]["replicas"] == 0 for d in cluster.objects("deployments").values()
                ),
                timeout=30,
            )
            told = status_of(cluster)["eventsThrough"]
            assert told > 0 and "JobFinished" in event_reasons(cluster)

        # a second operator (a restart) rebuilds the status from the stream and
        # creates nothing twice: no object, no Kubernetes Event
        before = {p: set(cluster.objects(p)) for p in ("deployments", "jobs", "configmaps")}
        n_events = len(cluster.objects("events"))
        seen = len(list(emulator))
        async with operator(bus, cluster) as second:
            await eventually(lambda: JOB in second.followers, timeout=30)
            await asyncio.sleep(1.5)  # (several resyncs and status rounds)
        assert {p: set(cluster.objects(p)) for p in before} == before
        assert len(cluster.objects("events")) == n_events
        created = [r for r in list(emulator)[seen:] if r.method.value == "POST"]
        assert all(r.resource is not None and r.resource.plural != "events" for r in created)
        assert status_of(cluster)["phase"] == "Finished"

        # a third one starts from the masters' snapshot (it carries the goodput ledger
        # and covers only events already told), reads no history, and says the same
        replayed = status_of(cluster)
        recs = await stored_events(bus, JOB)
        ledger = gp.of_events([r.event for r in recs])
        await snapshots.save(
            bus, fold_records(recs, job=JOB), master="m1", now=300.0, goodput=ledger
        )
        # (the operator reads it with a direct get, which a lagging replica may answer
        # without it: it would replay instead, correctly but not what this checks)
        last, _ = await bus.last_message(subjects.SNAPSHOT_STREAM, subjects.snapshot(JOB))
        await replicas_hold(bus, subjects.SNAPSHOT_STREAM, last)
        seen = len(list(emulator))
        async with operator(bus, cluster) as third:
            await eventually(lambda: JOB in third.followers, timeout=30)
            assert third.followers[JOB].replica.snapshot_seq == recs[-1].seq
            await asyncio.sleep(1.5)  # (several resyncs and status rounds)
        assert len(cluster.objects("events")) == n_events
        statuses = [
            r
            for r in list(emulator)[seen:]
            if r.method.value == "PATCH"
            and r.resource is not None
            and r.resource.plural == "rovejobs"
        ]
        assert statuses == [], "the status it computes is the one the object has"
        again = status_of(cluster)
        assert again == replayed and "goodput" in again and again["step"] == 40


async def test_deleting_a_running_rovejob_stops_the_job_then_lets_kubernetes_delete_it(
    any_bus: Bus,
) -> None:
    bus = any_bus  # (one server, and the 3-node cluster users deploy)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob())
        for e in (
            f.elected("m1", 1, job=JOB),
            f.joined("n1", job=JOB),
            f.round_completed(1, 1, "n1", job=JOB),
        ):
            await bus.publish(e)
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("phase") == "Running", timeout=30)
            from kubernetes import client as k8s

            api = k8s.CustomObjectsApi(cluster.api())
            await asyncio.to_thread(
                api.delete_namespaced_custom_object, rj.GROUP, rj.VERSION, NS, rj.PLURAL, JOB
            )

            async def stop_asked() -> bool:
                return any(
                    isinstance(r.event, ev.StopRequested) for r in await stored_events(bus, JOB)
                )

            await eventually(stop_asked, timeout=30)
            # the finalizer is taken off: the emulator (as Kubernetes) deletes the object
            await eventually(lambda: cluster.rovejob() is None, timeout=30)
        [stop] = [
            r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.StopRequested)
        ]
        assert stop.reason == f"RoveJob {NS}/{JOB} deleted"


async def test_a_refused_create_is_retried_and_nothing_is_created_twice(bus: Bus) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob())
        # the API server fails the scaler's creation once (as an operator killed mid-way)
        scalers = kmock.data({"metadata": {"name": f"rove-scaler-{JOB}"}})
        emulator["post", re.compile(r".*/deployments$"), scalers][:1] << 503  # type: ignore[index]
        async with operator(bus, cluster):
            await eventually(lambda: len(cluster.objects("deployments")) == 2, timeout=30)
            await asyncio.sleep(1.0)  # (resyncs after everything is there)
        posts: dict[str, int] = {}
        skip = ("events", "rovejobs")  # (Kubernetes Events; the test's own RoveJob)
        for r in emulator:
            if r.method.value == "POST" and r.resource and r.resource.plural not in skip:
                name = (r.data or {}).get("metadata", {}).get("name", "")
                posts[name] = posts.get(name, 0) + 1
        # the refused create was tried again, and each object created once
        assert posts == {
            f"rove-pod-template-{JOB}": 1,
            f"rove-submit-{JOB}": 1,
            f"rove-master-{JOB}": 1,
            f"rove-scaler-{JOB}": 2,
        }
        assert set(cluster.objects("deployments")) == {f"rove-master-{JOB}", f"rove-scaler-{JOB}"}


def test_a_refused_submit_fails_its_job_at_once_and_says_why_where_kubectl_shows_it() -> None:
    """`rove submit` refusing the job (exit 2) is not tried 6 times: the submit Job's
    podFailurePolicy fails it at once (it takes restartPolicy Never), and the refusal's
    line is the pod's termination message. Valid for Kubernetes as the deploy checks it."""
    import kubernetes_validate

    from rove.control.flags.options import EXIT_USAGE
    from tests.test_deploy import K8S_VERSION

    obj = rovejob()
    [submit] = [c for c in rj.children(obj, rj.parse(obj), SITE) if c["kind"] == "Job"]
    kubernetes_validate.validate(submit, K8S_VERSION, strict=True)
    pod = submit["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    [rule] = submit["spec"]["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob"
    assert rule["onExitCodes"] == {"containerName": "submit", "operator": "In", "values": [2]}
    assert rj.REFUSED_EXIT == EXIT_USAGE == 2
    [container] = pod["containers"]
    assert container["name"] == "submit"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"


async def test_a_rovejob_whose_submit_job_failed_fails_saying_why_and_where(bus: Bus) -> None:
    """A job with no event whose submit Job failed stayed "Submitting" for ever; its
    RoveJob now fails, with Kubernetes' reason and the command that shows the refusal."""
    from kubernetes import client as k8s

    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob())
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("phase") == "Submitting", timeout=30)
            assert f"rove-submit-{JOB}" in cluster.objects("jobs")
            verdict = {  # (what the Job controller writes under the podFailurePolicy)
                "type": "Failed",
                "status": "True",
                "reason": "PodFailurePolicy",
                "message": f"Container submit for pod {NS}/rove-submit-{JOB}-x7k2p failed "
                "with exit code 2 matching FailJob rule at index 0",
            }
            batch = k8s.BatchV1Api(cluster.api())
            await asyncio.to_thread(
                batch.patch_namespaced_job_status,
                f"rove-submit-{JOB}",
                NS,
                {"status": {"failed": 1, "conditions": [verdict]}},
            )
            await eventually(lambda: status_of(cluster).get("phase") == "Failed", timeout=30)
            await eventually(  # its masters and scaler waited for a job that never came
                lambda: all(
                    d["spec"]["replicas"] == 0 for d in cluster.objects("deployments").values()
                ),
                timeout=30,
            )
            await asyncio.sleep(1.0)  # (said once, not again at each tick)
        conditions = {c["type"]: c for c in status_of(cluster)["conditions"]}
        failed = conditions["Failed"]
        assert failed["status"] == "True" and failed["reason"] == "SubmitFailed"
        assert conditions["Running"]["status"] == "False"
        assert "PodFailurePolicy" in failed["message"] and "exit code 2" in failed["message"]
        assert f"kubectl logs -n {NS} job/rove-submit-{JOB}" in failed["message"]
        assert event_reasons(cluster) == ["SubmitFailed"]


async def test_an_invalid_rovejob_is_marked_and_told_not_run(bus: Bus) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob(nnodes="4:2"))
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("phase") == "Invalid", timeout=30)
            await asyncio.sleep(1.0)
        assert cluster.objects("deployments") == {} and cluster.objects("jobs") == {}
        assert "nnodes" in status_of(cluster)["conditions"][0]["message"]
        assert event_reasons(cluster) == ["InvalidSpec"]


async def test_a_rovejob_created_while_the_operator_runs_is_seen_by_its_watch_which_ends_with_it(
    bus: Bus,
) -> None:
    """A resync far away (60 s): only the watch wakes the reconcile within the deadline.
    Stopped, the operator ends its watch at once rather than at the watch's timeout
    (3 resyncs), holding the API server's connection until then."""
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        op = controller.Operator(bus, cluster.api(), NS, SITE, resync_s=60, status_every_s=0.2)
        task = asyncio.create_task(op.run())

        def watches() -> list[Any]:
            return [r for r in list(emulator) if r.method.value == "GET" and "watch" in r.params]

        await eventually(lambda: watches(), timeout=30)
        await create(cluster, rovejob())
        await eventually(lambda: len(cluster.objects("deployments")) == 2, timeout=30)
        op.stop()
        await asyncio.wait_for(task, 30)
        await eventually(
            lambda: not any(t.name == "rove-operator-watch" for t in threading.enumerate()),
            timeout=20,  # (the watch asks for 180 s)
        )


def _role() -> dict[tuple[str, str], set[str]]:
    docs = list(yaml.safe_load_all((DEPLOY / "base/operator/rbac.yaml").read_text()))
    [role] = [d for d in docs if d["kind"] == "Role"]
    granted: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                granted.setdefault((group, res), set()).update(rule["verbs"])
    return granted


async def test_the_operators_role_grants_exactly_what_it_uses(bus: Bus) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob())
        await create(cluster, rovejob(name="rj2", nnodes="3:1"))  # an invalid one
        await create(cluster, rovejob(name="rj3"))  # no event yet: its submit Job is read
        for e in (f.elected("m1", 1, job=JOB), f.ended(1, ev.JobPhase.FINISHED, job=JOB)):
            await bus.publish(e)
        start = len(list(emulator))
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("phase") == "Finished", timeout=30)
            await eventually(
                lambda: all(
                    d["spec"]["replicas"] == 0
                    for name, d in cluster.objects("deployments").items()
                    if name.endswith(f"-{JOB}")
                ),
                timeout=30,
            )
            await eventually(
                lambda: any(
                    r.method.value == "GET"
                    and r.resource is not None
                    and r.resource.plural == "jobs"
                    for r in list(emulator)[start:]
                ),
                timeout=30,
            )
            from kubernetes import client as k8s

            api = k8s.CustomObjectsApi(cluster.api())
            await asyncio.to_thread(
                api.delete_namespaced_custom_object, rj.GROUP, rj.VERSION, NS, rj.PLURAL, JOB
            )
            await eventually(lambda: cluster.rovejob() is None, timeout=30)
        used: dict[tuple[str, str], set[str]] = {}
        for request in list(emulator)[start:]:
            if request.method.value == "DELETE":
                continue  # (the test's own: the operator deletes nothing)
            res, action = request.resource, request.action
            assert res is not None and action is not None and request.namespace == NS
            plural = res.plural + ("/status" if request.url.path.endswith("/status") else "")
            verb = "patch" if request.method.value == "PATCH" else VERBS[action.value]
            used.setdefault((res.group or "", plural), set()).add(verb)
    assert used == _role()


class OperatorProc(CliProc):
    """A `rove operator` process."""

    def __init__(self, nats_url: str, kube_api: str, log_dir: Path, name: str) -> None:
        self._spawn(
            f"rove operator {name}",
            log_dir / f"operator-{name}.log",
            *("operator", "--namespace", NS, "--nats", nats_url, "--kube-api", kube_api),
            *("--resync", "1", "--tls-ca-secret", "rove-nats-tls"),
        )


async def test_the_rove_operator_command_killed_and_started_again_creates_nothing_twice(
    bus: Bus, tmp_path: Path
) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        kube = str(server.url).rstrip("/")
        await create(cluster, rovejob())
        first = OperatorProc(bus.url, kube, tmp_path, "1")
        await eventually(lambda: len(cluster.objects("deployments")) == 2, timeout=60)
        await bus.publish(f.elected("m1", 1, job=JOB))
        await bus.publish(f.joined("n1", job=JOB))
        await bus.publish(f.round_completed(1, 1, "n1", job=JOB))
        await eventually(lambda: status_of(cluster).get("phase") == "Running", timeout=60)
        first.kill()  # SIGKILL: no goodbye
        second = OperatorProc(bus.url, kube, tmp_path, "2")
        await bus.publish(f.ended(1, ev.JobPhase.FINISHED, job=JOB))
        await eventually(lambda: status_of(cluster).get("phase") == "Finished", timeout=60)
        # (in a thread: the emulator answers the operator's last calls on this loop)
        assert await asyncio.to_thread(second.stop) == 0, second.log()[-3000:]
        assert "Traceback" not in second.log(), second.log()[-3000:]
    creates: dict[str, list[int]] = {}
    for r in emulator:
        if (
            r.method.value == "POST"
            and r.resource
            and r.resource.plural not in ("rovejobs", "events")
        ):
            creates.setdefault((r.data or {})["metadata"]["name"], []).append(1)
    # each child was asked for by both operators (the second got 409) and exists once
    assert {name: len(asked) for name, asked in creates.items()} == {
        f"rove-{k}-{JOB}": 2 for k in ("pod-template", "submit", "master", "scaler")
    }
    assert set(cluster.objects("deployments")) == {f"rove-master-{JOB}", f"rove-scaler-{JOB}"}
    envs = {
        e["name"]: e.get("value")
        for e in cluster.objects("deployments")[f"rove-master-{JOB}"]["spec"]["template"]["spec"][
            "containers"
        ][0]["env"]
    }
    assert envs["ROVE_NATS_URL"] == bus.url and envs["ROVE_NATS_TLS_CA"] == "/etc/rove-tls/ca.crt"


async def test_a_rovejob_under_the_name_of_a_job_that_ended_is_refused(bus: Bus) -> None:
    for e in (
        msgspec.structs.replace(f.elected("m1", 1, job=JOB), ts=1_000.0),
        msgspec.structs.replace(f.ended(1, ev.JobPhase.FINISHED, job=JOB), ts=1_010.0),
    ):
        await bus.publish(e)
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        obj = rovejob()
        obj["metadata"]["creationTimestamp"] = "2026-11-27T12:00:00Z"  # long after the end
        await create(cluster, obj)
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("phase") == "Invalid", timeout=30)
            await asyncio.sleep(1.0)  # (resyncs: it stays refused, and nothing is made)
        assert cluster.objects("deployments") == {} and cluster.objects("jobs") == {}
        message = status_of(cluster)["conditions"][0]["message"]
        assert "already ran and ended" in message and "new name" in message
        assert status_of(cluster)["phase"] == "Invalid"


def test_a_job_that_ended_after_its_rovejob_was_created_is_its_own() -> None:
    created = "2026-11-27T12:00:00Z"
    assert st.reused(JOB, created, None) is None  # not ended
    assert st.reused(JOB, None, 1.0) is None  # (no creation time: the emulator's objects)
    assert st.reused(JOB, created, 1_796_000_000.0) is None  # ended after: this job's end
    assert "already ran" in (st.reused(JOB, created, 1_000.0) or "")


async def test_a_new_nnodes_in_the_spec_asks_the_job_for_its_new_bounds_once(bus: Bus) -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        cluster = Cluster(emulator, server)
        await create(cluster, rovejob(nnodes="1:4"))
        submitted = ev.JobSubmitted(
            **ev.envelope(JOB, "cli", 100.0, "submitted"), workload=f.workload(1, 4)
        )
        for e in (f.elected("m1", 1, job=JOB), submitted, f.joined("n1", job=JOB)):
            await bus.publish(e)
        async with operator(bus, cluster):
            await eventually(lambda: status_of(cluster).get("nnodes") == "1:4", timeout=30)
            # kubectl edit: nnodes 2:6 (the API server bumps the generation)
            from kubernetes import client as k8s

            api = k8s.CustomObjectsApi(cluster.api())
            patch = {"metadata": {"generation": 2}, "spec": {"nnodes": "2:6"}}
            await asyncio.to_thread(
                api.patch_namespaced_custom_object, rj.GROUP, rj.VERSION, NS, rj.PLURAL, JOB, patch
            )
            await eventually(lambda: status_of(cluster).get("nnodes") == "2:6", timeout=30)
            await asyncio.sleep(1.5)  # (resyncs: the job's bounds are the spec's now)
        asked = [
            r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.ScaleRequested)
        ]
        assert [(e.min_nodes, e.max_nodes) for e in asked] == [(2, 6)]
        assert asked[0].reason == f"RoveJob {NS}/{JOB}: nnodes 2:6"


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_a_rovejobs_children_find_everything_they_refer_to_under_each_overlay(
    overlay: str,
) -> None:
    """What the operator of an overlay (its own flags and NATS address) makes for the
    example RoveJob, applied beside the overlay: every Secret, ConfigMap, account and
    namespace it refers to exists, or is one docs/kubernetes.md has you create."""
    from tests import kube_refs
    from tests.test_deploy import render
    from tests.test_deploy_refs import undocumented

    docs = render(f"overlays/{overlay}")
    [deployment] = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rove-operator"
    ]
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(c["args"])
    env = {e["name"]: e.get("value") for e in c["env"]}
    site = rj.Site(
        nats_url=env["ROVE_NATS_URL"],
        users_secret=args.users_secret,
        ca_secret=args.tls_ca_secret,
        nodes_ca_secret=args.nodes_ca_secret,
        nodes_namespace=args.nodes_namespace,
        scaler_account=args.scaler_account,
    )
    assert bool(site.ca_secret) == (overlay == "prod") and site.nats_url.startswith(
        "tls://" if overlay == "prod" else "nats://"
    )
    obj = example()
    obj["metadata"].update(namespace=args.namespace, uid="u1")
    problems, missing = kube_refs.check(docs + rj.children(obj, rj.parse(obj), site))
    assert problems == []
    assert undocumented(missing) == [], "referred to, and neither applied nor created by the docs"
    if overlay == "dev":
        assert [str(m) for m in missing] == []


def test_the_immutability_rule_names_every_field_but_nnodes() -> None:
    """(CEL runs only in an API server: this checks that a field added to the schema is
    added to the rule too.)"""
    spec = crd_schema()["properties"]["spec"]
    [rule] = spec["x-kubernetes-validations"]
    named = set(re.findall(r"self\.(\w+)", rule["rule"]))
    assert named == set(spec["properties"]) - {"nnodes"}


def test_a_tensorflow_job_submits_its_parameter_servers_nodes_and_their_size() -> None:
    tf = {"numPs": 2, "psResources": {"cpu": "500m", "memory": "16Gi"}}
    obj = rovejob(nnodes="3:4", tensorflow=tf, script="examples/tf_ps.py", args=[])
    jsonschema.validate(obj, crd_schema())
    [submit] = [c for c in rj.children(obj, rj.parse(obj), SITE) if c["kind"] == "Job"]
    args = submit["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--ps-node-memory") + 1] == "16G"
    assert args[args.index("--ps-node-cpu") + 1] == "0.5"
    after = args[args.index("--") + 1 :]
    assert after[-4:] == ["--tf-ps", "--num-ps", "2", "examples/tf_ps.py"]
    build_parser().parse_args(args)
    with pytest.raises(ConfigError, match="give at least 3"):
        rj.parse(rovejob(nnodes="2:4", tensorflow=tf))
    with pytest.raises(ConfigError, match="use mode: pods"):
        rj.parse(rovejob(nnodes="3", mode="pool", tensorflow=tf))


async def test_an_operator_starts_from_a_snapshot_only_if_it_skips_nothing_untold(
    bus: Bus,
) -> None:
    """The events a snapshot folds are never read again: one newer than the Kubernetes
    Events told so far (`eventsThrough`) would skip some untold, and one without the
    goodput ledger would lose the goodput before it. Either way: the whole stream."""
    from rove.control.master.state import initial

    follower = controller.Follower(bus, JOB, told=10)
    ledger = gp.Ledger()

    def snap(seq: int, goodput: gp.Ledger | None) -> snapshots.Loaded:
        return snapshots.Loaded(msgspec.structs.replace(initial(JOB), applied_seq=seq), goodput)

    assert follower._may_start_from(snap(10, ledger))
    assert not follower._may_start_from(snap(11, ledger)), "events 11.. not told yet"
    assert not follower._may_start_from(snap(5, None)), "no goodput ledger in it"


def test_a_status_field_that_went_is_sent_as_null_so_the_merge_patch_removes_it() -> None:
    from rove.control.master.state import initial

    state = msgspec.structs.replace(initial(JOB), applied_seq=3)
    before = st.status(state, None, seen=True, generation=1, events_through=3, now=1.0, step=40)
    after = st.status(state, None, seen=True, generation=1, events_through=3, now=2.0)
    assert before["step"] == 40 and "step" not in after  # (a new run: no step yet)
    body = st.patch(after, before)
    assert body["step"] is None
    assert {k: v for k, v in body.items() if k != "step"} == after
    assert st.patch(before, before) == before
