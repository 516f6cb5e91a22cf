"""`rove scaler`: apply a managed job's scale plans through a backend.

Run one per job (a second one is harmless: plan outcomes are deduplicated, and
backends create each node name once). `--backend local` starts nodes as
processes on this machine; they outlive the scaler, and a restarted scaler
adopts them. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import structlog

from rove.control import aio, subjects
from rove.control import options as common
from rove.control.bus import Bus
from rove.control.errors import ConfigError
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
    p.add_argument("--job", required=True, help="job name")
    p.add_argument("--id", dest="scaler_id", help="this scaler's id (default: host-pid)")
    p.add_argument(
        "--backend",
        choices=["local", "pool"],
        default="local",
        help="where nodes run: local = `rove run` processes on this machine (default); "
        "pool = idle `rove agent --pool` daemons",
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
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    subjects.check_name("job", args.job)
    scaler_id = args.scaler_id or common.process_id()
    subjects.check_name("scaler id", scaler_id)
    if args.create_interval < 0:
        raise ConfigError(f"--create-interval must be 0 or more, got {args.create_interval}")
    return aio.run(_run(args, scaler_id))


async def _run(args: argparse.Namespace, scaler_id: str) -> int:
    options = common.bus_options(args, name=f"rove-scaler-{scaler_id}", job=args.job, daemon=True)
    bus = await Bus.connect(options)
    backend: Backend = (
        PoolBackend(bus, subjects.check_name("pool", args.pool))
        if args.backend == "pool"
        else LocalBackend(bus.url, state_dir=args.state_dir)
    )
    scaler = Scaler(
        bus,
        args.job,
        backend,
        scaler_id=scaler_id,
        plan_deadline_s=args.plan_deadline,
        create_interval_s=args.create_interval,
    )
    aio.stop_on_signals(scaler.stop)
    try:
        await scaler.run()
    finally:
        await backend.close()
        await bus.close()
    log.info("scaler stopped", job=args.job, scaler=scaler_id)
    return common.EXIT_OK
