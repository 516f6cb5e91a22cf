"""`rove operator`: run every RoveJob of a namespace (deploy/base/operator).

    rove operator --namespace rove-system --nats tls://rove-nats.rove-system.svc:4222 \\
        --tls-ca-secret rove-nats-tls --nodes-ca-secret rove-nats-ca

For each `RoveJob` it creates the job's `rove submit` Job, its masters and its
scaler (and its Kafka bridge), owned by the RoveJob; it writes the job's state
from the event stream into the RoveJob's status and Kubernetes Events; deleting
the RoveJob stops the job. One per cluster (a second is harmless: every object
is created once by name). See docs/kubernetes.md.
"""

from __future__ import annotations

import argparse
import os

import structlog

from rove.control.bus.client import Bus
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.process import aio

log = structlog.get_logger("rove.operator")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "operator",
        help="run the RoveJobs of a Kubernetes namespace (deploy/base/operator)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "rove-system"),
        help="the namespace whose RoveJobs it runs, and where their masters and scalers "
        "run (default: $POD_NAMESPACE, else rove-system)",
    )
    p.add_argument(
        "--job-nats-url",
        metavar="URL",
        help="the NATS address the jobs' processes use (default: the operator's own)",
    )
    p.add_argument(
        "--users-secret",
        default="rove-nats-users",
        help="the Secret of the NATS users' passwords, in --namespace and (key agent) in "
        "--nodes-namespace (default rove-nats-users)",
    )
    p.add_argument(
        "--tls-ca-secret",
        default="",
        metavar="SECRET",
        help="with TLS: the Secret (key ca.crt) of the NATS CA in --namespace, mounted in "
        "every master, scaler, bridge and submit pod (default: none, no TLS)",
    )
    p.add_argument(
        "--nodes-ca-secret",
        default="",
        metavar="SECRET",
        help="with TLS: the same CA's Secret in --nodes-namespace, mounted in every node pod",
    )
    p.add_argument(
        "--nodes-namespace",
        default="rove-jobs",
        help="where the scaler creates node pods (default rove-jobs)",
    )
    p.add_argument(
        "--scaler-account",
        default="rove-scaler",
        help="the service account of the jobs' scalers (default rove-scaler)",
    )
    p.add_argument(
        "--resync",
        type=common.positive,
        default=10.0,
        metavar="SECONDS",
        help="look at every RoveJob at least this often, watch or not (default 10)",
    )
    p.add_argument("--kube-api", metavar="URL", help="the API server (default: in-cluster)")
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.nodes_ca_secret and not args.tls_ca_secret:
        raise ConfigError("--nodes-ca-secret without --tls-ca-secret: give both for TLS")
    return aio.run(_run(args), watch="the operator")


async def _run(args: argparse.Namespace) -> int:
    try:
        from rove.control.operator import controller, spec
        from rove.control.scaler.kubernetes import api_client
    except ImportError as exc:
        raise ConfigError(
            f"rove operator needs the kubernetes client ({exc}): pip install 'rove[kubernetes]'"
        ) from exc
    options = common.bus_options(args, name="rove-operator", daemon=True, role="operator")
    api = api_client(args.kube_api)
    starting = aio.Starting("the operator")
    bus = await starting.wait(Bus.connect(options))
    site = spec.Site(
        nats_url=args.job_nats_url or options.url or bus.url,
        users_secret=args.users_secret,
        ca_secret=args.tls_ca_secret,
        nodes_ca_secret=args.nodes_ca_secret,
        nodes_namespace=args.nodes_namespace,
        stream_replicas=options.replicas,
        scaler_account=args.scaler_account,
    )
    operator = controller.Operator(bus, api, args.namespace, site, resync_s=args.resync)
    starting.started(operator.stop)
    try:
        await operator.run()
    finally:
        await bus.close()
        api.close()  # type: ignore[no-untyped-call]
    log.info("operator stopped", namespace=args.namespace)
    return common.EXIT_OK
