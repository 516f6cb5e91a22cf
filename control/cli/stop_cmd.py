"""`rove stop`: ask a job to stop; the leading master ends it with phase `stopped`."""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
import time
import uuid

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.flags import options as common
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stop", help="ask a job to stop", description=__doc__)
    common.add_job_arg(p)
    p.add_argument("--reason", default="", help="recorded with the request")
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return aio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    options = common.bus_options(args, name="rove-stop", job=args.job, role="operator")
    who = f"{getpass.getuser()}@{socket.gethostname()}"
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job):
            raise common.no_such_job(bus, args.job)
        event = ev.StopRequested(
            **ev.envelope(args.job, f"cli:{who}", time.time(), "stop", uuid.uuid4().hex),
            reason=args.reason or f"requested by {who}",
        )
        seq = await bus.publish(event)
    sys.stdout.write(
        f"stop of job {args.job} requested (event #{seq}); the leading master ends it\n"
    )
    return common.EXIT_OK
