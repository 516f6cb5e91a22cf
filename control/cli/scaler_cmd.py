"""`rove scaler`: apply a managed job's scale plans through a backend.

Run one per job (a second one is harmless: plan outcomes are deduplicated, and
backends create each node name once). `--backend local` starts nodes as
processes on this machine; they outlive the scaler, and a restarted scaler
adopts them. `--backend kubernetes` creates one pod per node (run it in the
cluster with deploy/'s service account). See docs/scaling.md and
docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import structlog

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.process import aio
from rove.control.scaler.backend import Backend
from rove.control.scaler.local import LocalBackend
from rove.control.scaler.pool import PoolBackend
from rove.control.scaler.service import Scaler

log = structlog.get_logger("rove.scaler")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scaler",
        help="apply a managed job's scale plans (local processes or a pool of agents)",
        description=__doc__,
    )
    common.add_job_arg(p)
    p.add_argument("--id", dest="scaler_id", help="this scaler's id (default: host-pid)")
    p.add_argument(
        "--backend",
        choices=["local", "pool", "kubernetes"],
        default="local",
        help="where nodes run: local = `rove run` processes on this machine (default); "
        "pool = idle `rove agent --pool` daemons; kubernetes = one pod per node",
    )
    p.add_argument("--pool", default="default", help="with --backend pool: the pool (default)")
    p.add_argument(
        "--plan-deadline",
        type=common.positive,
        default=300.0,
        metavar="SECONDS",
        help="a plan not applied within this long is reported failed (default 300)",
    )
    p.add_argument(
        "--create-interval",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pause between two node creations of one plan (default 0)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="local backend: where node markers and logs go (default ~/.rove/jobs/<job>/scaler)",
    )
    k8s = p.add_argument_group("kubernetes backend")
    k8s.add_argument(
        "--namespace", default="rove-jobs", help="namespace of the node pods (default rove-jobs)"
    )
    k8s.add_argument("--image", help="container image of the node pods (required)")
    k8s.add_argument(
        "--pod-nats-url",
        metavar="URL",
        help="NATS URL(s) as the pods reach them (default: --nats); credentials go in "
        "the pod template's env (ROVE_NATS_USER, ROVE_NATS_PASSWORD), not here",
    )
    k8s.add_argument(
        "--pod-template",
        type=Path,
        metavar="FILE",
        help="a Pod in YAML whose nodeSelector, tolerations, volumes, env... every node pod "
        "starts from; rove sets the command, resources, labels and restart policy",
    )
    k8s.add_argument(
        "--pending-timeout",
        type=common.positive,
        default=120.0,
        metavar="SECONDS",
        help="a pod the scheduler cannot place for this long is reported to the master, "
        "which retries it smaller or goes on without it (default 120)",
    )
    k8s.add_argument(
        "--kube-api",
        metavar="URL",
        help="the API server's URL (default: in-cluster config, else ~/.kube/config)",
    )
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    scaler_id = args.scaler_id or common.process_id()
    subjects.check_name("scaler id", scaler_id)
    if args.create_interval < 0:
        raise ConfigError(f"--create-interval must be 0 or more, got {args.create_interval}")
    if args.backend == "kubernetes" and not args.image:
        raise ConfigError("--backend kubernetes needs --image: the image the node pods run")
    return aio.run(_run(args, scaler_id), watch=f"scaler {scaler_id}")


def _backend(args: argparse.Namespace, bus: Bus, url: str) -> Backend:
    if args.backend == "pool":
        return PoolBackend(bus, subjects.check_name("pool", args.pool))
    if args.backend == "kubernetes":
        try:
            from rove.control.scaler import kubernetes
        except ImportError as exc:
            raise ConfigError(
                f"--backend kubernetes needs the kubernetes client ({exc}): "
                "pip install 'rove[kubernetes]'"
            ) from exc
        return kubernetes.KubernetesBackend(
            namespace=args.namespace,
            image=args.image,
            nats_url=args.pod_nats_url or url,
            api=kubernetes.api_client(args.kube_api),
            template=kubernetes.load_template(args.pod_template),
            pending_timeout_s=args.pending_timeout,
        )
    return LocalBackend(bus.url, state_dir=args.state_dir)


async def _run(args: argparse.Namespace, scaler_id: str) -> int:
    options = common.bus_options(args, name=f"rove-scaler-{scaler_id}", job=args.job, daemon=True)
    starting = aio.Starting(f"scaler {scaler_id}")
    bus = await starting.wait(Bus.connect(options))
    backend = _backend(args, bus, options.url or bus.url)
    scaler = Scaler(
        bus,
        args.job,
        backend,
        scaler_id=scaler_id,
        plan_deadline_s=args.plan_deadline,
        create_interval_s=args.create_interval,
    )
    starting.started(scaler.stop)
    try:
        await scaler.run()
    finally:
        await backend.close()
        await bus.close()
    log.info("scaler stopped", job=args.job, scaler=scaler_id)
    return common.EXIT_OK
