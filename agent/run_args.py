"""`rove run`'s command line: torchrun's own parser, rove's flags added, and what rove
does with the torchrun flags it takes but ignores or reads differently."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from rove.agent import torchrun_cli
from rove.agent.torchrun_cli import Launch
from rove.control.errors import ConfigError
from rove.control.flags import options as common

DESCRIPTION = "a drop-in for `torchrun` whose jobs survive failures."


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
    "shutdown_timeout": "seconds workers get to exit after the stop signal before SIGKILL (0: at "
    "once; default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 10, where torchrun waits 30)",
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
    "duplicate_stdout_filters": "not supported by rove yet",
    "duplicate_stderr_filters": "not supported by rove yet",
    "virtual_local_rank": "not supported by rove yet",
}


class ScriptArgsParser(argparse.ArgumentParser):
    """A parser whose words after the training script are the script's, untouched.

    argparse reads every word that starts with `-` as a flag of its own before it
    places the positionals, so a script's flag that abbreviates several of rove's
    (`train.py --a 1`: "ambiguous option: --a could match --auto-config, ...") ended
    the run before it began. torchrun's parser does the same with fewer flags
    (`--max`). This one finds the script first, as a person reads the line: the
    first word that is neither a flag nor a flag's value, or the word after `--`.
    A line it cannot read that way (an unknown or ambiguous flag before the script)
    is left to argparse, which says what is wrong.

    An abbreviation of two spellings of one flag is that flag: `--nproc` is
    `--nproc-per-node` (or `--nproc_per_node`), where Python 3.11's argparse, and
    torchrun on it, call it ambiguous."""

    def script_at(self, argv: Sequence[str], lenient: bool = False) -> int | None:
        """The index of the training script in `argv`, or None. `lenient` (to place a
        mistake, not to run): an unknown flag is read as taking no value, as argparse
        reads it, and an ambiguous one as its candidates read."""
        i = 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                return i + 1 if i + 1 < len(argv) else None
            if not word.startswith("-") or word == "-":
                return i
            name, eq, _ = word.partition("=")
            candidates = self._flags(name)
            if not candidates and not word.startswith("--"):
                words = self._shorts(word[1:])
                if words is None and not lenient:
                    return None  # an unknown letter: argparse says which
                i += words or 1
                continue
            if len(candidates) != 1 and not lenient:
                return None  # unknown or ambiguous: argparse says which
            i += 1 if eq or all(a.nargs == 0 for a in candidates) else 2
        return None

    def _shorts(self, letters: str) -> int | None:
        """How many words short flags run together take (`-mv`: 1, `-r3`: 1, `-vr`
        followed by its value: 2), or None where a letter is no flag."""
        for at, letter in enumerate(letters):
            action = self._option_string_actions.get("-" + letter)
            if action is None:
                return None
            if action.nargs != 0:
                return 1 if letters[at + 1 :] else 2
        return 1

    def _flags(self, name: str) -> list[argparse.Action]:
        """The action `name` names, or those whose flags it abbreviates (as argparse
        reads them: one per action)."""
        if name in self._option_string_actions:
            return [self._option_string_actions[name]]
        if not (self.allow_abbrev and name.startswith("--")):
            return []
        return [reading[0] for reading in self._get_option_tuples(name)]

    def _get_option_tuples(self, option_string: str) -> list[tuple[Any, ...]]:
        """argparse's readings of an abbreviated flag, one per action (see the class)."""
        readings: dict[int, tuple[Any, ...]] = {}
        for reading in super()._get_option_tuples(option_string):
            readings.setdefault(id(reading[0]), reading)
        return list(readings.values())

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        at = self.script_at(argv)
        if at is None:
            return super().parse_known_args(argv, namespace)
        parsed, extra = super().parse_known_args(argv[: at + 1], namespace)
        parsed.training_script_args = argv[at + 1 :]
        return parsed, extra


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
            # (before the job's log opens: a sentence for the console, as later ones are)
            print(f"rove: {flag} is ignored: {why}", file=sys.stderr, flush=True)
            named.append(flag)
    return named


def build_parser() -> ScriptArgsParser:
    p = ScriptArgsParser(
        prog="rove run",
        description=DESCRIPTION,
        parents=[torchrun_cli.parser()],
        add_help=False,
    )
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
        help="persist flash checkpoints here: a directory, or an object store's URL "
        "(s3://BUCKET/PREFIX, gs://..., az://...; credentials from the environment) "
        "(env ROVE_CKPT_DIR); without it they stay in memory",
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
        "--peer-replicas",
        type=int,
        default=1,
        metavar="K",
        help="send each node's newest flash checkpoint to K peer nodes' memory (default 1; "
        "0: none), so a lost node's state is there without storage",
    )
    g.add_argument(
        "--peer-memory",
        type=int,
        default=8192,
        metavar="MIB",
        help="the most MiB of its peers' checkpoint replicas this node holds (8192); a "
        "peer keeps the newest complete step of each node that sends to it",
    )
    g.add_argument(
        "--failure-domain",
        default=os.environ.get("ROVE_FAILURE_DOMAIN", ""),
        metavar="NAME",
        help="this node's failure domain (a host, a rack, a zone; env ROVE_FAILURE_DOMAIN): "
        "replicas go to nodes of another domain first",
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
        default=None,
        metavar="SECONDS",
        help="seconds between heartbeats (default 1, longer above 25,000 nodes: "
        "--nnodes MAX / 25,000, at most a fifth of --node-timeout)",
    )
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="rove's whole log on the console too (env ROVE_VERBOSE=1); by default the "
        "console gets short sentences and the log goes to the job's folder",
    )
    g.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        metavar="[SIGNAL:]RANK@STEP",
        help="send SIGNAL (kill, term, int, segv, abrt; default kill) to global rank RANK "
        "when it reports step STEP, once (repeatable): e.g. kill:1@300 to see a failure "
        "healed (see docs/runtime.md, 'Injecting a fault')",
    )
    g.add_argument(
        "--warm-start",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fork workers from a server that imported torch once, so a restart skips "
        "interpreter start and imports (default: on); --no-warm-start starts every "
        "worker as a fresh interpreter, as torchrun does (see docs/runtime.md); in a "
        "--tf-ps job, tasks start from spares that imported TensorFlow (docs/tensorflow.md)",
    )
    g.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODULE",
        help="with warm start, also import MODULE once in the warm server (repeatable), "
        "e.g. --preload transformers",
    )
    g.add_argument(
        "--learn-imports",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with warm start, the warm server for restarts also imports what the first "
        "round's workers imported from outside the script's folder and the working "
        "directory (installed packages), so a restarted worker finds it imported "
        "(default: on; see docs/runtime.md, 'Learned imports')",
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
        "--kafka-config",
        metavar="FILE",
        help="librdkafka settings for a secured Kafka cluster (security.protocol, ssl.*, "
        "sasl.*), one key=value per line, from this file: the workers find its path in "
        "ROVE_KAFKA_CONFIG, and so does the --standalone bridge (docs/streaming.md)",
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
        "--tf-role",
        choices=["any", "ps"],
        default="any",
        help="ps: this node hosts parameter servers only, one per process (a node sized "
        "for them); any (default): roles in rank order, or the chief and workers when "
        "other nodes host the parameter servers",
    )
    t.add_argument(
        "--num-workers",
        type=int,
        metavar="W",
        help="with --standalone: W workers, so 1 + P + W processes (sets --nproc-per-node)",
    )
    t.add_argument(
        "--max-worker-restarts",
        type=int,
        default=10,
        metavar="N",
        help="a worker that dies is restarted in place (the coordinator retries its work "
        "elsewhere meanwhile) up to N times per worker and round before the round fails "
        "(default 10; independent of --max-restarts, which counts rounds)",
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


def node_range(nnodes: object) -> tuple[int, int]:
    """--nnodes as (MIN, MAX), as torchrun reads it.

    Raises:
        ConfigError: neither N nor MIN:MAX, or not 0 < MIN <= MAX.
    """
    try:
        lo, hi = torchrun_cli.nnodes(str(nnodes))
    except ValueError as exc:
        raise ConfigError(
            f"--nnodes {nnodes}: use a number of nodes N or a range MIN:MAX, e.g. 2 or 1:4"
        ) from exc
    if not 0 < lo <= hi:
        raise ConfigError(f"--nnodes {nnodes}: need 0 < MIN <= MAX")
    return lo, hi


def launch_config(args: argparse.Namespace) -> tuple[Launch, str | None, list[str]]:
    """torchrun's launch configuration of `args` (`rove.agent.torchrun_cli.launch`),
    its errors said in rove's words, and its console warning as a rove line.

    Raises:
        ConfigError: a bad --nproc-per-node or --nnodes, or `gpu` without CUDA.
    """
    nproc_error = ConfigError(
        f"--nproc-per-node must be a number of at least 1, or auto, cpu or gpu; "
        f"got {args.nproc_per_node}"
    )
    threads_set = "OMP_NUM_THREADS" in os.environ
    try:
        # (torch's own warnings, where it reads --nproc-per-node, are torchrun's console
        # in its own format: the one that matters is said below as a rove line)
        torch_run = logging.getLogger("torch.distributed.run")
        quiet, torch_run.disabled = torch_run.disabled, True
        try:
            launch, cmd, cmd_args = torchrun_cli.launch(args)
        finally:
            torch_run.disabled = quiet
    except ValueError as exc:
        if "nproc_per_node" in str(exc):
            raise nproc_error from exc
        if "Cuda is not available" in str(exc):
            raise ConfigError(
                f"--nproc-per-node {args.nproc_per_node}: torch sees no CUDA GPU on this "
                "machine; give a number of workers, or cpu"
            ) from exc
        raise
    if launch.nproc_per_node < 1:
        raise nproc_error
    if not threads_set and "OMP_NUM_THREADS" in os.environ:
        print(
            f"rove: each worker runs with OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
            "as under torchrun with more than one worker a node; set OMP_NUM_THREADS to "
            "give it more threads",
            file=sys.stderr,
            flush=True,
        )
    if launch.min_nodes > launch.max_nodes:
        raise ConfigError(f"--nnodes {args.nnodes}: MIN is larger than MAX")
    if launch.max_nodes < args.node_unit:
        raise ConfigError(f"--nnodes max {launch.max_nodes} is smaller than --node-unit")
    return launch, cmd, cmd_args


def reworded(message: str) -> str:
    """argparse's "the following arguments are required: training_script,
    training_script_args" (torchrun's too) as what is missing."""
    if "required: training_script" in message:
        return "no training script given: rove run [options] SCRIPT [ARGS...]"
    return message
