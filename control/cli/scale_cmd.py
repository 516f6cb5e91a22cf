"""`rove scale`: set a job's node bounds; a managed job's master plans toward them.

    rove scale --job j1 --nnodes 2:8     rounds take 2 to 8 nodes from now on
    rove scale --job j1 --nnodes 4       exactly 4

The running round goes on. Rounds formed from now on take between MIN and MAX
nodes; in a managed job (`rove submit`, `rove run --auto-scale`, a RoveJob) the
master starts nodes up to MIN and stops the newest down to MAX. A job of plain
`rove run` nodes gets no new nodes: start them yourself.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid

from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "scale",
        help="set a job's node bounds (MIN:MAX nodes)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common.add_job_arg(p)
    p.add_argument("--nnodes", required=True, metavar="MIN[:MAX]", help="the new bounds")
    p.add_argument("--reason", default="", help="recorded with the request")
    common.add_nats_args(p)
    p.set_defaults(func=run)


def bounds(text: str) -> tuple[int, int]:
    """'2:8' -> (2, 8), '4' -> (4, 4); `ConfigError` for anything else."""
    low, _, high = text.partition(":")
    try:
        lo, hi = int(low), int(high or low)
    except ValueError:
        lo = hi = 0
    if not 1 <= lo <= hi:
        raise ConfigError(f"--nnodes {text!r}: give MIN or MIN:MAX, 1 <= MIN <= MAX")
    return lo, hi


def run(args: argparse.Namespace) -> int:
    lo, hi = bounds(args.nnodes)
    return aio.run(_run(args, lo, hi))


async def _run(args: argparse.Namespace, lo: int, hi: int) -> int:
    def scale(who: str) -> ev.ScaleRequested:
        return ev.ScaleRequested(
            **ev.envelope(args.job, f"cli:{who}", time.time(), "scale", uuid.uuid4().hex),
            min_nodes=lo,
            max_nodes=hi,
            reason=args.reason or f"requested by {who}",
        )

    seq = await common.publish_command(args, "rove-scale", scale)
    sys.stdout.write(
        f"job {args.job}: {lo}-{hi} nodes requested (event #{seq}); rounds formed from now "
        "on take that many, and a managed job's master starts or stops nodes to match\n"
    )
    return common.EXIT_OK
