"""`rove run`'s arguments checked and completed before the agent's configuration is made
of them (`rove.agent.launcher.agent_config`): `--auto-config`, the numeric flags' ranges,
paths made absolute, the checkpoint location, the signals that stop the job."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Mapping
from pathlib import Path

from rove.control.errors import ConfigError
from rove.control.process.folders import unwritable


def auto_config(args: argparse.Namespace) -> None:
    """`--auto-config`: the node count from `NODE_NUM`, a worker per GPU, and the
    network check for four nodes or more (DLRover's)."""
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
    ("peer_replicas", 0),
    ("peer_memory", 1),
    ("shutdown_timeout", 0),
    ("monitor_interval", 0),
    ("max_worker_restarts", 0),
)


def check_ranges(args: argparse.Namespace) -> None:
    """A numeric flag under its least (`_AT_LEAST`) is refused, naming it."""
    for dest, least in _AT_LEAST:
        value = getattr(args, dest, None)
        if value is not None and value < least:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(f"{flag} must be at least {least}, got {value:g}")


def absolute_paths(args: argparse.Namespace) -> None:
    """`--checkpoint-dir` and `--log-dir` as absolute paths (`~` expanded, which a shell
    leaves in `--checkpoint-dir=~/ckpt`): the workers get them in their environment, and a
    script that changes its directory (Hydra's runs do) read a relative one elsewhere than
    the agent wrote it. An object store's URL is left as it is."""
    for name in ("checkpoint_dir", "log_dir"):
        value = getattr(args, name)
        if value and "://" not in value:
            setattr(args, name, str(Path(value).expanduser().absolute()))


def check_storage(location: str) -> None:
    """A checkpoint URL no store can serve, or a directory of this machine that this
    user cannot create or write, is said before anything starts. (No object store is
    contacted here: an unreachable one fails each persist with its reason, and training
    goes on from memory.)"""
    from rove.checkpoint.storage import FileStorage, StorageError
    from rove.checkpoint.stores import open_storage

    try:
        storage = open_storage(location)
    except StorageError as exc:
        raise ConfigError(f"--checkpoint-dir: {exc}") from exc
    if isinstance(storage, FileStorage) and (why := unwritable(storage.root)):
        raise ConfigError(
            f"--checkpoint-dir {location}: {why}; give a directory this user can create "
            "and write (or an object store URL: s3://, gs://, az://)"
        )


def on_loopback(endpoint: str | None) -> bool:
    """Whether a torchrun `--rdzv-endpoint` (HOST or HOST:PORT) names this machine's
    loopback, which no other machine can reach (`localhost`, `127.0.0.1`, `[::1]`)."""
    import ipaddress

    text = (endpoint or "").strip()
    if not text:
        return False
    if text.startswith("["):  # [IPv6] or [IPv6]:PORT
        host = text[1:].partition("]")[0]
    else:  # HOST:PORT, HOST, or a bare IPv6 address
        host = text.rsplit(":", 1)[0] if text.count(":") == 1 else text
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: Log levels `ROVE_LOG_LEVEL` may name, and formats `ROVE_LOG_FORMAT` may.
LOG_LEVELS = ("debug", "info", "warning", "warn", "error", "critical")
LOG_FORMATS = ("console", "json")


def environment(environ: Mapping[str, str]) -> None:
    """rove's own environment variables that no flag checks, checked before anything
    starts: `ROVE_TF_THREADS` (each TensorFlow task died with a traceback, and every
    round after it), `ROVE_LOG_LEVEL` and `ROVE_LOG_FORMAT` (a word misspelt gave the
    default, unsaid), `ROVE_WARM_FORK`."""
    threads = environ.get("ROVE_TF_THREADS", "").strip()
    if threads and not (threads.isdigit() and int(threads) >= 0):
        raise ConfigError(
            f"ROVE_TF_THREADS must be a whole number of threads (0: TensorFlow's choice), "
            f"got {threads!r}"
        )
    for name, words in (("ROVE_LOG_LEVEL", LOG_LEVELS), ("ROVE_LOG_FORMAT", LOG_FORMATS)):
        word = environ.get(name, "").strip()
        if word and word.lower() not in words:
            raise ConfigError(f"{name} must be one of {', '.join(words)}, got {word!r}")
    fork = environ.get("ROVE_WARM_FORK", "").strip()
    if fork not in ("", "0", "1"):
        raise ConfigError(f"ROVE_WARM_FORK must be 1 or 0, got {fork!r}")


#: How long `rove run` waits to read which jobs write its checkpoint location (a hung
#: network file system, an object store away) before it starts without knowing.
WRITERS_READ_S = 10.0


def check_writers(location: str, job: str, node: str) -> None:
    """Claim the checkpoint location for `job` (`rove.checkpoint.writers.claim`), and
    refuse to start it where another job claimed it first and writes it now (its mark
    refreshed within `rove.checkpoint.writers.LIVE_S`): the two would remove each
    other's steps. Of two jobs started at once, one goes on. A location that cannot be
    read or marked in `WRITERS_READ_S` is not refused: the agent says what fails when it
    writes there."""
    import threading
    import time

    from rove.checkpoint import writers
    from rove.checkpoint.storage import StorageError
    from rove.checkpoint.stores import open_storage

    found: list[list[writers.WriterMark]] = []

    def read() -> None:
        with contextlib.suppress(StorageError):
            found.append(writers.claim(open_storage(location), job, node, time.time()))

    # (a daemon: a read still hung is left behind, and never holds the process's exit)
    reader = threading.Thread(target=read, name="rove-writers", daemon=True)
    reader.start()
    reader.join(WRITERS_READ_S)
    if not found:
        return
    if others := found[0]:
        raise ConfigError(writers.refusal(location, job, others, time.time()))


#: Seconds workers get to exit after the stop signal before SIGKILL, by default. torchrun
#: gives 30: rove gives less, a restart waiting on a worker that handles SIGTERM but is
#: stuck in a collective (a peer died) being time the job stands still.
SHUTDOWN_TIMEOUT_S = 10.0


def shutdown_timeout(args: argparse.Namespace) -> float:
    """`--shutdown-timeout` (0: SIGKILL at once), else torchrun's environment variable
    `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, else `SHUTDOWN_TIMEOUT_S`."""
    if args.shutdown_timeout is not None:
        return float(args.shutdown_timeout)
    raw = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    if not raw:
        return SHUTDOWN_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ConfigError(
            f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={raw!r} is not a number of seconds (0 or more)"
        )
    return value


#: what a launcher always stops on, whatever `--signals-to-handle` names: a Ctrl-C, and
#: a scheduler's or Kubernetes' stop (without them it would die without a clean stop)
ALWAYS_HANDLED = (signal.SIGTERM, signal.SIGINT)
#: signals no process may handle, or that rove's own child processes need
_UNHANDLED = {
    signal.SIGKILL: "no process can handle it",
    signal.SIGSTOP: "no process can handle it",
    signal.SIGCHLD: "rove learns of its workers' ends by it",
}


def stop_signals(spec: str) -> tuple[signal.Signals, ...]:
    """The signals `--signals-to-handle` names (torchrun's flag, env
    `PET_SIGNALS_TO_HANDLE`: "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"), with SIGTERM and
    SIGINT always. The first of them stops the job: the workers get that same signal
    and the shutdown timeout to exit (a SLURM job warned with SIGUSR1 saves on it); a
    second ends everything at once. ConfigError for a word that names no signal, or
    one that cannot be handled."""
    found: list[signal.Signals] = list(ALWAYS_HANDLED)
    for word in spec.split(","):
        name = word.strip().upper()
        if not name:
            continue
        sig = signal.Signals.__members__.get(name if name.startswith("SIG") else "SIG" + name)
        if sig is None:
            raise ConfigError(
                f"--signals-to-handle {spec}: {word.strip()} is not a signal's name; give "
                "names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
            )
        if sig in _UNHANDLED:
            raise ConfigError(
                f"--signals-to-handle {spec}: {sig.name} cannot stop the job "
                f"({_UNHANDLED[sig]}); leave it out"
            )
        found.append(sig)
    return tuple(dict.fromkeys(found))
