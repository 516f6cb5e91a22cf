"""`rove run`: a drop-in for `torchrun` whose jobs survive failures.

It accepts torchrun's flags (torchrun's parser, `rove.agent.torchrun_cli`, extended
with rove's; no torch is imported here) and gives workers the environment torchrun
gives them. Rendezvous, restarts and failure handling go through rove's
event-sourced master instead of a c10d store.

    rove run --standalone --nproc-per-node 2 train.py          # one machine, one command
    rove run --nats nats://h:4222 --job j1 --nnodes 1:4 --node-id n1 --nproc-per-node 8 train.py

`--standalone` starts an embedded NATS server and a master in this process.
Otherwise masters run separately (`rove master --job J --nats URL`, as many as
you like) and every node's `rove run` points at the same NATS.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import structlog

from rove.agent import child, endings, faults, forkservers, managed, run_checks, warm
from rove.agent.agent import Agent
from rove.agent.config import AgentConfig
from rove.agent.echo import MAX_BYTES_DEFAULT, EchoedLogs
from rove.agent.heartbeat import HEARTBEATS_PER_S, interval_for
from rove.agent.run_args import build_parser, launch_config, node_range, reworded, warn_ignored
from rove.agent.script import refused
from rove.control.bus import auth, embedded, stored
from rove.control.bus.client import Bus
from rove.control.bus.options import closed
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain import tf_cluster
from rove.control.errors import ConfigError
from rove.control.flags import options as common
from rove.control.flags import suggest
from rove.control.history import joblogs, jobs
from rove.control.master.runner import SupervisedMaster
from rove.control.process import aio, logs, metrics
from rove.control.process.folders import unwritable

if TYPE_CHECKING:
    from rove.control.services.kafka_bridge import KafkaBridge

log = structlog.get_logger("rove.run")

#: A worker quiet this long after it or a peer returned is stuck (`--hang-timeout` sets it).
EXIT_TIMEOUT_S = 60.0


def _job_name(args: argparse.Namespace) -> str:
    if args.job:
        return subjects.check_name("job", args.job)
    if args.rdzv_id and args.rdzv_id != "none":
        # torchrun takes any id; rove's names are subject tokens: an id that is not one
        # names the job after it, alike on every node (`--job` is checked as given)
        name = subjects.name_from(args.rdzv_id)
        if name != args.rdzv_id:
            say(
                f"job name {name}, made of --rdzv-id {args.rdzv_id!r} (a job name holds "
                "at most 64 letters, digits, '-' or '_'; use it with rove status, or set --job)"
            )
        return name
    # (a module's dotted name whole: `-m pkg.train` was named `pkg`, a suffix dropped)
    named = args.training_script if args.module else Path(args.training_script).stem
    stem = subjects.cleaned(named)[:40].rstrip("-_") or "job"
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


def agent_config(args: argparse.Namespace) -> tuple[AgentConfig, bool]:
    """The agent's configuration from parsed arguments; raises ConfigError for bad ones."""
    run_checks.environment(os.environ)
    run_checks.auto_config(args)
    run_checks.check_ranges(args)
    run_checks.absolute_paths(args)
    args.stop_signals = run_checks.stop_signals(args.signals_to_handle)
    if args.checkpoint_dir:
        run_checks.check_storage(args.checkpoint_dir)
    embedded.check_home()
    if args.log_dir and (why := unwritable(Path(args.log_dir))):
        raise ConfigError(f"--log-dir {args.log_dir}: {why}; give a folder this user can write")
    standalone = bool(args.standalone)
    lo, hi = node_range(args.nnodes)
    if not standalone and not args.nats and hi == 1 and not args.auto_scale:
        # torchrun's one-node command lines (no rendezvous flags, a static --master-addr,
        # a c10d endpoint): one machine, so rove's embedded default serves it
        standalone = args.standalone = True
        args.standalone_implied = True  # said once the whole command line is checked
    elif (
        not standalone
        and not args.nats
        and not args.auto_scale
        and lo == 1
        and run_checks.on_loopback(args.rdzv_endpoint)
    ):
        # torch elastic's one-machine line (`--nnodes 1:4 --rdzv-backend c10d
        # --rdzv-endpoint localhost:29400`): no other machine can reach its rendezvous,
        # so every node is this one, and rove's embedded default serves it
        args.elastic_alone = f"--nnodes {args.nnodes} with its rendezvous at {args.rdzv_endpoint}"
        standalone = args.standalone = True
        args.nnodes, (lo, hi) = "1", (1, 1)
    if not args.nats and not standalone and not args.auto_scale:
        # (refused before the job's folder is made: a refused command leaves nothing)
        raise ConfigError(
            f"--nnodes {args.nnodes}: the nodes meet on a NATS server, and none was given: add "
            "--nats nats://HOST:4222 (or set ROVE_NATS_URL) on every node, with a "
            "`rove master --job J --nats ...` beside them (docs/runtime.md, 'Several nodes')"
        )
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
    if args.run_path and (args.module or args.no_python):
        raise ConfigError("--run-path runs a script file: it cannot go with -m or --no-python")
    if why := refused(args.training_script, module=args.module, no_python=args.no_python):
        raise ConfigError(why)
    launch, cmd, cmd_args = launch_config(args)
    job = _job_name(args)
    node = subjects.check_name("node", args.node_id or socket.gethostname().split(".")[0])
    logs_specs = launch.torch_logs
    node_logs = (Path(args.log_dir) / job if args.log_dir else joblogs.folder(job)) / node
    if logs_specs is None:
        # the workers' output on the console byte for byte, as under torchrun, and kept
        # in the job's folder: a failure is diagnosed from it, `rove logs` reads it
        # (rove.agent.echo)
        logs_specs = EchoedLogs(
            node_logs,
            launch.console_ranks,
            max_bytes=_log_max_bytes(),
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
    if tf_ps and args.tf_role != "ps":  # (a node of parameter servers only is one part)
        problem = tf_cluster.problem(launch.max_nodes * launch.nproc_per_node, tf_ps)
        if problem is not None:
            raise ConfigError(f"--tf-ps: {problem}")
    warm_start = bool(args.warm_start) and not args.no_python
    if not warm_start:
        forkservers.stop()  # one `rove run` started early, reading its arguments roughly
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
        learn_imports=bool(args.learn_imports),
        tf_spares=bool(getattr(args, "tf_spares", False)),
        tf_role="" if args.tf_role == "any" else args.tf_role,
        logs_specs=logs_specs,
        state_dir=embedded.job_dir(job) / "agents" / node,
        max_restarts=launch.max_restarts,
        max_task_restarts=args.max_worker_restarts,
        role=launch.role,
        heartbeat_s=_heartbeat_interval(args, params.max_nodes),
        hang_timeout_s=args.hang_timeout or 0.0,
        faults=_faults(args.inject_fault),
        exit_timeout_s=args.hang_timeout or EXIT_TIMEOUT_S,
        stop_timeout_s=run_checks.shutdown_timeout(args),
        start_method=start_method,
        checkpoint_dir=args.checkpoint_dir or None,
        save_at_breakpoint=bool(args.save_at_breakpoint),
        keep_checkpoints=args.keep_checkpoints,
        persist_every=args.persist_every,
        replicas=args.peer_replicas,
        replica_budget=args.peer_memory << 20,
        failure_domain=args.failure_domain,
        worker_env=_kafka_env(args),
        log_dir=node_logs,
        worker_auth=_worker_auth(args.worker_nats_auth),
    )
    return cfg, standalone


def _heartbeat_interval(args: argparse.Namespace, max_nodes: int) -> float:
    """`--heartbeat-interval`, or one for the job's size (`interval_for`)."""
    if args.heartbeat_interval:
        return float(args.heartbeat_interval)
    interval = interval_for(max_nodes, args.node_timeout)
    if interval > 1.0:
        log.info(
            f"heartbeats every {interval:.3g} s: up to {max_nodes} nodes keep the job to "
            f"{HEARTBEATS_PER_S} heartbeats a second (--heartbeat-interval sets it)"
        )
    return interval


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
        if args.tf_role != "any":
            raise ConfigError("--tf-role is for a TensorFlow job: add --tf-ps")
        return 0
    if args.tf_role == "ps" and standalone:
        raise ConfigError(
            "--tf-role ps makes a node of parameter servers only; a --standalone job is one "
            "node, which also runs the chief and the workers: drop --tf-role"
        )
    if args.num_ps < 1:
        raise ConfigError(f"--num-ps must be at least 1, got {args.num_ps}")
    if args.run_path or args.module or args.no_python:
        raise ConfigError(
            "--tf-ps runs the script as the chief with python: it cannot go with "
            "--run-path, -m or --no-python"
        )
    # not a torch forkserver: TensorFlow tasks start from spares that imported it
    # (rove.agent.tf_spare), which --no-warm-start turns off
    args.tf_spares = bool(args.warm_start)
    args.warm_start = False
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
        if args.kafka_config:
            raise ConfigError(
                "--kafka-config is for a job that streams from Kafka: add --kafka-bootstrap"
            )
        return ()
    subjects.check_name("dataset", args.kafka_topic)
    env = [("ROVE_KAFKA_BOOTSTRAP", args.kafka_bootstrap), ("ROVE_KAFKA_TOPIC", args.kafka_topic)]
    if args.kafka_config:
        from rove.control.process import kafka_settings

        kafka_settings.load(args.kafka_config)  # a file it cannot use fails here, said once
        env.append((kafka_settings.ENV, str(Path(args.kafka_config).resolve())))
    return tuple(env)


async def _run(args: argparse.Namespace, cfg: AgentConfig, standalone: bool, log_path: Path) -> int:
    # SIGINT, SIGTERM, SIGHUP and SIGQUIT (or those --signals-to-handle names) for the
    # whole run: the first stops the job's workers (with the same signal) and leaves
    # cleanly, a second one ends everything at once. Until the agent hears them (it may
    # wait for the bus however long), the first ends that wait
    starting = aio.Starting("the job", signals=args.stop_signals)
    return await starting.wait(_run_job(args, cfg, standalone, log_path, starting.signals))


async def _run_job(
    args: argparse.Namespace,
    cfg: AgentConfig,
    standalone: bool,
    log_path: Path,
    signals: aio.StopSignals,
) -> int:
    options = common.bus_options(
        args,
        name=f"rove-agent-{cfg.node}",
        job=cfg.job,
        daemon=True,
        allow_embedded=standalone,
    )
    if options.url is None:  # this machine keeps the job: its folder, and the others' rule
        _housekeeping(cfg.job)
    elif options.url != embedded.recorded_url(cfg.job):
        # a shared NATS: kept in the job's folder for the readers (`rove status --job J`).
        # (Not the job's own server, a `--standalone --auto-scale` job's, whose nodes
        # are given its URL: its events are stored here, and read from there.)
        stored.remember_shared(cfg.job, options.url)
        jobs.forget_summary(cfg.job)  # (an earlier run's: this one is read anew)
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
        nats = common.nats_flag(bus)
        say(
            f"job {cfg.job}, node {cfg.node}, NATS {bus.url}; watch it with: rove status "
            f"--job {cfg.job}{nats}; rove's log: {log_path}"
        )
        agent = Agent(bus, cfg, signals=signals)
        # (--standalone: this process keeps the job's NATS server; each restart is a fact)
        bus.server_restarted.append(agent.facts.nats_server_restarted)
        code = await agent.run()
        if runner is not None and signals.received:
            said, ended = await endings.stopped(bus, cfg.job, cfg.node, runner, signals.received[0])
            if ended is not None and ended.ckpt.committed is not None:
                # (the step its breakpoint persisted, committed as the job ended: recorded
                # on storage by this node, as its agent would have, for the next run)
                await agent.checkpoints.commit(ended.ckpt.committed, ended.rdzv.round)
            say(said)
        else:
            say(agent.status.end_reason)
        if code != 0 and agent.status.failure is not None:
            for line in endings.summary(cfg.node, *agent.status.failure):
                say(line)
        if agent.status.starts:
            if told := await endings.goodput_line(bus, cfg.job):
                say(told)
            say(
                f"read it again with: rove status, rove events, rove goodput or rove logs "
                f"--job {cfg.job}{nats}"
            )
        return code
    finally:
        if bridge is not None and bridge_task is not None:
            bridge.stop()
            await asyncio.gather(bridge_task, return_exceptions=True)
        if runner is not None and master_task is not None:
            runner.stop()  # (a leader folds what is stored, the node's last facts, first)
            await asyncio.gather(master_task, return_exceptions=True)
        if bus.server is not None:
            embedded.url_file(cfg.job).unlink(missing_ok=True)
        await bus.close()


def say(line: str) -> None:
    """A sentence for the person at the console (and the job's log)."""
    print(f"rove: {line}", file=sys.stderr, flush=True)
    log.debug(line)


def _faults(texts: Sequence[str]) -> tuple[faults.Fault, ...]:
    """`--inject-fault` as a plan (rove.agent.faults); raises ConfigError naming a bad one."""
    try:
        return tuple(faults.parse(text) for text in texts)
    except ValueError as exc:
        raise ConfigError(f"--inject-fault {exc}") from exc


def _log_max_bytes() -> int:
    """Past how many bytes a worker's kept output is rotated (ROVE_LOG_MAX_BYTES)."""
    text = os.environ.get("ROVE_LOG_MAX_BYTES", "").strip()
    if not text:
        return MAX_BYTES_DEFAULT
    try:
        value = common.byte_size(text)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"ROVE_LOG_MAX_BYTES: {exc}") from exc
    if value < 1:
        raise ConfigError(f"ROVE_LOG_MAX_BYTES must be at least 1 byte, got {text}")
    return value


def _housekeeping(job: str) -> None:
    """A job stored on this machine starts: an earlier run's cached summary goes, and the
    shared NATS an earlier run of its name ran on (the readers read this run, which is
    newer), and the oldest other jobs' folders past the retention rule
    (`rove.control.history.jobs`)."""
    jobs.forget_summary(job)
    stored.forget_shared(job)
    try:
        removed = jobs.prune(jobs.keep_from_env(), besides=job)
    except OSError as exc:
        log.warning(
            "could not prune old jobs' folders (the job runs; rove jobs --prune tries again)",
            error=f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc),
        )
        return
    if removed:
        log.info(
            f"removed {len(removed)} old jobs' folders (keeping the newest "
            f"{jobs.keep_from_env()}: ROVE_KEEP_JOBS; pin one with rove jobs --keep)",
            jobs=removed,
        )


def _bridge(bus: Bus, cfg: AgentConfig, args: argparse.Namespace) -> KafkaBridge:
    """The standalone job's Kafka bridge (`rove kafka-bridge`, in this process)."""
    from rove.control.process import kafka_settings
    from rove.control.services.kafka_bridge import BrokerReader, KafkaBridge

    return KafkaBridge(
        bus,
        cfg.job,
        BrokerReader(
            args.kafka_bootstrap,
            args.kafka_topic,
            group=args.kafka_group,
            settings=kafka_settings.load(args.kafka_config),
        ),
        dataset=args.kafka_topic,
        bridge_id=f"{cfg.node}-bridge",
        shard_records=args.kafka_shard_records,
        flags=("--kafka-bootstrap", "--kafka-topic"),
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


def leave(code: int) -> NoReturn:
    """`rove run` is done (its job, its servers and its files closed): run the exit
    handlers and leave without the interpreter's teardown of torch's modules (0.9 s of
    a short job's wall here; torchrun pays it too), what it would flush flushed first."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ConfigError as exc:  # an environment variable that sets a flag's default
        print(f"rove run: {exc}", file=sys.stderr)
        return common.EXIT_USAGE
    given = list(argv) if argv is not None else sys.argv[1:]
    suggest.install(parser, given, reworded)
    args = parser.parse_args(given)
    logs.configure()

    def run() -> int:
        warn_ignored(args, parser)
        try:
            cfg, standalone = agent_config(args)
        except ValueError as exc:  # torchrun's launch config: bad --nnodes / --nproc-per-node
            raise ConfigError(str(exc)) from exc
        store = embedded.job_store(cfg.job)
        if standalone and not args.nats and (pid := embedded.store_user(store)):
            raise ConfigError(
                f"job {cfg.job} is already running on this machine (rove pid {pid}): "
                f"watch it with rove status --job {cfg.job}; stop it before running it "
                "again, or give this one another --job"
            )
        if cfg.checkpoint_dir:
            run_checks.check_writers(str(cfg.checkpoint_dir), cfg.job, cfg.node)
        if elastic := getattr(args, "elastic_alone", ""):
            say(
                f"{elastic}, on this machine, and no --nats: running as --standalone, this "
                "machine's one node (no other machine can reach that rendezvous; for "
                "several machines give every node --nats nats://HOST:4222)"
            )
        elif getattr(args, "standalone_implied", False):
            say(
                "one node and no --nats: running as --standalone, with its own NATS server "
                "and master (the rendezvous flags given, if any, are not needed)"
            )
        log_path = logs.to_job_log(
            joblogs.agent_log(cfg.job, cfg.node), everything=args.verbose or logs.verbose()
        )
        if args.auto_scale:
            forkservers.stop()  # its nodes are processes of their own, with theirs
            raw = list(argv) if argv is not None else sys.argv[1:]
            return aio.run(managed.run_managed(args, cfg, raw), watch=f"rove run of job {cfg.job}")
        return aio.run(
            _run(args, cfg, standalone, log_path),
            watch=f"the agent of node {cfg.node} of job {cfg.job}",
        )

    return common.run_reporting("rove run", run)


if __name__ == "__main__":
    sys.exit(main())
