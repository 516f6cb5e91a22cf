"""`rove agent --pool P`: a long-lived node agent that scalers assign to jobs.

Run one per machine (the Kubernetes DaemonSet does): it waits idle in pool P
until a scaler (`rove scaler --backend pool --pool P`) assigns it a node of a
job, runs that node as `rove run` would, and comes back to the pool when the
node ends. A replacement node then starts in seconds on a machine that is
already there. See docs/scaling.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rove.control.bus.client import Bus
from rove.control.catalogue import subjects
from rove.control.flags import options as common
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "agent", help="a pool agent (daemon) that scalers assign to jobs", description=__doc__
    )
    p.add_argument("--pool", required=True, help="the pool to join, e.g. default")
    p.add_argument("--id", dest="agent_id", help="this agent's id (default: host-pid)")
    p.add_argument(
        "--memory",
        type=common.byte_size,
        default=0,
        metavar="SIZE",
        help="memory this agent offers to a node (default: the machine's limit)",
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where node logs go (default ~/.rove/jobs/<job>/scaler)",
    )
    p.add_argument(
        "--no-standby",
        dest="standby",
        action="store_false",
        help="start each node as a new process (default: keep one ready while idle, "
        "torch imported and its warm server started, so a node assigned trains sooner)",
    )
    common.add_nats_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    subjects.check_name("pool", args.pool)
    agent_id = args.agent_id or common.process_id()
    subjects.check_name("agent", agent_id)
    return aio.run(_run(args, agent_id), watch=f"agent {agent_id}")


async def _run(args: argparse.Namespace, agent_id: str) -> int:
    from rove.agent.daemon import PoolDaemon

    options = common.bus_options(args, name=f"rove-agent-{agent_id}", daemon=True)
    starting = aio.Starting(f"pool agent {agent_id}")
    bus = await starting.wait(Bus.connect(options))
    daemon = PoolDaemon(
        bus,
        args.pool,
        agent_id,
        memory_bytes=args.memory,
        state_dir=args.state_dir,
        standby=args.standby,
    )
    starting.started(daemon.stop)
    try:
        await daemon.run()
    finally:
        await bus.close()
    return common.EXIT_OK
