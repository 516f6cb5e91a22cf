"""Who may do what on the bus: rove's roles as NATS permissions, and their credentials.

Every role reads what it needs (the JetStream API's read calls, ordered
consumers, direct gets) and writes only its own subjects of one job `J`:

    role       publishes                                    used by
    admin      everything                                   operators (`rove auth init` prints it)
    master     rove.ev.J.>  rove.ans.J.>  rove.snap.J,      `rove master`
               its lease key,
               snapshots, stream and bucket creation
    launcher   master's (and agent N's)                     `rove run --standalone` (all in one)
    agent N    rove.ev.J.node.N  rove.hb.J.N                `rove run --node-id N`
    trainer    rove.ev.J.data.<dataset>                     the workers' data clients
    bridge     rove.ev.J.data.<dataset>                     `rove kafka-bridge`
    scaler     rove.ev.J.scaler(.*.part.*), the pool registry `rove scaler`
    operator   rove.ev.J.cmd                                `rove stop`, `rove submit`
    cli        nothing                                      `rove status`, `rove events`

So an agent's credentials cannot forge a master decision, another node's facts,
a snapshot or a stop, and a trainer cannot forge the master's answers (leases go
to `rove.ans.J.<dataset>.<client>`, refusals to `rove.ev.J.data.<dataset>.<client>`,
one token deeper than it may write).
No role but admin may delete or purge a stream. Each role has its own inbox
prefix and may subscribe only to it, so no role reads another's replies.

What the roles cannot restrict: what a role *reads*. nats-py creates ordered
consumers through `$JS.API.CONSUMER.CREATE.<stream>`, with no filter in the
subject, so a holder of any role can read every job's events in the streams.

Credentials are nkeys. A role's credentials file (JSON, mode 0600) holds its
seed and inbox prefix; the server's configuration lists only public keys.
`embedded_job` makes a whole set for a `--standalone` job, so that its server
accepts no one else; `rove auth init` makes one for a cluster.

With TLS `verify_and_map`, a client is its certificate instead: the server maps
the certificate's email SAN (`identity`, e.g. `agent-n0@j1`) to the role's
user, and the credentials file holds no seed, only the inbox prefix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nkeys

from rove.control.catalogue import subjects

ROLES = (
    "admin",
    "master",
    "launcher",
    "agent",
    "trainer",
    "bridge",
    "scaler",
    "operator",
    "cli",
)

#: What every role may call to read: stream and consumer info, ordered consumers,
#: direct and stored message gets, flow control.
READ = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.API.CONSUMER.MSG.NEXT.>",
    "$JS.ACK.>",
    "$JS.FC.>",
)
#: Never but for admin: losing the job's history or its state.
DESTROY = (
    "$JS.API.STREAM.DELETE.>",
    f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
    f"$JS.API.STREAM.MSG.DELETE.{subjects.EVENTS_STREAM}",
)


class Credentials(msgspec.Struct, frozen=True, kw_only=True):
    """One role's credentials: its nkey seed (secret) and inbox prefix."""

    role: str
    job: str = ""
    node: str = ""
    seed: str = ""  # none when the client is its TLS certificate (verify_and_map)
    inbox_prefix: str

    @property
    def public_key(self) -> str:
        pair = nkeys.from_seed(bytearray(self.seed.encode()))
        try:
            return str(pair.public_key.decode())
        finally:
            pair.wipe()


def identity(creds: Credentials) -> str:
    """The user a client certificate maps to (its email SAN) with `verify_and_map`."""
    who = "-".join(x for x in (creds.role, creds.node) if x)
    return f"{who}@{creds.job or 'rove'}"


def new_credentials(role: str, job: str = "", node: str = "") -> Credentials:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()
    who = "-".join(x for x in (role, node) if x)
    return Credentials(role=role, job=job, node=node, seed=seed, inbox_prefix=f"_INBOX_{who}")


def write_private(path: Path, data: bytes) -> Path:
    """Write `path` readable by this user only: created 0600 under a temporary name,
    then renamed, so it is never readable by others nor seen half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    tmp.replace(path)
    return path


def write(creds: Credentials, path: Path) -> Path:
    """Write `creds` readable by this user only."""
    return write_private(path, msgspec.json.encode(creds))


def read(path: str | Path) -> Credentials:
    """Raises: ValueError naming the file when it is not a rove credentials file."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Credentials)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path} is not a readable rove credentials file: {exc}") from exc


def permissions(creds: Credentials) -> dict[str, Any]:
    """The NATS permissions of `creds`' role (for its job and node)."""
    job, node, role = creds.job, creds.node, creds.role
    subscribe = {"allow": [f"{creds.inbox_prefix}.>"]}
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    if role in ("master", "launcher", "scaler", "agent", "trainer", "bridge", "operator"):
        subjects.check_name("job", job)
    writes: list[str] = []
    if role in ("master", "launcher"):
        writes += [
            f"{subjects.EVENTS_ROOT}.{job}.>",
            f"{subjects.ANSWER_ROOT}.{job}.>",
            subjects.snapshot(job),
            f"$KV.{subjects.LEASE_BUCKET}.{subjects.lease_key(job)}",
            f"$O.{subjects.SNAPSHOT_OBJECTS}.>",
            "$JS.API.STREAM.CREATE.>",
            "$JS.API.STREAM.UPDATE.>",
            f"$JS.API.STREAM.PURGE.OBJ_{subjects.SNAPSHOT_OBJECTS}",
        ]
    if role in ("master", "launcher"):
        # the leader hears heartbeats live on a core subscription (rove.control.bus.live)
        subscribe["allow"].append(subjects.job_heartbeats(job))
    if role == "agent" or (role == "launcher" and node):
        writes += [subjects.node_facts(job, node), subjects.heartbeat(job, node)]
    if role in ("trainer", "bridge"):
        writes.append(f"{subjects.EVENTS_ROOT}.{job}.data.*")
    if role == "scaler":
        writes += [
            subjects.scaler(job),
            f"{subjects.scaler(job)}.*.part.*",  # its facts' parts, when they are large
            "$KV.rove_pool.>",
            "$JS.API.STREAM.CREATE.KV_rove_pool",
        ]
    if role == "operator":
        writes.append(subjects.cmd(job))
    return {
        "publish": {"allow": [*READ, *writes], "deny": list(DESTROY)},
        "subscribe": subscribe,
    }


@dataclass(frozen=True)
class Tls:
    """Server TLS files; `verify` asks clients for a certificate signed by `ca`."""

    cert: Path
    key: Path
    ca: Path
    verify: bool = False
    #: clients are their certificates: each maps (email SAN) to its role's user
    verify_and_map: bool = False


def server_config(users: list[Credentials], *, tls: Tls | None = None) -> str:
    """nats-server configuration: `authorization` with a user per role (and `tls` when
    given), one `key: value` line each (JSON values are NATS syntax), so that another
    configuration can `include` it."""
    mapped = tls is not None and tls.verify_and_map
    block: dict[str, Any] = {
        "authorization": {
            "users": [
                {"user": identity(c), "permissions": permissions(c)}
                if mapped
                else {"nkey": c.public_key, "permissions": permissions(c)}
                for c in users
            ]
        }
    }
    if tls is not None:
        block["tls"] = {
            "cert_file": str(tls.cert),
            "key_file": str(tls.key),
            "ca_file": str(tls.ca),
            "verify": tls.verify or tls.verify_and_map,
        }
        if mapped:
            block["tls"]["verify_and_map"] = True
    lines = [f"{key}: {json.dumps(value)}" for key, value in block.items()]
    head = "# rove: generated by rove.control.bus.auth; the roles and why: docs/operations.md"
    return "\n".join([head, *lines, ""])


@dataclass(frozen=True)
class JobAuth:
    """A standalone job's credentials: the server's config and a file per role."""

    config: Path
    launcher: Path
    trainer: Path
    operator: Path
    cli: Path


def embedded_job(directory: Path, job: str, node: str = "") -> JobAuth:
    """Fresh credentials for a `--standalone` job (its launcher, workers and CLI), and
    the configuration that makes its embedded server accept only them. The launcher
    is the job's master (and scaler), and agent `node` when it runs one (an auto-scaled
    job's nodes get theirs from `add_agent` as they are launched)."""
    roles = {
        "launcher": new_credentials("launcher", job, node),
        "trainer": new_credentials("trainer", job),
        "operator": new_credentials("operator", job),
        "cli": new_credentials("cli", job),
    }
    for stale in directory.glob("agents/*.json"):
        stale.unlink()  # an earlier run's nodes
    paths = {name: write(c, directory / f"{name}.json") for name, c in roles.items()}
    return JobAuth(config=_write_config(directory), **paths)


def add_agent(directory: Path, job: str, node: str) -> tuple[Path, Path]:
    """Credentials for agent `node` of the job whose set is in `directory`, added to its
    server configuration: (the node's credentials file, the configuration). The server
    accepts them once it reloads the configuration (`EmbeddedServer.reload`)."""
    path = write(new_credentials("agent", job, node), directory / "agents" / f"{node}.json")
    return path, _write_config(directory)


def _write_config(directory: Path) -> Path:
    """`nats-auth.conf` for every credentials file of the set in `directory`."""
    users = [read(p) for p in sorted([*directory.glob("*.json"), *directory.glob("agents/*.json")])]
    return write_private(directory / "nats-auth.conf", server_config(users).encode())
