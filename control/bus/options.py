"""How to reach NATS: `BusOptions`, and how they travel to child processes.

`BusOptions` says where the servers are and which credentials and TLS files
to use (`Bus.connect` takes them). `options_env` hands them to a child process
(a worker) without putting a secret in its environment; `options_from_env`
reads them back there. `closed` gives a standalone job's embedded server
credentials of its own (docs/operations.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rove.control.bus import auth, embedded
from rove.control.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class BusOptions:
    """How to reach NATS and how to lay out the streams.

    `url` may list several servers separated by commas. With no `url`, an
    embedded server is started with its store under `embedded_dir`.
    """

    url: str | None = None
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    #: rove's own credentials file (`rove.control.bus.auth`: nkey seed and inbox prefix)
    auth_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_handshake_first: bool = False
    inbox_prefix: str | None = None
    name: str = "rove"
    #: where `url` came from, named when it cannot be reached
    url_from: str = "--nats / ROVE_NATS_URL"
    connect_timeout_s: float = 5.0
    reconnect_forever: bool = False
    #: whether the connection's losses and errors are warnings; a worker's data client
    #: under a rove agent leaves them to its agent (info), which says them once a node
    #: instead of once a rank
    says_connection: bool = True
    replicas: int = 1
    lease_ttl_s: float = 6.0
    duplicate_window_s: float = 120.0
    embedded_dir: Path | None = None
    #: a configuration file for the embedded server (its users and permissions)
    embedded_config: Path | None = None
    create_streams: bool = True
    #: `embedded_dir` is a scratch copy of this ended job's stored stream
    #: (`rove.control.bus.stored`): read only, and deleted when the bus closes
    stored_job: str | None = None
    #: How long the event stream keeps events, when it is created (env ROVE_EVENTS_MAX_AGE):
    #: older ones are retired, the jobs they belong to long over (docs/operations.md).
    events_max_age_s: float = 30 * 86400.0
    #: The most bytes the event stream keeps, oldest dropped first (-1: JetStream's own
    #: limit only; env ROVE_EVENTS_MAX_BYTES)
    events_max_bytes: int = -1


#: The environment variables that carry how to reach NATS (`rove` CLI flags read them too).
_ENV_OF_OPTION: dict[str, str] = {
    "user": "ROVE_NATS_USER",
    "password": "ROVE_NATS_PASSWORD",
    "token": "ROVE_NATS_TOKEN",
    "creds_file": "ROVE_NATS_CREDS",
    "nkey_seed_file": "ROVE_NATS_NKEY",
    "auth_file": "ROVE_NATS_AUTH",
    "tls_ca_file": "ROVE_NATS_TLS_CA",
    "tls_cert_file": "ROVE_NATS_TLS_CERT",
    "tls_key_file": "ROVE_NATS_TLS_KEY",
}


#: What is secret among them: handed to children in a file, never in their environment.
_SECRET_OPTIONS = ("password", "token")
#: The file with the secrets (`options_env`), readable by this user only.
SECRETS_ENV = "ROVE_NATS_SECRETS"


def options_env(options: BusOptions, url: str, secrets_dir: Path) -> dict[str, str]:
    """Environment for a child process (a worker) to reach the same NATS as `options`.

    Files (credentials, nkey seeds, TLS) are named by path; a password or token is
    written to `secrets_dir/nats-secrets.json` (mode 0600) and only that path is in
    the environment, so no secret shows in `/proc/<pid>/environ`."""
    env = {"ROVE_NATS_URL": url}
    secrets = {}
    for option, var in _ENV_OF_OPTION.items():
        value = getattr(options, option)
        if not value:
            continue
        if option in _SECRET_OPTIONS:
            secrets[option] = str(value)
        else:
            env[var] = str(value)
    if secrets:
        path = auth.write_private(secrets_dir / "nats-secrets.json", json.dumps(secrets).encode())
        env[SECRETS_ENV] = str(path)
    return env


def closed(options: BusOptions, job: str, node: str = "") -> tuple[BusOptions, auth.JobAuth | None]:
    """`options` for a standalone job's embedded server closed to everyone but this job:
    fresh credentials for the launcher (master, and agent `node` or the scaler), the
    workers and the CLI, each in a file only this user can read (docs/operations.md).
    Unchanged (and no set) when credentials were given, or the server is not embedded:
    the server is then the operator's to configure."""
    given = (options.user, options.token, options.creds_file, options.nkey_seed_file)
    if options.url is not None or any(given) or options.auth_file:
        return options, None
    job_auth = auth.embedded_job(embedded.job_dir(job) / "auth", job, node)
    options = dataclasses.replace(
        options, auth_file=str(job_auth.launcher), embedded_config=job_auth.config
    )
    return options, job_auth


def options_from_env(url: str, **overrides: Any) -> BusOptions:
    """BusOptions for `url` with the credentials and TLS files of the environment."""
    found: dict[str, Any] = {
        f: os.environ[v] for f, v in _ENV_OF_OPTION.items() if os.environ.get(v)
    }
    secrets = os.environ.get(SECRETS_ENV)
    if secrets:
        try:
            found.update(json.loads(Path(secrets).read_text()))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{SECRETS_ENV}={secrets}: cannot read it ({exc})") from exc
    return BusOptions(url=url, **{**found, **overrides})


def tls_context(o: BusOptions) -> ssl.SSLContext | None:
    """The TLS context `o`'s files make, or None (no TLS files: TLS only if the URL asks)."""
    if not (o.tls_ca_file or o.tls_cert_file):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=o.tls_ca_file)
    if o.tls_cert_file:
        ctx.load_cert_chain(o.tls_cert_file, o.tls_key_file)
    return ctx


def servers(url: str) -> list[str]:
    """The server URLs of `url` (comma-separated), checked.

    Raises:
        ConfigError: a URL without a scheme, with one NATS does not speak, or none.
    """
    servers = [u.strip() for u in url.split(",") if u.strip()]
    for s in servers:
        if "://" not in s:
            raise ConfigError(
                f"invalid NATS URL {s!r}: expected a form like nats://host:4222 "
                "(or tls://host:4222); pass it with --nats or ROVE_NATS_URL"
            )
        scheme = s.split("://", 1)[0]
        if scheme not in {"nats", "tls", "ws", "wss"}:
            raise ConfigError(f"invalid NATS URL {s!r}: scheme must be nats, tls, ws or wss")
    if not servers:
        raise ConfigError("empty NATS URL: pass --nats nats://host:4222 or set ROVE_NATS_URL")
    return servers
