"""torchrun's command line, without importing torch.

`rove run` takes torchrun's flags. torch's own parser (`torch.distributed.run.
get_args_parser`) lives in a module that imports torch, 2.1 CPU-seconds here, which
every `rove run` paid before reading its first argument: a typo took 2.3 s to be
told, and on a small node the launcher's import competed with the warm server's own
import of torch at a job's start. So this module builds the same parser by itself:
the same flags, destinations, defaults, types, choices and `PET_*` environment
variables (torchrun's `env` and `check_env` actions), checked against the installed
torch's by `tests/test_torchrun_cli.py`.

The copy is used only with the torch release it was checked against (`CHECKED`);
with any other installed torch, `parser()` is torch's own (other releases have other
flags), so a drop-in stays one whatever torch is installed.

`launch(args)` is what rove takes from torchrun's `config_from_args`: the node
range, the workers per node (a number here; `auto`, `cpu`, `gpu`, `xpu` ask torch),
restarts, start method, role, the console filter and the worker's command. torch's
logs specs (`--redirects`, `--tee`, `--logs-specs`) are built only when asked for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from importlib import metadata
from typing import Any

from rove.control.errors import ConfigError

#: the torch release (major.minor) whose torchrun parser this module's is checked against
CHECKED = "2.13"


class env(argparse.Action):
    """A value from the command line, else from `PET_<DEST>`, else the default."""

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any):
        default = os.environ.get(f"PET_{dest.upper()}", default)
        super().__init__(dest=dest, default=default, required=required and not default, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)


#: how `PET_<DEST>` may say a boolean flag (torchrun reads 0 or 1 with `int()`)
_BOOLEAN = {"1": True, "true": True, "yes": True, "on": True}
_BOOLEAN |= {"0": False, "false": False, "no": False, "off": False, "": False}


class check_env(argparse.Action):
    """A flag (True when given), else `PET_<DEST>` read as 0 or 1 (or true, false).

    Raises:
        ConfigError: `PET_<DEST>` says neither (it was a traceback as the parser was
            built, as under torchrun).
    """

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        name = f"PET_{dest.upper()}"
        raw = os.environ.get(name)
        if raw is not None:
            said = _BOOLEAN.get(raw.strip().lower())
            if said is None:
                raise ConfigError(f"{name}={raw!r}: give 1 or 0 (or true, false), or unset it")
            default = said
        super().__init__(dest=dest, const=True, default=default, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, self.const)


def comma_separated_list(value: str) -> list[str]:
    """`a,b` -> ["a", "b"]; a doubled comma is a comma (torchrun's filters)."""
    mark = "\0"
    return [item.replace(mark, ",") for item in value.replace(",,", mark).split(",")]


def _both(name: str) -> list[str]:
    """torchrun's two spellings of a flag: --dashed-name and --underscored_name."""
    return [f"--{name}", f"--{name.replace('-', '_')}"]


#: (flags, action, type, default, help): torchrun's options in torchrun's order
_OPTIONS: tuple[tuple[list[str], type[argparse.Action] | None, Any, Any, str], ...] = (
    (["--nnodes"], env, str, "1:1", "number of nodes, or a range MIN:MAX"),
    (
        _both("nproc-per-node"),
        env,
        str,
        "1",
        "workers per node: a number, or auto, cpu, gpu or xpu",
    ),
    (_both("rdzv-backend"), env, str, "static", "rendezvous backend"),
    (_both("rdzv-endpoint"), env, str, "", "rendezvous endpoint, usually HOST:PORT"),
    (_both("rdzv-id"), env, str, "none", "user-defined group id"),
    (_both("rdzv-conf"), env, str, "", "more rendezvous settings (KEY1=VALUE1,KEY2=VALUE2)"),
    (["--standalone"], check_env, None, False, "a one-machine job"),
    (_both("max-restarts"), env, int, 0, "worker group restarts before failing"),
    (_both("monitor-interval"), env, float, 0.1, "seconds between looks at the workers"),
    (_both("start-method"), env, str, "spawn", "how worker processes are started"),
    (_both("event-log-handler"), env, str, "null", "a registered event log handler"),
    (["--role"], env, str, "default", "user-defined role of the workers"),
    (["-m", "--module"], check_env, None, False, "run the script as a module (python -m)"),
    (_both("no-python"), check_env, None, False, "run the script itself, not with python"),
    (
        _both("run-path"),
        check_env,
        None,
        False,
        "run the script with runpy.run_path in the worker's interpreter",
    ),
    (_both("log-dir"), env, str, None, "base folder of the workers' log files"),
    (
        ["-r", "--redirects"],
        env,
        str,
        "0",
        "redirect std streams into log files (e.g. 3: both, for every worker; 0:1,1:2: "
        "stdout of local rank 0, stderr of local rank 1)",
    ),
    (["-t", "--tee"], env, str, "0", "as --redirects, and also to the console"),
    (
        _both("local-ranks-filter"),
        env,
        str,
        "",
        "the local ranks whose output is shown on the console (e.g. 0,1,2)",
    ),
    (
        _both("duplicate-stdout-filters"),
        env,
        comma_separated_list,
        [],
        "copy stdout lines matching any of these to another file",
    ),
    (
        _both("duplicate-stderr-filters"),
        env,
        comma_separated_list,
        [],
        "copy stderr lines matching any of these to another file",
    ),
    (_both("node-rank"), env, int, 0, "this node's rank, for static rendezvous"),
    (_both("master-addr"), env, str, "127.0.0.1", "rank 0's address, for static rendezvous"),
    (_both("master-port"), env, int, None, "rank 0's port, for static rendezvous"),
    (_both("local-addr"), env, str, None, "this node's address"),
    (_both("logs-specs"), None, str, None, "a torchrun.logs_specs entry point's name"),
    (
        _both("numa-binding"),
        None,
        str,
        None,
        "bind workers to CPUs near their GPUs",
    ),
    (
        _both("signals-to-handle"),
        env,
        str,
        "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "the signals that stop the job: the first passes to the workers, who get the "
        "shutdown timeout to exit (SIGUSR1,SIGUSR2: SLURM's warnings); a second ends "
        "everything at once. SIGINT and SIGTERM always do",
    ),
    (
        _both("shutdown-timeout"),
        env,
        int,
        None,
        "seconds workers get to exit before SIGKILL",
    ),
    (
        _both("virtual-local-rank"),
        check_env,
        None,
        False,
        "LOCAL_RANK 0 for every worker, each seeing its own GPU as device 0",
    ),
)

_CHOICES = {
    "start_method": ["spawn", "fork", "forkserver"],
    "numa_binding": ["node", "socket", "exclusive", "core-complex"],
}


def installed_torch() -> str | None:
    """The installed torch's version, without importing it (None: not installed)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def checked(version: str | None) -> bool:
    """Whether this module's parser is the one of torch `version`."""
    return version is not None and version.split("+")[0].split(".")[:2] == CHECKED.split(".")


def own_parser() -> argparse.ArgumentParser:
    """This module's copy of torchrun's parser (see the module's text)."""
    p = argparse.ArgumentParser(description="Torch Distributed Elastic Training Launcher")
    for flags, action, kind, default, text in _OPTIONS:
        kw: dict[str, Any] = {"default": default, "help": text}
        if action is not None:
            kw["action"] = action
        if kind is not None:
            kw["type"] = kind
        dest = flags[-1].lstrip("-").replace("-", "_")
        if dest in _CHOICES:
            kw["choices"] = _CHOICES[dest]
        p.add_argument(*flags, **kw)
    p.add_argument(
        "training_script",
        type=str,
        help="the training script (or module, with -m), then its arguments",
    )
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def parser() -> argparse.ArgumentParser:
    """torchrun's parser: this module's copy with the torch it was checked against,
    torch's own with any other."""
    if checked(installed_torch()):
        return own_parser()
    from torch.distributed.run import get_args_parser

    return get_args_parser()


def nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max), as torchrun reads --nnodes; ValueError if not."""
    parts = value.split(":")
    if len(parts) not in (1, 2):
        raise ValueError(f'nnodes={value} is not in "MIN:MAX" format')
    lo, hi = int(parts[0]), int(parts[-1])
    return lo, hi


def nproc(value: str) -> int:
    """--nproc-per-node: a number as it is; `auto`, `cpu`, `gpu`, `xpu` through torch's
    own reading (which imports torch: only then). ValueError for anything else, or for
    `gpu` without CUDA ("Cuda is not available")."""
    try:
        return int(value)
    except ValueError:
        pass
    if value not in ("auto", "cpu", "gpu", "xpu") and not value.isidentifier():
        raise ValueError(f"Unsupported nproc_per_node value: {value}")
    from torch.distributed.run import determine_local_world_size

    return int(determine_local_world_size(value))


@dataclasses.dataclass(frozen=True)
class Launch:
    """What rove takes from torchrun's launch configuration."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    start_method: str
    role: str
    #: local ranks whose output the console shows (None: all)
    console_ranks: set[int] | None
    #: torch's logs specs, where the command line asked for torch's logs (--redirects,
    #: --tee, --logs-specs); None: rove's own (`rove.agent.echo`)
    torch_logs: Any


def console_ranks(value: str) -> set[int] | None:
    """--local-ranks-filter `0,1,2` -> {0, 1, 2}; empty: None (all)."""
    if not value:
        return None
    try:
        ranks = {int(r) for r in value.split(",")}
    except ValueError as exc:
        raise ValueError(
            "--local_ranks_filter must be a comma-separated list of integers e.g. "
            "--local_ranks_filter=0,1,2"
        ) from exc
    return ranks


def asks_torch_logs(args: argparse.Namespace) -> bool:
    """Whether the command line asks for torch's own worker logs."""
    return (
        args.logs_specs is not None
        or args.redirects not in (None, "0")
        or (args.tee not in (None, "0"))
    )


def torch_logs(args: argparse.Namespace, ranks: set[int] | None) -> Any:
    """torch's logs specs of the command line (imports torch)."""
    from torch.distributed.elastic.multiprocessing import Std
    from torch.distributed.run import _get_logs_specs_class

    cls = _get_logs_specs_class(args.logs_specs)
    return cls(
        log_dir=args.log_dir,
        redirects=Std.from_str(args.redirects),
        tee=Std.from_str(args.tee),
        local_ranks_filter=ranks,
    )


def launch(args: argparse.Namespace) -> tuple[Launch, str | None, list[str]]:
    """torchrun's `config_from_args`, the part rove uses: the launch, the worker's
    command (None: torchrun's --run-path, the script run in the worker's interpreter)
    and its arguments. Sets OMP_NUM_THREADS=1 for more than one worker a node where it
    is not set, as torchrun does. Raises ValueError as torchrun's does."""
    lo, hi = nnodes(str(args.nnodes))
    if not 0 < lo <= hi:
        raise ValueError(f"min_nodes must be > 0 and <= max_nodes, got {lo}:{hi}")
    if args.max_restarts < 0:
        raise ValueError("max_restarts must be >= 0")
    workers = nproc(str(args.nproc_per_node))
    if "OMP_NUM_THREADS" not in os.environ and workers > 1:
        os.environ["OMP_NUM_THREADS"] = "1"
    ranks = console_ranks(args.local_ranks_filter)
    config = Launch(
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=workers,
        max_restarts=args.max_restarts,
        start_method=args.start_method,
        role=args.role,
        console_ranks=ranks,
        torch_logs=torch_logs(args, ranks) if asks_torch_logs(args) else None,
    )
    cmd: str | None
    cmd_args: list[str] = []
    if args.run_path:
        cmd = None
        cmd_args.append(args.training_script)
    elif not args.no_python:
        cmd = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args.append("-u")
        if args.module:
            cmd_args.append("-m")
        cmd_args.append(args.training_script)
    else:
        if args.module:
            raise ValueError(
                "Don't use both the '--no-python' flag and the '--module' flag at the same time."
            )
        cmd = args.training_script
    cmd_args.extend(args.training_script_args)
    return config, cmd, cmd_args
