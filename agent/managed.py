"""A managed job from `rove run`'s arguments: the workload every node runs (`rove submit`,
`--auto-scale`), and `rove run --standalone --auto-scale`, where an embedded NATS, a
master and a local scaler run in the launcher and every node is a `rove run` the
scaler starts (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import msgspec

from rove.agent.config import AgentConfig
from rove.agent.run_args import build_parser, node_range
from rove.control.bus import auth, embedded
from rove.control.bus.client import Bus
from rove.control.bus.options import closed
from rove.control.catalogue import events as ev
from rove.control.domain.words import counted
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.master.runner import SupervisedMaster
from rove.control.process import aio, metrics

#: `rove run` flags that belong to one node (or to the launcher), not to the workload.
_NODE_FLAGS = {
    "--nats",
    "--job",
    "--node-id",
    "--node-memory",
    "--node-cpu",
    "--ps-node-memory",
    "--ps-node-cpu",
    "--policy",
    # the launcher's: it serves the job's metrics; the scaler gives nodes credentials
    "--metrics-port",
    "--worker-nats-auth",
}
_NODE_SWITCHES = {"--standalone", "--auto-scale"}


def node_argv(argv: Sequence[str], args: argparse.Namespace) -> tuple[str, ...]:
    """The `rove run` arguments every node of a managed job gets: `argv` without the
    node's own flags, the launcher's switches and NATS credentials (the scaler adds
    `--job`, `--node-id` and `--nats`; credentials reach nodes through the environment)."""
    argv = list(argv)
    script_at = len(argv) - len(args.training_script_args) - 1
    head, tail = argv[:script_at], argv[script_at:]
    kept: list[str] = []
    skip = False
    for arg in head:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in _NODE_SWITCHES:
            continue
        if name in _NODE_FLAGS or name.startswith("--nats-"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    return (*kept, *tail)


def ps_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """The arguments of a node that hosts one parameter server: the workload's, with
    `--tf-role ps --nproc-per-node 1` after its flags (the last of a flag counts)."""

    parsed = build_parser().parse_args(list(argv))
    script_at = len(argv) - len(parsed.training_script_args) - 1
    return (*argv[:script_at], "--tf-role", "ps", "--nproc-per-node", "1", *argv[script_at:])


def ps_nodes(args: argparse.Namespace, argv: Sequence[str], lo: int) -> ev.PsNodes | None:
    """A TensorFlow job's parameter servers on nodes of their own, when
    `--ps-node-memory` or `--ps-node-cpu` sizes them (one parameter server per node)."""
    memory, cpu = getattr(args, "ps_node_memory", None), getattr(args, "ps_node_cpu", None)
    if not (memory or cpu):
        return None
    if not args.tf_ps:
        raise ConfigError(
            "--ps-node-memory and --ps-node-cpu size a TensorFlow job's "
            "parameter servers: add --tf-ps"
        )
    if lo <= args.num_ps:
        raise ConfigError(
            f"--nnodes counts the parameter servers' {counted(args.num_ps, 'node')} too: "
            f"give at least {args.num_ps + 1} "
            "(the chief and the workers need one of their own)"
        )
    return ev.PsNodes(
        count=int(args.num_ps),
        resources=ev.Resources(cpu=cpu or 0.0, memory_bytes=memory or 0),
        argv=ps_argv(argv),
    )


def policy(settings: Sequence[str]) -> ev.ScalePolicy:
    """A `ScalePolicy` from `KEY=VALUE` settings; raises ConfigError naming a bad one."""
    values: dict[str, str] = {}
    known = set(ev.ScalePolicy.__struct_fields__)
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ConfigError(
                f"--policy {item}: use KEY=VALUE with KEY one of {', '.join(sorted(known))}"
            )
        values[key] = value
    try:
        return msgspec.convert(values, ev.ScalePolicy, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--policy: {exc}") from exc


def workload(argv: Sequence[str], args: argparse.Namespace, cwd: str) -> ev.Workload:
    """What every node of a managed job runs, from `rove run`'s arguments."""
    lo, hi = node_range(args.nnodes)
    kept = node_argv(argv, args)
    return ev.Workload(
        argv=kept,
        cwd=cwd,
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1,
        resources=ev.Resources(cpu=args.node_cpu or 0.0, memory_bytes=args.node_memory or 0),
        policy=policy(args.policy),
        ps=ps_nodes(args, kept, lo),
    )


async def run_managed(args: argparse.Namespace, cfg: AgentConfig, argv: Sequence[str]) -> int:
    """`--standalone --auto-scale`: an embedded NATS, a master and a local scaler here;
    every node is a `rove run` process the scaler starts."""
    from rove.control.scaler.local import LocalBackend
    from rove.control.scaler.service import Scaler

    spec = workload(argv, args, str(Path.cwd()))
    options = common.bus_options(
        args, name=f"rove-launcher-{cfg.job}", job=cfg.job, daemon=True, allow_embedded=True
    )
    options, job_auth = closed(options, cfg.job)
    bus = await Bus.connect(options)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    runner = SupervisedMaster(
        bus, cfg.job, "launcher-master", ev.JobSpec(node_timeout_s=args.node_timeout)
    )
    backend = LocalBackend(
        bus.url,
        die_with_parent=True,
        console=True,
        node_auth=None if job_auth is None else _node_credentials(bus, job_auth),
    )
    scaler = Scaler(bus, cfg.job, backend, scaler_id="launcher")
    tasks = [
        asyncio.create_task(runner.run(), name="master"),
        asyncio.create_task(scaler.run(), name="scaler"),
    ]
    stopping = asyncio.Event()
    aio.stop_on_signals(stopping.set)
    try:
        if bus.server is not None:
            embedded.url_file(cfg.job).write_text(bus.url + "\n")
        await bus.publish(
            ev.JobSubmitted(
                **ev.envelope(cfg.job, "launcher", time.time(), "submitted"), workload=spec
            )
        )
        nodes = (
            f"{spec.min_nodes}"
            if spec.min_nodes == spec.max_nodes
            else f"{spec.min_nodes}-{spec.max_nodes}"
        ) + (" node" if spec.max_nodes == 1 else " nodes")
        print(
            f"rove: job {cfg.job} (auto-scaled, {nodes}, "
            f"{spec.resources.describe()} each), NATS {bus.url}; "
            f"watch it with: rove status --job {cfg.job}",
            file=sys.stderr,
            flush=True,
        )
        stop = asyncio.create_task(stopping.wait())
        await asyncio.wait([tasks[1], stop], return_when=asyncio.FIRST_COMPLETED)
        if stopping.is_set() and not scaler.state.phase.terminal:
            await bus.publish(
                ev.StopRequested(
                    **ev.envelope(cfg.job, "launcher", time.time(), "stop"), reason="interrupted"
                )
            )
            await tasks[1]
        stop.cancel()
        state = scaler.state
        print(f"rove: job {state.phase.value}: {state.end_reason}", file=sys.stderr, flush=True)
        return 0 if state.phase is ev.JobPhase.FINISHED else 1
    finally:
        runner.stop()
        scaler.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await backend.close()
        if bus.server is not None:
            embedded.url_file(cfg.job).unlink(missing_ok=True)
        await bus.close()


def _node_credentials(
    bus: Bus, job_auth: auth.JobAuth
) -> Callable[[str, str], Awaitable[list[str]]]:
    """Each node of a closed auto-scaled job gets its own agent credentials (it may
    write only its own facts), added to the embedded server before the node starts;
    its workers get the job's trainer credentials."""

    async def make(job: str, node: str) -> list[str]:
        path, _config = auth.add_agent(job_auth.config.parent, job, node)
        assert bus.server is not None
        await asyncio.to_thread(bus.server.reload)
        return ["--nats-auth", str(path), "--worker-nats-auth", str(job_auth.trainer)]

    return make
