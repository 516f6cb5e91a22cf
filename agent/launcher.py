"""`rove run`: a drop-in for `torchrun` whose jobs survive failures.

It accepts torchrun's flags (torch's own parser, extended with rove's) and gives
workers the environment torchrun gives them. Rendezvous, restarts and failure
handling go through rove's event-sourced master instead of a c10d store.

    rove run --standalone --nproc-per-node 2 train.py          # one machine, one command
    rove run --nats nats://h:4222 --job j1 --nnodes 1:4 --node-id n1 --nproc-per-node 8 train.py

`--standalone` starts an embedded NATS server and a master in this process.
Otherwise masters run separately (`rove master --job J --nats URL`, as many as
you like) and every node's `rove run` points at the same NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from rove.agent import child, managed, warm
from rove.agent.agent import Agent, AgentConfig
from rove.control import aio, auth, embedded, logs, metrics, subjects, tf_cluster
from rove.control import events as ev
from rove.control import options as common
from rove.control.bus import Bus
from rove.control.bus_options import closed
from rove.control.errors import ConfigError
from rove.control.master.runner import SupervisedMaster

if TYPE_CHECKING:
    from rove.control.kafka_bridge import KafkaBridge

log = structlog.get_logger("rove.run")

#: A worker quiet this long after it or a peer returned is stuck (`--hang-timeout` sets it).
EXIT_TIMEOUT_S = 60.0


#: torchrun's flags whose meaning under rove differs from torchrun's: rove's help text.
_RETOLD = {
    "nnodes": "number of nodes N, or MIN:MAX: a round forms at once with MAX nodes, or with "
    "MIN after --last-call-timeout; nodes that come later join the next round (with "
    "--standalone: 1)",
    "standalone": "one machine, one command: start an embedded NATS JetStream server and a "
    "rove master in this process (no --nats needed)",
    "rdzv_id": "default job name when --job is not given",
    "max_restarts": "restarts (new rounds after a worker failure) before the job fails "
    "(default 0, as torchrun); the same user error twice fails the job at once",
    "start_method": "with --no-warm-start, how fresh worker interpreters are started "
    "(default spawn); warm workers are forked from the warm server",
    "shutdown_timeout": "seconds workers get to exit after SIGTERM before SIGKILL (default 10)",
    "local_addr": "this node's address, advertised to the other nodes (default: the host's "
    "address; 127.0.0.1 with --standalone)",
}

#: torchrun's flags that rove accepts, so torchrun command lines keep working, and
#: ignores: why. A run that sets one gets a warning naming it.
IGNORED = {
    "rdzv_backend": "rove's rendezvous goes through its master on NATS (--nats)",
    "rdzv_endpoint": "rove's rendezvous goes through its master on NATS (--nats)",
    "rdzv_conf": "rendezvous settings are rove's own flags (--last-call-timeout, "
    "--below-min-timeout)",
    "monitor_interval": "the agent waits on the workers' process exits",
    "event_log_handler": "rove records every event on NATS (see `rove events`)",
    "node_rank": "rove gives group ranks in the order nodes joined the round",
    "master_addr": "rove takes each round's store address from the round's first node",
    "master_port": "rove gives each round a fresh free port (MASTER_PORT)",
    "numa_binding": "not supported by rove yet",
    "signals_to_handle": "the agent handles SIGTERM and SIGINT itself",
    "duplicate_stdout_filters": "not supported by rove yet",
    "duplicate_stderr_filters": "not supported by rove yet",
    "virtual_local_rank": "not supported by rove yet",
}


def _retell_torchrun_flags(p: argparse.ArgumentParser) -> None:
    for action in p._actions:
        if action.dest in _RETOLD:
            action.help = _RETOLD[action.dest]
        elif action.dest in IGNORED:
            action.help = f"ignored by rove: {IGNORED[action.dest]}"


def warn_ignored(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Warn about each ignored torchrun flag set on the command line; returns their names."""
    named = []
    for dest, why in IGNORED.items():
        if getattr(args, dest, None) not in (None, parser.get_default(dest)):
            flag = "--" + dest.replace("_", "-")
            log.warning(f"{flag} is ignored: {why}")
            named.append(flag)
    return named


def build_parser() -> argparse.ArgumentParser:
    p = get_args_parser()
    p.prog = "rove run"
    p.description = __doc__.split("\n\n")[0] if __doc__ else None
    _retell_torchrun_flags(p)
    g = p.add_argument_group("rove")
    g.add_argument(
        "--job",
        default=os.environ.get("ROVE_JOB"),
        help="job name (env ROVE_JOB); default: --rdzv-id, else <script>-<random>",
    )
    g.add_argument(
        "--node-id",
        default=os.environ.get("ROVE_NODE_ID"),
        help="this node's id (env ROVE_NODE_ID; default: the host name). Several "
        "`rove run` on one machine need distinct ids",
    )
    g.add_argument(
        "--node-unit",
        type=int,
        default=1,
        help="the number of nodes in a round is a multiple of this",
    )
    g.add_argument(
        "--network-check",
        action="store_true",
        help="time a matmul and an allreduce in node pairs before training",
    )
    g.add_argument(
        "--network-check-timeout",
        type=common.positive,
        default=120.0,
        metavar="SECONDS",
        help="a network-check group that takes longer has failed (default 120)",
    )
    g.add_argument(
        "--exclude-straggler",
        action="store_true",
        help="with --network-check, exclude nodes slower than 2x the median",
    )
    g.add_argument(
        "--checkpoint-dir",
        default=os.environ.get("ROVE_CKPT_DIR"),
        help="persist flash checkpoints here (env ROVE_CKPT_DIR); without it they stay in memory",
    )
    g.add_argument(
        "--persist-every",
        type=int,
        default=1,
        metavar="STEPS",
        help="persist every STEPS-th in-memory step to --checkpoint-dir (default 1: each one); "
        "memory still holds every save, and --save-at-breakpoint persists the newest on failure",
    )
    g.add_argument(
        "--keep-checkpoints", type=int, default=3, help="committed steps kept on storage (3)"
    )
    g.add_argument(
        "--save-at-breakpoint",
        action="store_true",
        help="persist the newest in-memory checkpoint when a worker fails",
    )
    g.add_argument(
        "--auto-config",
        action="store_true",
        help="nnodes from $NODE_NUM, nproc-per-node from the accelerators found",
    )
    g.add_argument(
        "--accelerator",
        default="auto",
        choices=["auto", "cpu", "nvidia.com/gpu"],
        help="what the workers run on (default: detected)",
    )
    common.add_metrics_arg(g)
    g.add_argument(
        "--worker-nats-auth",
        metavar="FILE",
        default=os.environ.get("ROVE_WORKER_NATS_AUTH"),
        help="the workers' own credentials (a trainer role's file from `rove auth init`), "
        "which their data clients publish with; default: the agent's (env "
        "ROVE_WORKER_NATS_AUTH)",
    )
    g.add_argument(
        "--hang-timeout",
        type=common.positive,
        default=None,
        metavar="SECONDS",
        help="a worker with no step progress (rove.agent.progress.report) for this "
        "long is hung and restarted (default: off); also how long a worker may stay "
        "quiet (no CPU, I/O or step) after it or a peer returned from its script before "
        "it is ended as stuck (default 60)",
    )
    g.add_argument(
        "--last-call-timeout",
        type=common.positive,
        default=5.0,
        metavar="SECONDS",
        help="once --nnodes MIN nodes are there, wait this long for more (default 5)",
    )
    g.add_argument(
        "--below-min-timeout",
        type=common.positive,
        default=300.0,
        metavar="SECONDS",
        help="below MIN nodes, wait this long for nodes before failing (default 300)",
    )
    g.add_argument(
        "--node-timeout",
        type=common.positive,
        default=30.0,
        metavar="SECONDS",
        help="standalone master: a node silent this long is lost (default 30)",
    )
    g.add_argument(
        "--heartbeat-interval",
        type=common.positive,
        default=1.0,
        metavar="SECONDS",
        help="seconds between heartbeats (default 1)",
    )
    g.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork workers from a server that imported torch once, so a restart skips "
        "interpreter start and imports (default: on); --no-warm-start starts every "
        "worker as a fresh interpreter, as torchrun does (see docs/runtime.md)",
    )
    g.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="with warm start, also import MODULE once in the warm server (repeatable), "
        "e.g. --preload transformers",
    )
    k = p.add_argument_group("streaming from Kafka (see docs/streaming.md)")
    k.add_argument(
        "--kafka-bootstrap",
        metavar="SERVERS",
        help="the Kafka brokers (host:port,...) the job streams from: its workers find them "
        "in ROVE_KAFKA_BOOTSTRAP; with --standalone a Kafka bridge also runs in this process",
    )
    k.add_argument(
        "--kafka-topic",
        metavar="TOPIC",
        help="the topic to stream (ROVE_KAFKA_TOPIC in the workers; required with "
        "--kafka-bootstrap)",
    )
    k.add_argument(
        "--kafka-group",
        default="",
        metavar="GROUP",
        help="with --standalone: mirror each committed checkpoint's offsets to this consumer "
        "group (for lag dashboards)",
    )
    k.add_argument(
        "--kafka-shard-records",
        type=int,
        default=256,
        metavar="N",
        help="with --standalone: records per stream shard the bridge cuts (default 256)",
    )
    t = p.add_argument_group(
        "TensorFlow parameter-server jobs (see docs/tensorflow.md): the script is the "
        "coordinator (chief); rove runs the parameter servers and workers"
    )
    t.add_argument(
        "--tf-ps",
        action="store_true",
        help="run a TF2 ParameterServerStrategy job: rank 0 runs the script as the chief, the "
        "next --num-ps ranks are parameter servers, the rest are workers (each with TF_CONFIG)",
    )
    t.add_argument(
        "--num-ps", type=int, default=1, metavar="P", help="parameter servers (default 1)"
    )
    t.add_argument(
        "--num-workers",
        type=int,
        metavar="W",
        help="with --standalone: W workers, so 1 + P + W processes (sets --nproc-per-node)",
    )
    a = p.add_argument_group("auto-scaling (a managed job: see docs/scaling.md)")
    a.add_argument(
        "--auto-scale",
        action="store_true",
        help="with --standalone: rove starts, replaces and resizes the job's nodes itself, as "
        "local processes within --nnodes MIN:MAX (a master and a scaler run in this process)",
    )
    common.add_node_resource_args(a)
    common.add_nats_args(p)
    return p


def _job_name(args: argparse.Namespace) -> str:
    if args.job:
        return subjects.check_name("job", args.job)
    if args.rdzv_id and args.rdzv_id != "none":
        return subjects.check_name("job", args.rdzv_id)
    stem = Path(args.training_script).stem.replace(".", "-")[:40] or "job"
    return subjects.check_name("job", f"{stem}-{uuid.uuid4().hex[:6]}")


def _addr(args: argparse.Namespace, standalone: bool) -> str:
    if args.local_addr:
        return str(args.local_addr)
    if standalone:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _auto_config(args: argparse.Namespace) -> None:
    if not args.auto_config:
        return
    if os.environ.get("NODE_NUM"):
        args.nnodes = os.environ["NODE_NUM"]
    import torch

    gpus = torch.cuda.device_count()
    args.nproc_per_node = str(gpus) if gpus else args.nproc_per_node
    max_nodes = int(str(args.nnodes).split(":")[-1])
    if max_nodes >= 4:
        args.network_check = True


#: Numeric flags and the least each may be (an out-of-range one is refused at once).
_AT_LEAST = (
    ("node_unit", 1),
    ("max_restarts", 0),
    ("persist_every", 1),
    ("keep_checkpoints", 1),
    ("shutdown_timeout", 0),
    ("monitor_interval", 0),
)


def _check_ranges(args: argparse.Namespace) -> None:
    for dest, least in _AT_LEAST:
        value = getattr(args, dest, None)
        if value is not None and value < least:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be at least {least}, got {value:g}")


def agent_config(args: argparse.Namespace) -> tuple[AgentConfig, bool]:
    """The agent's configuration from parsed arguments; raises ConfigError for bad ones."""
    _auto_config(args)
    _check_ranges(args)
    standalone = bool(args.standalone)
    try:
        lo, hi = parse_min_max_nnodes(str(args.nnodes))
    except ValueError as exc:
        raise ConfigError(f"--nnodes {args.nnodes}: use N or MIN:MAX ({exc})") from exc
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {args.nnodes}: need 0 < MIN <= MAX")
    if args.auto_scale and not standalone:
        raise ConfigError(
            "--auto-scale runs a master and a scaler in this process, with --standalone; on a "
            "shared NATS, submit the job with `rove submit` and run `rove scaler` (docs/scaling.md)"
        )
    if standalone and (lo, hi) != (1, 1) and not args.auto_scale:
        raise ConfigError(
            f"--standalone runs a one-node job with its own NATS server, but --nnodes is "
            f"{args.nnodes}: drop --nnodes, or run every node with --nats URL (docs/runtime.md)"
        )
    tf_ps = _tf_ps(args, standalone)
    script = Path(args.training_script)
    if args.run_path and (args.module or args.no_python):
        raise ConfigError("--run-path runs a script file: it cannot go with -m or --no-python")
    if not (args.module or args.no_python) and not script.is_file():
        raise ConfigError(f"training script {args.training_script} not found")
    nproc_error = ConfigError(
        f"--nproc-per-node must be a number of at least 1, or auto, cpu or gpu; "
        f"got {args.nproc_per_node}"
    )
    try:
        launch, cmd, cmd_args = config_from_args(args)
    except ValueError as exc:
        if "nproc_per_node" in str(exc):
            raise nproc_error from exc
        raise
    if launch.nproc_per_node < 1:
        raise nproc_error
    if launch.min_nodes > launch.max_nodes:
        raise ConfigError(f"--nnodes {args.nnodes}: MIN is larger than MAX")
    if launch.max_nodes < args.node_unit:
        raise ConfigError(f"--nnodes max {launch.max_nodes} is smaller than --node-unit")
    job = _job_name(args)
    node = subjects.check_name("node", args.node_id or socket.gethostname().split(".")[0])
    logs_specs = launch.logs_specs
    if args.logs_specs is None and args.redirects in (None, "0") and args.tee in (None, "0"):
        # Keep stderr on the console (with torch's [rank] prefix) and in a file,
        # so a failure can be diagnosed from its last lines.
        logs_specs = DefaultLogsSpecs(
            log_dir=args.log_dir,
            redirects=Std.NONE,
            tee=Std.ERR,
            local_ranks_filter=getattr(logs_specs, "_local_ranks_filter", None),
        )
    params = ev.RdzvParams(
        min_nodes=launch.min_nodes,
        max_nodes=launch.max_nodes,
        node_unit=args.node_unit,
        max_restarts=launch.max_restarts,
        last_call_s=args.last_call_timeout,
        below_min_wait_s=args.below_min_timeout,
        network_check=bool(args.network_check),
        exclude_stragglers=bool(args.exclude_straggler),
        network_check_timeout_s=args.network_check_timeout,
        tf_ps=tf_ps,
    )
    if tf_ps:
        problem = tf_cluster.problem(launch.max_nodes * launch.nproc_per_node, tf_ps)
        if problem is not None:
            raise ConfigError(f"--tf-ps: {problem}")
    warm_start = bool(args.warm_start) and not args.no_python
    if warm_start:
        # Forked from the warm server (see rove.agent.warm).
        entrypoint: str | Callable[..., None] = warm.run_script
        worker_args = list(warm.entry_args([str(a) for a in cmd_args]))
        start_method = "forkserver"
    elif args.run_path:
        # torchrun's --run-path: the script runs in a multiprocessing child, no new command
        entrypoint = warm.run_script
        worker_args = list(warm.entry_args([str(a) for a in cmd_args]))
        start_method = launch.start_method
    elif not args.no_python and str(cmd) == sys.executable:
        # A fresh interpreter that runs the script through rove.agent.child: it dies with
        # its agent, holds its process groups and ends as an interpreter does (see there)
        entrypoint = sys.executable
        worker_args = ["-u", "-m", "rove.agent.child", child.RUN]
        worker_args += warm.entry_args([str(a) for a in cmd_args])
        start_method = launch.start_method
    else:
        # Another interpreter (PYTHON_EXEC) or --no-python: exec'd through
        # rove.agent.child, so the worker still dies with its agent
        entrypoint = sys.executable
        worker_args = ["-m", "rove.agent.child", str(cmd), *(str(a) for a in cmd_args)]
        start_method = launch.start_method
    cfg = AgentConfig(
        job=job,
        node=node,
        addr=_addr(args, standalone),
        nproc=launch.nproc_per_node,
        params=params,
        entrypoint=entrypoint,
        args=worker_args,
        preload=tuple(args.preload) if warm_start else (),
        logs_specs=logs_specs,
        state_dir=embedded.job_dir(job) / "agents" / node,
        max_restarts=launch.max_restarts,
        role=launch.role,
        heartbeat_s=args.heartbeat_interval,
        hang_timeout_s=args.hang_timeout or 0.0,
        exit_timeout_s=args.hang_timeout or EXIT_TIMEOUT_S,
        stop_timeout_s=float(args.shutdown_timeout) if args.shutdown_timeout else 10.0,
        start_method=start_method,
        checkpoint_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        save_at_breakpoint=bool(args.save_at_breakpoint),
        keep_checkpoints=args.keep_checkpoints,
        persist_every=args.persist_every,
        worker_env=_kafka_env(args),
        log_dir=Path(args.log_dir) if args.log_dir else None,
        worker_auth=_worker_auth(args.worker_nats_auth),
    )
    return cfg, standalone


def _worker_auth(path: str | None) -> Path | None:
    if not path:
        return None
    try:
        role = auth.read(path).role
    except ValueError as exc:
        raise ConfigError(f"--worker-nats-auth: {exc}") from exc
    if role not in ("trainer", "admin"):
        raise ConfigError(
            f"--worker-nats-auth {path} holds the {role} role's credentials; the workers' "
            "data clients need the trainer role's (`rove auth init` writes trainer.json)"
        )
    return Path(path)


def _tf_ps(args: argparse.Namespace, standalone: bool) -> int:
    """Parameter servers of a TensorFlow job (0: not one); sets --nproc-per-node from
    --num-workers on one machine."""
    if not args.tf_ps:
        if args.num_workers is not None:
            raise ConfigError("--num-workers is for a TensorFlow job: add --tf-ps")
        return 0
    if args.num_ps < 1:
        raise ConfigError(f"--num-ps must be at least 1, got {args.num_ps}")
    if args.run_path or args.module or args.no_python:
        raise ConfigError(
            "--tf-ps runs the script as the chief with python: it cannot go with "
            "--run-path, -m or --no-python"
        )
    args.warm_start = False  # a torch forkserver: TensorFlow tasks start their own
    if args.num_workers is not None:
        if args.num_workers < 1:
            raise ConfigError(f"--num-workers must be at least 1, got {args.num_workers}")
        if not standalone:
            raise ConfigError(
                "--num-workers sizes a one-machine job (--standalone); across nodes the "
                "workers are the processes left after the chief and the parameter servers"
            )
        args.nproc_per_node = str(1 + args.num_ps + args.num_workers)
    return int(args.num_ps)


def _kafka_env(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    if bool(args.kafka_bootstrap) != bool(args.kafka_topic):
        raise ConfigError(
            "--kafka-bootstrap and --kafka-topic go together: name the brokers and the topic"
        )
    if args.kafka_shard_records < 1:
        raise ConfigError(
            f"--kafka-shard-records must be at least 1, got {args.kafka_shard_records}"
        )
    if not args.kafka_bootstrap:
        return ()
    subjects.check_name("dataset", args.kafka_topic)
    return (("ROVE_KAFKA_BOOTSTRAP", args.kafka_bootstrap), ("ROVE_KAFKA_TOPIC", args.kafka_topic))


async def _run(args: argparse.Namespace, cfg: AgentConfig, standalone: bool) -> int:
    if not args.nats and not standalone:
        raise ConfigError(
            "no NATS server to meet the other nodes on: pass --nats URL (or set "
            "ROVE_NATS_URL), or --standalone for a one-machine job with its own server and master"
        )
    # SIGINT and SIGTERM for the whole run: the first stops the job's workers (with the
    # same signal) and leaves cleanly, a second one ends everything at once
    signals = aio.StopSignals()
    signals.install()
    options = common.bus_options(
        args,
        name=f"rove-agent-{cfg.node}",
        job=cfg.job,
        daemon=True,
        allow_embedded=standalone,
    )
    options, job_auth = closed(options, cfg.job, cfg.node)
    if job_auth is not None:
        cfg = dataclasses.replace(cfg, worker_auth=job_auth.trainer)
    bus = await Bus.connect(options)
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    master_task = bridge_task = None
    runner: SupervisedMaster | None = None
    bridge: KafkaBridge | None = None
    try:
        if bus.server is not None:
            embedded.url_file(cfg.job).write_text(bus.url + "\n")
        if standalone:
            runner = SupervisedMaster(
                bus, cfg.job, f"{cfg.node}-master", ev.JobSpec(node_timeout_s=args.node_timeout)
            )
            master_task = asyncio.create_task(runner.run(), name="master")
            if args.kafka_bootstrap:
                bridge = _bridge(bus, cfg, args)
                bridge_task = asyncio.create_task(_serve(bridge), name="kafka bridge")
        print(
            f"rove: job {cfg.job}, node {cfg.node}, NATS {bus.url}; "
            f"watch it with: rove status --job {cfg.job}",
            file=sys.stderr,
            flush=True,
        )
        agent = Agent(bus, cfg, signals=signals)
        code = await agent.run()
        print(f"rove: {agent.status.end_reason}", file=sys.stderr, flush=True)
        return code
    finally:
        if bridge is not None and bridge_task is not None:
            bridge.stop()
            await asyncio.gather(bridge_task, return_exceptions=True)
        if runner is not None and master_task is not None:
            await asyncio.sleep(0.3)  # let the master fold the agent's last facts
            runner.stop()
            await asyncio.gather(master_task, return_exceptions=True)
        if bus.server is not None:
            embedded.url_file(cfg.job).unlink(missing_ok=True)
        await bus.close()


def _bridge(bus: Bus, cfg: AgentConfig, args: argparse.Namespace) -> KafkaBridge:
    """The standalone job's Kafka bridge (`rove kafka-bridge`, in this process)."""
    from rove.control.kafka_bridge import BrokerReader, KafkaBridge

    return KafkaBridge(
        bus,
        cfg.job,
        BrokerReader(args.kafka_bootstrap, args.kafka_topic, group=args.kafka_group),
        dataset=args.kafka_topic,
        bridge_id=f"{cfg.node}-bridge",
        shard_records=args.kafka_shard_records,
    )


async def _serve(bridge: KafkaBridge) -> None:
    """Run the bridge; if it fails (brokers unreachable past the deadline, no such
    topic), the job cannot get data: stop it, saying why."""
    try:
        await bridge.run()
    except Exception as exc:  # noqa: BLE001 - any failure of the bridge ends the job
        reason = f"the Kafka bridge failed: {exc}"
        print(f"rove: {reason}", file=sys.stderr, flush=True)
        await bridge.bus.publish(
            ev.StopRequested(
                **ev.envelope(bridge.job, bridge.bridge_id, time.time(), "stop"), reason=reason
            )
        )
    finally:
        bridge.reader.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    logs.configure()

    def run() -> int:
        warn_ignored(args, parser)
        try:
            cfg, standalone = agent_config(args)
        except ValueError as exc:  # torch's config_from_args: bad --nnodes / --nproc-per-node
            raise ConfigError(str(exc)) from exc
        if args.auto_scale:
            raw = list(argv) if argv is not None else sys.argv[1:]
            return aio.run(managed.run_managed(args, cfg, raw))
        return aio.run(_run(args, cfg, standalone))

    return common.run_reporting("rove run", run)


if __name__ == "__main__":
    sys.exit(main())
