"""A `RoveJob` and the Kubernetes objects that run it (pure).

`parse(obj)` reads a RoveJob (deploy/base/operator/crd.yaml) into a `JobSpec`,
checking what the CRD's schema cannot (a job name rove can use, `nnodes` in
order). `children(obj, spec, site)` is every object the operator creates for it,
each owned by the RoveJob (so `kubectl delete rovejob` removes them):

* `rove-submit-<job>`, a Kubernetes Job running `rove submit`: it hands the
  workload to the bus from the job's own image, where the script is (submitting
  twice changes nothing: the first submission is the job's);
* `rove-master-<job>`, two masters (one leads, one stands by);
* `rove-scaler-<job>`, the scaler, with the pool backend or the kubernetes one;
  for the latter, `rove-pod-template-<job>`, the ConfigMap of the nodes' pod
  template (checkpoint volume, Kafka settings, scheduling hooks, NATS CA);
* `rove-kafka-bridge-<job>` when the job reads a Kafka topic.

Every rove container gets the site's NATS address, its role's NATS user and, where
the site has TLS, the CA (`Site`: the operator's own flags).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from rove.control.catalogue import subjects
from rove.control.errors import ConfigError

GROUP = "rove.dev"
VERSION = "v1alpha1"
KIND = "RoveJob"
PLURAL = "rovejobs"
API_VERSION = f"{GROUP}/{VERSION}"
#: the finalizer that turns `kubectl delete` into a stop of the job on the bus
FINALIZER = "rove.dev/stop-job"
#: the label every child carries (and the scaler's node pods)
JOB_LABEL = "rove.dev/job"
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"
POD_GROUP = "scheduling.x-k8s.io/pod-group"

_NNODES = re.compile(r"^([1-9][0-9]*)(?::([1-9][0-9]*))?$")
#: an object store's URL (`rove.checkpoint.object_store`): a scheme, then a bucket
_STORE_URL = re.compile(r"^[a-z][a-z0-9+.-]*://[^/]+")


class _Spec(msgspec.Struct, frozen=True, kw_only=True, rename="camel", forbid_unknown_fields=True):
    pass


class Resources(_Spec, frozen=True, kw_only=True):
    cpu: str = ""
    memory: str = ""


class Checkpoint(_Spec, frozen=True, kw_only=True):
    #: where every node writes durable checkpoints (`rove run --checkpoint-dir`)
    dir: str = ""
    #: a PersistentVolumeClaim in the nodes' namespace, mounted at `dir` (ReadWriteMany)
    persistent_volume_claim: str = ""
    #: or an object store: `s3://bucket/prefix`, `gs://...`, `az://...`
    url: str = ""
    #: a Secret in the nodes' namespace whose keys are the store's environment
    #: (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ...), given to every node
    credentials_secret: str = ""


class Kafka(_Spec, frozen=True, kw_only=True):
    bootstrap: str
    topic: str
    dataset: str = ""
    #: a Secret holding `client.properties` (librdkafka's TLS/SASL settings), in the
    #: RoveJob's namespace for the bridge and in the nodes' for the readers
    config_secret: str = ""


class TensorFlow(_Spec, frozen=True, kw_only=True):
    """A TF2 parameter-server job (`rove run --tf-ps`); with `psResources`, each
    parameter server runs on a node of its own of that size (counted in `nnodes`)."""

    num_ps: int = 1
    ps_resources: Resources | None = None


class Scheduling(_Spec, frozen=True, kw_only=True):
    priority_class_name: str = ""
    #: a Kueue LocalQueue: the nodes carry `kueue.x-k8s.io/queue-name`
    queue: str = ""
    #: a coscheduling PodGroup: the nodes carry `scheduling.x-k8s.io/pod-group`
    pod_group: str = ""


class JobSpec(_Spec, frozen=True, kw_only=True):
    image: str
    script: str
    args: tuple[str, ...] = ()
    working_dir: str = "/opt/rove"
    nnodes: str = "1"
    nproc_per_node: int = 1
    max_restarts: int = 3
    mode: Literal["pods", "pool"] = "pods"
    pool: str = "default"
    resources: Resources = Resources()
    #: optimiser settings (`rove submit --policy KEY=VALUE`, docs/scaling.md)
    policy: dict[str, str] = {}
    checkpoint: Checkpoint = Checkpoint()
    kafka: Kafka | None = None
    tensorflow: TensorFlow | None = None
    scheduling: Scheduling = Scheduling()

    @property
    def bounds(self) -> tuple[int, int]:
        m = _NNODES.match(self.nnodes)
        assert m is not None  # parse() checked it
        low = int(m.group(1))
        return low, int(m.group(2) or low)


class Site(msgspec.Struct, frozen=True, kw_only=True):
    """What every job of the cluster shares: the operator's flags."""

    nats_url: str
    #: the Secret (in the RoveJobs' namespace) holding the NATS users' passwords
    users_secret: str = "rove-nats-users"
    #: the Secret holding the NATS CA (`ca.crt`) in the RoveJobs' namespace; "": no TLS
    ca_secret: str = ""
    #: the same CA for the nodes, in their namespace
    nodes_ca_secret: str = ""
    nodes_namespace: str = "rove-jobs"
    stream_replicas: int = 3
    scaler_account: str = "rove-scaler"


def parse(obj: Mapping[str, Any]) -> JobSpec:
    """The spec of RoveJob `obj`; `ConfigError` says what is wrong with it."""
    name = str((obj.get("metadata") or {}).get("name", ""))
    subjects.check_name("job", name)
    try:
        spec = msgspec.convert(obj.get("spec") or {}, JobSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"RoveJob {name}: {exc}") from exc
    m = _NNODES.match(spec.nnodes)
    if m is None or (m.group(2) and int(m.group(2)) < int(m.group(1))):
        raise ConfigError(f"RoveJob {name}: nnodes {spec.nnodes!r} is not MIN or MIN:MAX")
    if spec.nproc_per_node < 1 or spec.max_restarts < 0:
        raise ConfigError(f"RoveJob {name}: nprocPerNode >= 1 and maxRestarts >= 0")
    tf = spec.tensorflow
    if tf is not None and tf.ps_resources is not None:
        if spec.mode == "pool":
            raise ConfigError(
                f"RoveJob {name}: tensorflow.psResources sizes nodes the scaler creates; a "
                "pool job runs on the agents' machines: use mode: pods"
            )
        if spec.bounds[0] <= tf.num_ps:
            raise ConfigError(
                f"RoveJob {name}: nnodes counts the parameter servers' nodes: give at "
                f"least {tf.num_ps + 1} (the chief and the workers need one of their own)"
            )
    _check_checkpoint(name, spec)
    if spec.mode == "pool" and (
        spec.checkpoint.persistent_volume_claim
        or spec.checkpoint.credentials_secret
        or _hooks(spec)
    ):
        raise ConfigError(
            f"RoveJob {name}: a pool job runs on the agents' DaemonSet, which mounts no "
            "volume or Secret and takes no scheduling hooks per job; use mode: pods"
        )
    return spec


def _check_checkpoint(name: str, spec: JobSpec) -> None:
    c = spec.checkpoint
    if c.persistent_volume_claim and not c.dir:
        raise ConfigError(f"RoveJob {name}: checkpoint.persistentVolumeClaim needs a dir")
    if c.url and c.dir:
        raise ConfigError(
            f"RoveJob {name}: give checkpoint.dir (a volume) or checkpoint.url (an object "
            "store), not both"
        )
    if c.url and not _STORE_URL.match(c.url):
        raise ConfigError(
            f"RoveJob {name}: checkpoint.url {c.url!r} is not an object store's URL: give "
            "s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX"
        )
    if c.credentials_secret and not c.url:
        raise ConfigError(f"RoveJob {name}: checkpoint.credentialsSecret needs a url")


def _hooks(spec: JobSpec) -> bool:
    s = spec.scheduling
    return bool(s.priority_class_name or s.queue or s.pod_group)


def owner(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def names(job: str) -> dict[str, str]:
    return {
        "submit": f"rove-submit-{job}",
        "masters": f"rove-master-{job}",
        "scaler": f"rove-scaler-{job}",
        "template": f"rove-pod-template-{job}",
        "bridge": f"rove-kafka-bridge-{job}",
    }


def children(obj: Mapping[str, Any], spec: JobSpec, site: Site) -> list[dict[str, Any]]:
    """Every object that runs RoveJob `obj`, in the order they are created."""
    job, namespace = obj["metadata"]["name"], obj["metadata"]["namespace"]
    n = names(job)
    out: list[dict[str, Any]] = []
    if spec.mode == "pods":
        out.append(_configmap(n["template"], {"pod-template.yaml": _pod_template(spec, site)}))
    out.append(_submit(n["submit"], job, spec, site))
    out.append(_masters(n["masters"], job, spec, site))
    out.append(_scaler(n["scaler"], job, spec, site))
    if spec.kafka is not None:
        out.append(_bridge(n["bridge"], job, spec.kafka, spec, site))
    for child in out:
        meta = child["metadata"]
        meta["namespace"] = namespace
        meta.setdefault("labels", {}).update({JOB_LABEL: job, "app.kubernetes.io/part-of": "rove"})
        meta["ownerReferences"] = [owner(obj)]
    return out


# --------------------------------------------------------------------------- parts


def _restricted_pod(
    role: str, job: str, containers: list[dict[str, Any]], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    """A pod of the restricted Pod Security level (the RoveJobs' namespace enforces it)."""
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": containers,
    }
    if volumes:
        spec["volumes"] = volumes
    return {
        "metadata": {"labels": {"app.kubernetes.io/name": f"rove-{role}", JOB_LABEL: job}},
        "spec": spec,
    }


def _container(
    name: str,
    image: str,
    args: list[str],
    user: str,
    site: Site,
    *,
    cpu: str,
    memory: str,
    mounts: Sequence[dict[str, Any]] = (),
    env: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    tls = bool(site.ca_secret)
    return {
        "name": name,
        "image": image,
        "command": ["rove"],
        "args": args,
        "env": [
            {"name": "ROVE_NATS_URL", "value": site.nats_url},
            {"name": "ROVE_NATS_USER", "value": user},
            {
                "name": "ROVE_NATS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": site.users_secret, "key": user}},
            },
            *([{"name": "ROVE_NATS_TLS_CA", "value": "/etc/rove-tls/ca.crt"}] if tls else []),
            {"name": "ROVE_HOME", "value": "/tmp/rove"},
            *env,
        ],
        "volumeMounts": [
            *([{"name": "nats-ca", "mountPath": "/etc/rove-tls", "readOnly": True}] if tls else []),
            *mounts,
        ],
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }


def _ca_volumes(secret: str) -> list[dict[str, Any]]:
    if not secret:
        return []
    items = [{"key": "ca.crt", "path": "ca.crt"}]
    return [{"name": "nats-ca", "secret": {"secretName": secret, "items": items}}]


def _kafka_volume(kafka: Kafka | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, env) that give a container the Kafka client settings, if any."""
    if kafka is None or not kafka.config_secret:
        return [], []
    return (
        [{"name": "kafka-config", "secret": {"secretName": kafka.config_secret}}],
        [{"name": "ROVE_KAFKA_CONFIG", "value": "/etc/rove-kafka/client.properties"}],
    )


def _deployment(name: str, replicas: int, pod: dict[str, Any]) -> dict[str, Any]:
    selector = dict(pod["metadata"]["labels"])
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": dict(selector)},
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector}, "template": pod},
    }


def _configmap(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


def _run_args(spec: JobSpec) -> list[str]:
    low, high = spec.bounds
    out = [
        *("--nnodes", f"{low}:{high}", "--nproc-per-node", str(spec.nproc_per_node)),
        *("--max-restarts", str(spec.max_restarts)),
    ]
    if spec.checkpoint.dir or spec.checkpoint.url:
        out += ["--checkpoint-dir", spec.checkpoint.dir or spec.checkpoint.url]
    if spec.tensorflow is not None:
        out += ["--tf-ps", "--num-ps", str(spec.tensorflow.num_ps)]
    return [*out, spec.script, *spec.args]


#: The exit code of a `rove` command that refused what it was given (a ConfigError:
#: `rove.control.flags.options.EXIT_USAGE`, which this pure module does not import).
REFUSED_EXIT = 2


def _submit(name: str, job: str, spec: JobSpec, site: Site) -> dict[str, Any]:
    args = ["submit", "--job", job, "--replicas", str(site.stream_replicas)]
    if spec.resources.memory:
        args += ["--node-memory", spec.resources.memory.removesuffix("i")]
    if spec.resources.cpu:
        args += ["--node-cpu", _cpus(spec.resources.cpu)]
    ps = spec.tensorflow.ps_resources if spec.tensorflow is not None else None
    if ps is not None and ps.memory:
        args += ["--ps-node-memory", ps.memory.removesuffix("i")]
    if ps is not None and ps.cpu:
        args += ["--ps-node-cpu", _cpus(ps.cpu)]
    for key, value in sorted(spec.policy.items()):
        args += ["--policy", f"{key}={value}"]
    args += ["--cwd", spec.working_dir, "--", *_run_args(spec)]
    c = _container("submit", spec.image, args, "master", site, cpu="100m", memory="512Mi")
    c["workingDir"] = spec.working_dir
    # (the refusal's line is the pod's termination message: `kubectl describe` shows it)
    c["terminationMessagePolicy"] = "FallbackToLogsOnError"
    pod = _restricted_pod("submit", job, [c], _ca_volumes(site.ca_secret))
    # A refusal (exit 2: the job's name is a running job's, a bad argument) fails the
    # Job at once; anything else (NATS not reachable yet) is tried again, 6 times.
    # (podFailurePolicy takes restartPolicy Never: each try is a pod of its own.)
    pod["spec"]["restartPolicy"] = "Never"
    refused = {"containerName": "submit", "operator": "In", "values": [REFUSED_EXIT]}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": dict(pod["metadata"]["labels"])},
        "spec": {
            "backoffLimit": 6,
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": refused}]},
            "ttlSecondsAfterFinished": 3600,
            "template": pod,
        },
    }


def _cpus(quantity: str) -> str:
    """A Kubernetes CPU quantity ("2", "500m") as `rove submit --node-cpu` takes it."""
    return f"{float(quantity[:-1]) / 1000:g}" if quantity.endswith("m") else quantity


def _masters(name: str, job: str, spec: JobSpec, site: Site) -> dict[str, Any]:
    args = ["master", "--job", job, "--replicas", str(site.stream_replicas)]
    args += ["--node-timeout", "30", "--metrics-port", "9401"]
    c = _container("master", spec.image, args, "master", site, cpu="250m", memory="1Gi")
    c["ports"] = [{"name": "metrics", "containerPort": 9401}]
    pod = _restricted_pod("master", job, [c], _ca_volumes(site.ca_secret))
    pod["metadata"]["annotations"] = {"prometheus.io/scrape": "true", "prometheus.io/port": "9401"}
    pod["spec"]["terminationGracePeriodSeconds"] = 30
    pod["spec"]["topologySpreadConstraints"] = [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dict(pod["metadata"]["labels"])},
        }
    ]
    return _deployment(name, 2, pod)


def _scaler(name: str, job: str, spec: JobSpec, site: Site) -> dict[str, Any]:
    args = ["scaler", "--job", job, "--replicas", str(site.stream_replicas)]
    mounts: list[dict[str, Any]] = []
    volumes = _ca_volumes(site.ca_secret)
    if spec.mode == "pool":
        args += ["--backend", "pool", "--pool", spec.pool]
    else:
        args += ["--backend", "kubernetes", "--namespace", site.nodes_namespace]
        args += ["--image", spec.image, "--pod-template", "/etc/rove/pod-template.yaml"]
        mounts.append({"name": "pod-template", "mountPath": "/etc/rove", "readOnly": True})
        volumes.append({"name": "pod-template", "configMap": {"name": names(job)["template"]}})
    c = _container(
        "scaler", spec.image, args, "scaler", site, cpu="100m", memory="512Mi", mounts=mounts
    )
    pod = _restricted_pod("scaler", job, [c], volumes)
    pod["spec"]["serviceAccountName"] = site.scaler_account
    # the kubernetes backend talks to the API server; the pool backend does not
    pod["spec"]["automountServiceAccountToken"] = spec.mode == "pods"
    deployment = _deployment(name, 1, pod)
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return deployment


def _bridge(name: str, job: str, kafka: Kafka, spec: JobSpec, site: Site) -> dict[str, Any]:
    args = ["kafka-bridge", "--job", job, "--bootstrap", kafka.bootstrap, "--topic", kafka.topic]
    if kafka.dataset:
        args += ["--dataset", kafka.dataset]
    volumes, env = _kafka_volume(kafka)
    mounts = (
        [{"name": "kafka-config", "mountPath": "/etc/rove-kafka", "readOnly": True}]
        if volumes
        else []
    )
    c = _container(
        "bridge",
        spec.image,
        args,
        "master",
        site,
        cpu="100m",
        memory="512Mi",
        mounts=mounts,
        env=env,
    )
    pod = _restricted_pod("kafka-bridge", job, [c], [*_ca_volumes(site.ca_secret), *volumes])
    deployment = _deployment(name, 1, pod)
    deployment["spec"]["strategy"] = {"type": "Recreate"}
    return deployment


def _pod_template(spec: JobSpec, site: Site) -> str:
    """The nodes' pod template (YAML), as `rove scaler --pod-template` reads it: rove
    sets the node container's command, resources, labels, owner and restart policy."""
    import yaml  # (in the kubernetes extra, like the operator)

    env: list[dict[str, Any]] = [
        {"name": "ROVE_NATS_USER", "value": "agent"},
        {
            "name": "ROVE_NATS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": site.users_secret, "key": "agent"}},
        },
        {"name": "ROVE_HOME", "value": "/var/lib/rove"},
        {"name": "ROVE_METRICS_PORT", "value": "9400"},
        # the machine: each node's peer replicas go to a node on another one first
        {"name": "ROVE_FAILURE_DOMAIN", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # checkpoint slots the machine's /dev/shm has no room for: a folder of the machine's
        # own on its disk (the pod's host name changes with each relaunch; the machine not)
        {"name": "ROVE_SHM_SPILL_DIR", "value": "/var/lib/rove/spill/$(ROVE_FAILURE_DOMAIN)"},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "state", "mountPath": "/var/lib/rove"},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "shm", "hostPath": {"path": "/dev/shm", "type": "Directory"}},
        {"name": "state", "hostPath": {"path": "/var/lib/rove", "type": "DirectoryOrCreate"}},
    ]
    if site.nodes_ca_secret:
        env.append({"name": "ROVE_NATS_TLS_CA", "value": "/etc/rove-tls/ca.crt"})
        mounts.append({"name": "nats-ca", "mountPath": "/etc/rove-tls", "readOnly": True})
        volumes += _ca_volumes(site.nodes_ca_secret)
    kafka_volumes, kafka_env = _kafka_volume(spec.kafka)
    if kafka_volumes:
        env += kafka_env
        mounts.append({"name": "kafka-config", "mountPath": "/etc/rove-kafka", "readOnly": True})
        volumes += kafka_volumes
    claim = spec.checkpoint.persistent_volume_claim
    if claim:
        mounts.append({"name": "checkpoints", "mountPath": spec.checkpoint.dir})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": claim}})
    labels = {"app.kubernetes.io/part-of": "rove"}
    if spec.scheduling.queue:
        labels[KUEUE_QUEUE] = spec.scheduling.queue
    if spec.scheduling.pod_group:
        labels[POD_GROUP] = spec.scheduling.pod_group
    container: dict[str, Any] = {
        "name": "node",
        "image": spec.image,
        "workingDir": spec.working_dir,
        "env": env,
        "ports": [{"name": "metrics", "containerPort": 9400}],
        "volumeMounts": mounts,
    }
    if spec.checkpoint.credentials_secret:  # the object store's credentials, as env
        container["envFrom"] = [{"secretRef": {"name": spec.checkpoint.credentials_secret}}]
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostIPC": True,  # the machine's /dev/shm: a relaunched node restores from memory
        "terminationGracePeriodSeconds": 60,
        "containers": [container],
        "volumes": volumes,
    }
    if spec.scheduling.priority_class_name:
        pod_spec["priorityClassName"] = spec.scheduling.priority_class_name
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "labels": labels,
            "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": "9400"},
        },
        "spec": pod_spec,
    }
    return str(yaml.safe_dump(pod, sort_keys=False))
