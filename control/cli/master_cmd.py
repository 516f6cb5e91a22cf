"""`rove master`: run a master candidate for a job (leader or standby).

Start it any number of times against the same NATS: one leads, the others
follow the stream and take over within the lease TTL when the leader dies. Each
stops (exit 0) when the job ends, unless `--keep-serving`.
"""

from __future__ import annotations

import argparse

import structlog

from rove.control.bus import embedded
from rove.control.bus.client import Bus
from rove.control.catalogue import events, subjects
from rove.control.flags import options as common
from rove.control.master.runner import MasterRunner
from rove.control.process import aio, metrics

log = structlog.get_logger("rove.master")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "master", help="run a master for a job (leader or standby)", description=__doc__
    )
    common.add_job_arg(p)
    p.add_argument("--id", dest="master_id", help="this master's id (default: host-pid)")
    p.add_argument(
        "--node-timeout",
        type=common.positive,
        default=30.0,
        metavar="SECONDS",
        help="a node with no heartbeat for this long is lost (default 30)",
    )
    p.add_argument(
        "--lease-ttl",
        type=common.positive,
        default=6.0,
        metavar="SECONDS",
        help="leader lease TTL when the lease bucket is created (default 6)",
    )
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=1000,
        metavar="EVENTS",
        help="write a snapshot after this many events, or a fifth as many as the job has "
        "nodes if more (default 1000)",
    )
    p.add_argument(
        "--snapshot-interval",
        type=common.positive,
        default=30.0,
        metavar="SECONDS",
        help="or after this many seconds with new events (default 30)",
    )
    p.add_argument(
        "--keep-serving",
        action="store_true",
        help="stay once the job has ended, for its next run (default: stop with exit 0 "
        "when the job this master followed ends)",
    )
    common.add_metrics_arg(p)
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    master_id = args.master_id or common.process_id()
    subjects.check_name("master id", master_id)
    return aio.run(_run(args, master_id), watch=f"master {master_id}")


async def _run(args: argparse.Namespace, master_id: str) -> int:
    options = common.bus_options(
        args,
        name=f"rove-master-{master_id}",
        job=args.job,
        daemon=True,
        allow_embedded=True,
        lease_ttl_s=args.lease_ttl,
    )
    starting = aio.Starting(f"master {master_id}")
    bus = await starting.wait(Bus.connect(options))
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    if bus.server is not None:
        path = embedded.url_file(args.job)
        path.write_text(bus.url + "\n")
        log.info("started an embedded NATS server", url=bus.url, store=str(options.embedded_dir))
    runner = MasterRunner(
        bus,
        args.job,
        master_id,
        events.JobSpec(node_timeout_s=args.node_timeout),
        snapshot_every_events=args.snapshot_every,
        snapshot_every_s=args.snapshot_interval,
        until_ended=not args.keep_serving,
    )
    starting.started(runner.stop)
    try:
        await runner.run()
    finally:
        if bus.server is not None:
            embedded.url_file(args.job).unlink(missing_ok=True)
        await bus.close()
    log.info("master stopped", job=args.job, master=master_id)
    return common.EXIT_OK
