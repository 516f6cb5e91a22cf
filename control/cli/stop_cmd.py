"""`rove stop`: ask a job to stop; the leading master ends it with phase `stopped`."""

from __future__ import annotations

import argparse
import sys
import time
import uuid

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
    def stop(who: str) -> ev.StopRequested:
        return ev.StopRequested(
            **ev.envelope(args.job, f"cli:{who}", time.time(), "stop", uuid.uuid4().hex),
            reason=args.reason or f"requested by {who}",
        )

    seq = await common.publish_command(args, "rove-stop", stop)
    sys.stdout.write(
        f"stop of job {args.job} requested (event #{seq}); the leading master ends it\n"
    )
    return common.EXIT_OK
