"""Command-line options shared by `rove run` and the CLI: NATS, argument types, exit codes."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rove.control.bus import embedded, stored
from rove.control.bus.client import Bus, BusOptions
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import BusUnavailableError, ConfigError, RoveError, UnknownJobError
from rove.control.process import aio, logs

# Exit codes of the CLI.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_UNKNOWN_JOB = 4
EXIT_INTERRUPTED = 130
#: the reader of the output went away (`rove events | head`): as a process killed by SIGPIPE
EXIT_READER_GONE = 128 + 13


_EXIT_CODES: tuple[tuple[type[Exception], int], ...] = (
    (ConfigError, EXIT_USAGE),
    (BusUnavailableError, EXIT_UNREACHABLE),
    (UnknownJobError, EXIT_UNKNOWN_JOB),
    (RoveError, EXIT_FAILED),
)


def run_reporting(command: str, fn: Callable[[], int]) -> int:
    """Run a command; a user-facing error becomes one line on stderr and its exit code."""
    try:
        return fn()
    except RoveError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return next(code for kind, code in _EXIT_CODES if isinstance(exc, kind))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except aio.Interrupted as exc:  # a signal while it waited for its bus to start
        return 128 + exc.signum
    except BrokenPipeError:
        # Whoever read the output stopped reading (`| head`): end quietly, as `cat` does,
        # and let nothing more be written where nobody reads (Python's exit flushes).
        logs.to_dev_null(sys.stdout)
        return EXIT_READER_GONE


def add_job_arg(p: argparse.ArgumentParser) -> None:
    """`--job NAME`, required, checked as it is parsed (a bad name is a usage error)."""
    p.add_argument("--job", required=True, type=job_name, help="job name")


def job_name(text: str) -> str:
    try:
        return subjects.check_name("job", text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_run_arg(p: argparse.ArgumentParser) -> None:
    """`--run N`: which run of a job a reader reads (a job name can run again)."""
    p.add_argument(
        "--run",
        type=at_least_one,
        metavar="N",
        help="which run of the job (a job name run again starts its next run; default: the newest)",
    )


def at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def whole(text: str) -> int:
    """A whole number, 0 or more (a rank, a round)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def add_nats_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("NATS connection")
    g.add_argument(
        "--nats",
        metavar="URL",
        default=os.environ.get("ROVE_NATS_URL"),
        help="NATS server URL(s), comma-separated (env ROVE_NATS_URL)",
    )
    g.add_argument(
        "--nats-user",
        default=os.environ.get("ROVE_NATS_USER"),
        help="user name (env ROVE_NATS_USER)",
    )
    g.add_argument(
        "--nats-password",
        default=os.environ.get("ROVE_NATS_PASSWORD"),
        help="password (env ROVE_NATS_PASSWORD)",
    )
    g.add_argument(
        "--nats-token",
        default=os.environ.get("ROVE_NATS_TOKEN"),
        help="token (env ROVE_NATS_TOKEN)",
    )
    g.add_argument(
        "--nats-creds",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_CREDS"),
        help="credentials file with a user JWT and nkey seed (env ROVE_NATS_CREDS)",
    )
    g.add_argument(
        "--nats-nkey",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_NKEY"),
        help="nkey seed file (env ROVE_NATS_NKEY)",
    )
    g.add_argument(
        "--nats-auth",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_AUTH"),
        help="rove credentials file of a role (`rove auth init`; env ROVE_NATS_AUTH)",
    )
    g.add_argument(
        "--nats-tls-ca",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_TLS_CA"),
        help="CA bundle to verify the server (env ROVE_NATS_TLS_CA)",
    )
    g.add_argument(
        "--nats-tls-cert",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_TLS_CERT"),
        help="client certificate for mutual TLS (env ROVE_NATS_TLS_CERT)",
    )
    g.add_argument(
        "--nats-tls-key",
        metavar="FILE",
        default=os.environ.get("ROVE_NATS_TLS_KEY"),
        help="client key for mutual TLS (env ROVE_NATS_TLS_KEY)",
    )
    g.add_argument(
        "--replicas",
        type=replica_count,
        # (a string: argparse converts it as it would the flag's, and a bad value is a
        # usage error naming both, not a traceback in every command)
        default=os.environ.get("ROVE_NATS_REPLICAS", "").strip() or "0",
        help="stream replicas when creating streams: 1 on one server, 3 on a cluster "
        "(default: 1 embedded, 3 for a URL listing 3+ servers, else 1)",
    )


def _check_files(args: argparse.Namespace) -> None:
    for flag in (
        "nats_creds",
        "nats_nkey",
        "nats_auth",
        "nats_tls_ca",
        "nats_tls_cert",
        "nats_tls_key",
    ):
        value = getattr(args, flag, None)
        if value and not Path(value).is_file():
            raise ConfigError(f"--{flag.replace('_', '-')} {value}: no such file")


#: the roles that only read a job: they read an ended job from its stored stream
READERS = frozenset({"cli"})


def bus_options(
    args: argparse.Namespace,
    *,
    name: str,
    job: str | None = None,
    daemon: bool = False,
    allow_embedded: bool = False,
    lease_ttl_s: float = 6.0,
    role: str = "cli",
) -> BusOptions:
    """BusOptions from the parsed arguments.

    Without --nats, a CLI command uses the URL that the job's embedded server
    recorded on this machine, with the credentials of `role` that the job wrote
    for its user; a daemon with `allow_embedded` starts one.

    Raises:
        ConfigError: nothing to connect to, or a named file is missing.
    """
    _check_files(args)
    url = args.nats
    embedded_dir = None
    auth_file = getattr(args, "nats_auth", None)
    embedded_config = None
    stored_job = None
    if not url and job is not None:
        if allow_embedded:
            embedded_dir = embedded.job_store(job)
        else:
            url = stored.running_url(job)
            found = embedded.job_dir(job) / "auth" / f"{role}.json"
            if url and not auth_file and found.is_file():
                auth_file = str(found)
            ended = stored.StoredJob.find(job) if not url and role in READERS else None
            shared = stored.shared_url(job) if ended is not None else None
            if shared is not None and stored.answers(shared):
                # a newer run of its name on a shared NATS (a standalone run's start
                # forgets the shared one of an earlier run, `stored.forget_shared`): read
                # there. (One that does not answer: the stored run, as before.)
                ended = None
            if ended is not None:
                # a job that has ended: its stored stream, read on a copy (rove.control.bus.stored)
                # (as the job's launcher: a heartbeat stream, kept in memory, is made anew)
                embedded_dir, stored_job = ended.open(), job
                embedded_config = ended.auth_config
                found_creds = ended.credentials("launcher")
                if not auth_file and found_creds is not None:
                    auth_file = str(found_creds)
    url_from = None
    if not url and embedded_dir is None and job is not None and role in {*READERS, "operator"}:
        # a job a node of this machine ran on a shared NATS: read it (and stop or scale
        # it) there
        url = stored.shared_url(job)
        if url:
            url_from = (
                f"{embedded.job_dir(job) / stored.SHARED_URL} (the NATS the job's node ran "
                "on from this machine; --nats overrides it)"
            )
    if (
        not url
        and embedded_dir is None
        and job is not None
        and role in READERS
        and not embedded.job_dir(job).is_dir()
    ):
        raise UnknownJobError(
            f"no job {job!r} on this machine (nothing under {embedded.job_dir(job)}): "
            "check the name (rove jobs lists them), or pass --nats nats://host:4222 "
            "(or set ROVE_NATS_URL) for a job on a NATS server"
        )
    if not url and embedded_dir is None:
        raise ConfigError(
            "no NATS server to connect to: pass --nats nats://host:4222 or set ROVE_NATS_URL "
            + (f"(no embedded server of job {job!r} is running on this machine)" if job else "")
        )
    replicas = args.replicas or (3 if url and len(url.split(",")) >= 3 else 1)
    return BusOptions(
        url=url,
        user=args.nats_user,
        password=args.nats_password,
        token=args.nats_token,
        creds_file=args.nats_creds,
        nkey_seed_file=args.nats_nkey,
        auth_file=auth_file,
        tls_ca_file=args.nats_tls_ca,
        tls_cert_file=args.nats_tls_cert,
        tls_key_file=args.nats_tls_key,
        name=name,
        url_from=url_from or BusOptions.url_from,
        reconnect_forever=daemon,
        replicas=replicas,
        lease_ttl_s=lease_ttl_s,
        embedded_dir=embedded_dir,
        embedded_config=embedded_config,
        stored_job=stored_job,
        **_stream_limits(),
    )


def _stream_limits() -> dict[str, Any]:
    """The event stream's limits from ROVE_EVENTS_MAX_AGE and ROVE_EVENTS_MAX_BYTES."""
    limits: dict[str, Any] = {}
    try:
        if os.environ.get("ROVE_EVENTS_MAX_AGE"):
            limits["events_max_age_s"] = duration(os.environ["ROVE_EVENTS_MAX_AGE"])
        if os.environ.get("ROVE_EVENTS_MAX_BYTES"):
            limits["events_max_bytes"] = byte_size(os.environ["ROVE_EVENTS_MAX_BYTES"])
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"ROVE_EVENTS_MAX_AGE / ROVE_EVENTS_MAX_BYTES: {exc}") from exc
    return limits


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def duration(text: str) -> float:
    """'90s', '5m', '1.5h', '2d', '250ms' or a plain number of seconds -> seconds."""
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: "
            "use a number with an optional unit ms, s, m, h or d (e.g. 10m)"
        )
    return float(m.group(1)) * _UNIT[m.group(2)]


def moment(text: str) -> dt.datetime | float:
    """An ISO-8601 time, or a duration back from now (`duration`). A time that names no
    zone is this machine's local time, as `rove events` and `rove goodput` show times (so
    a time copied from their output means what it said there)."""
    try:
        return duration(text)
    except argparse.ArgumentTypeError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: give a duration back from now (e.g. 10m) or an "
            "ISO-8601 time, local unless it names a zone (e.g. '2026-11-23 10:32:00' or "
            "2026-11-23T10:32:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.astimezone()


def moment_at(when: dt.datetime | float, now: float) -> float:
    """The Unix time of a `moment` (a duration counts back from `now`)."""
    return when.timestamp() if isinstance(when, dt.datetime) else now - when


def add_metrics_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--metrics-port",
        type=port_number,
        default=os.environ.get("ROVE_METRICS_PORT", "").strip() or "0",  # (as --replicas's)
        metavar="PORT",
        help="serve Prometheus metrics on this port, /metrics (default 0: off; env "
        "ROVE_METRICS_PORT)",
    )


def port_number(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"invalid port {text!r} (the flag's, or ROVE_METRICS_PORT's): give a number "
            "from 0 to 65535"
        )
    return port


def replica_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(
            f"invalid replica count {text!r} (the flag's, or ROVE_NATS_REPLICAS's): give 1 "
            "on one server, 3 on a cluster (0: chosen from the URL)"
        )
    return count


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNIT = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'2G', '512Mi', '1.5GiB', '4096' (bytes) -> bytes (binary units: 1G = 2**30)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional unit K, M, G or T "
            "(binary: 1G = 1024M), e.g. 4G"
        )
    unit = (m.group(2) or "").lower()[:1]
    return int(float(m.group(1)) * _SIZE_UNIT[unit])


def process_id() -> str:
    """The default id of a daemon (master, scaler, pool agent): `<short host name>-<pid>`."""
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def add_node_resource_args(g: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    """What a managed job's nodes get: `--node-memory`, `--node-cpu`, `--policy`
    (shared by `rove run --auto-scale` and `rove submit`)."""
    g.add_argument(
        "--node-memory",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="memory limit of each node the scaler starts, e.g. 4G (doubled after an OOM)",
    )
    g.add_argument(
        "--node-cpu",
        type=positive,
        default=None,
        metavar="CPUS",
        help="CPUs of each node the scaler starts (a request for the backend)",
    )
    g.add_argument(
        "--ps-node-memory",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="with --tf-ps: the parameter servers run on nodes of their own, one each, "
        "with this memory (counted in --nnodes)",
    )
    g.add_argument(
        "--ps-node-cpu",
        type=positive,
        default=None,
        metavar="CPUS",
        help="with --tf-ps: CPUs of each parameter server's node",
    )
    g.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an optimiser setting, e.g. --policy settle_s=30 (repeatable; docs/scaling.md)",
    )


async def publish_command(
    args: argparse.Namespace, name: str, make: Callable[[str], ev.Event]
) -> int:
    """Publish an operator's command to job `args.job` (`rove stop`, `rove scale`) and
    return its stream sequence; `make(who)` builds it (`who`: user@host, for its
    producer and reason). An unknown job is an `UnknownJobError`."""
    import getpass

    options = bus_options(args, name=name, job=args.job, role="operator")
    async with await Bus.connect(options) as bus:
        if not await bus.job_exists(args.job):
            raise no_such_job(bus, args.job)
        return await bus.publish(make(f"{getpass.getuser()}@{socket.gethostname()}"))


def nats_flag(bus: Bus) -> str:
    """What a rove command on this machine needs to reach `bus`: nothing for a job's own
    server (found by the job's folder), else ` --nats URL`."""
    return "" if bus.server is not None else f" --nats {bus.url}"


def no_such_job(bus: Bus, job: str) -> UnknownJobError:
    """The error of a reader that found no events of `job` on `bus`."""
    if bus.stored_job:
        return UnknownJobError(
            f"job {job!r} has ended, and its stored events under "
            f"{embedded.job_dir(job) / 'nats'} hold none of it: the folder is damaged or "
            "was partly deleted"
        )
    if starting(bus, job):
        return UnknownJobError(
            f"job {job!r} is starting: its server runs and holds no event of it yet; ask "
            "again in a moment"
        )
    return UnknownJobError(f"no events of job {job!r} on {bus.url}; check the job name")


def starting(bus: Bus, job: str) -> bool:
    """Whether `bus` is `job`'s own embedded server, read by its URL (a job whose server
    runs but that has no event yet is starting: its launcher's first line, which names
    `rove status`, comes before the job's first event)."""
    return bus.server is None and not bus.stored_job and embedded.recorded_url(job) == bus.url
