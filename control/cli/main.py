"""Entry point of the `rove` console script: parse, dispatch, map errors to exit codes.

User mistakes (bad arguments, unreachable server, unknown job) print one
clear line on stderr and exit with a documented code, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from rove.control.cli import (
    agent_cmd,
    auth_cmd,
    events_cmd,
    goodput_cmd,
    jobs_cmd,
    kafka_cmd,
    logs_cmd,
    master_cmd,
    operator_cmd,
    scale_cmd,
    scaler_cmd,
    status_cmd,
    stop_cmd,
    submit_cmd,
)
from rove.control.flags import options as common
from rove.control.flags import suggest
from rove.control.process import logs

_DAEMONS = frozenset({"master", "scaler", "agent", "kafka-bridge", "operator"})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rove",
        description="rove: elastic, self-healing distributed training on NATS JetStream.",
        epilog="exit codes: 0 ok, 1 failed, 2 bad arguments, 3 NATS unreachable, 4 unknown "
        "job, 130 interrupted (rove run: 128 + the signal, 130 SIGINT, 143 SIGTERM)",
    )
    p.add_argument(
        "--log-level", default=None, help="debug, info, warning, error (env ROVE_LOG_LEVEL)"
    )
    p.add_argument("--version", action="version", version=f"rove {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("run", help="run a training job (torchrun's flags, plus rove's)", add_help=False)
    for module in (
        master_cmd,
        scaler_cmd,
        submit_cmd,
        agent_cmd,
        kafka_cmd,
        events_cmd,
        status_cmd,
        goodput_cmd,
        logs_cmd,
        jobs_cmd,
        stop_cmd,
        scale_cmd,
        auth_cmd,
        operator_cmd,
    ):
        module.add_parser(sub)
    for command in sub.choices.values():  # (their descriptions are wrapped, with examples)
        command.formatter_class = argparse.RawDescriptionHelpFormatter
    return p


def _reworded(message: str, argv: Sequence[str]) -> str:
    """argparse's "the following arguments are required: --job" as a question with
    where to find the answer; `rove submit`'s `rove run` flags given before `--`."""
    if message.endswith("required: --job"):
        return "which job? give --job J (rove jobs lists the jobs kept on this machine)"
    if argv[:1] == ["submit"] and message.startswith("unrecognized arguments"):
        return (
            f"{message}: `rove submit` takes the job's `rove run` arguments after --, e.g. "
            "rove submit --job j1 --nats URL -- --nnodes 1:4 train.py"
        )
    return message


def _version() -> str:
    try:
        return importlib.metadata.version("rove")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # `rove` alone: what it can do, not "COMMAND is required"
        build_parser().print_help()
        return common.EXIT_USAGE
    if set(argv[:1]) & {"run", *_DAEMONS}:
        logs.survive_the_console()  # (they run on without it; their logs keep everything)
    if argv[:1] == ["run"]:
        # The warm server imports torch while this process does (rove.agent.forkservers)
        from rove.agent import forkservers

        forkservers.early_start(argv[1:])
        # `rove run` has torchrun's parser (rove.agent.torchrun_cli): it parses its own.
        from rove.agent.launcher import leave
        from rove.agent.launcher import main as run_main

        return leave(run_main(argv[1:]))
    parser = build_parser()
    suggest.install(parser, argv, lambda message: _reworded(message, argv))
    args = parser.parse_args(argv)
    # Daemons tell what they do; one-shot commands print their answer and only warnings.
    logs.configure(args.log_level or ("info" if args.command in _DAEMONS else "warning"))
    return common.run_reporting(f"rove {args.command}", lambda: int(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())
