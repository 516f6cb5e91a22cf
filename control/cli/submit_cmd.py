"""`rove submit`: hand a job to rove to run and scale (a managed job).

    rove submit --job j1 --nats URL --node-memory 4G -- --nnodes 1:4 --nproc-per-node 2 train.py

Everything after `--` is what every node's `rove run` gets (without --job,
--node-id and --nats, which the scaler adds). The master plans the nodes
(`--nnodes MIN:MAX`), and `rove scaler --job j1` starts them. Submitting a job
twice changes nothing: the first submission is the job's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NoReturn

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.flags import suggest
from rove.control.process import aio


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "submit",
        help="hand a job to rove's master and scaler to run and scale",
        description=__doc__,
    )
    common.add_job_arg(p)
    common.add_node_resource_args(p)
    p.add_argument(
        "--cwd", type=Path, default=None, help="the nodes' working directory (default: this one)"
    )
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="-- then `rove run` arguments")
    common.add_nats_args(p)
    p.set_defaults(func=run)


def build(args: argparse.Namespace) -> ev.Workload:
    """The workload from `rove submit`'s arguments (validated as `rove run` would)."""
    from rove.agent import managed  # torch's parser: only when submitting
    from rove.agent.run_args import build_parser, node_range, reworded
    from rove.agent.script import unrunnable

    argv = list(args.run_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise ConfigError("nothing to run: give `rove run` arguments after --, e.g. -- train.py")
    parser = build_parser()

    def refuse(message: str) -> NoReturn:  # (argparse's usage of `rove run` is 45 lines)
        said = suggest.hint(parser, reworded(message), argv)
        raise ConfigError(f"bad `rove run` arguments after --: {said}")

    parser.error = refuse  # type: ignore[method-assign]
    parsed = parser.parse_args(argv)
    head = argv[: len(argv) - len(parsed.training_script_args) - 1]
    for flag in ("--standalone", "--auto-scale", "--node-id", "--job", "--nats"):
        if any(a == flag or a.startswith(flag + "=") for a in head):
            raise ConfigError(
                f"{flag} does not belong after --: the scaler gives each node its --job, "
                "--node-id and --nats"
            )
    node_range(parsed.nnodes)
    nproc = str(parsed.nproc_per_node)
    if not (nproc.isdigit() and int(nproc) > 0) and not nproc.isidentifier():
        raise ConfigError(
            f"--nproc-per-node {nproc}: use a number of workers of at least 1, or auto, cpu "
            "or gpu (read on each node)"
        )
    cwd = (args.cwd or Path.cwd()).resolve()
    script = Path(parsed.training_script)
    why = None if parsed.module or parsed.no_python else unrunnable(cwd / script)
    if why:
        raise ConfigError(f"training script {script} {why} (in {cwd})")
    parsed.node_memory, parsed.node_cpu, parsed.policy = (
        args.node_memory,
        args.node_cpu,
        args.policy,
    )
    parsed.ps_node_memory, parsed.ps_node_cpu = args.ps_node_memory, args.ps_node_cpu
    return managed.workload(argv, parsed, str(cwd))


def run(args: argparse.Namespace) -> int:
    spec = build(args)
    return aio.run(_submit(args, spec))


async def _submit(args: argparse.Namespace, spec: ev.Workload) -> int:
    bus = await Bus.connect(
        common.bus_options(args, name="rove-submit", job=args.job, role="operator")
    )
    try:
        await bus.publish(
            ev.JobSubmitted(**ev.envelope(args.job, "cli", time.time(), "submitted"), workload=spec)
        )
    finally:
        await bus.close()
    print(
        f"submitted job {args.job}: {spec.min_nodes}-{spec.max_nodes} nodes "
        f"({spec.resources.describe()} each) running {' '.join(spec.argv)}; "
        f"start a scaler with `rove scaler --job {args.job}` and watch it with "
        f"`rove status --job {args.job}`"
    )
    return common.EXIT_OK
