"""`rove auth init`: a job's NATS users and their credentials, for a server you run.

    rove auth init --job j1 --nodes n0,n1 --out auth/
    rove auth init --job j1 --nodes n0,n1 --out auth/ --tls-cert server.pem \\
        --tls-key server.key --tls-ca ca.pem --verify-and-map

It writes `nats-auth.conf` (include it in the server's configuration, or start
`nats-server -c` with it) and one credentials file per role (mode 0600: hand
each to the process of that role with `--nats-auth FILE`). What each role may
do is in `rove.control.bus.auth` and docs/operations.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from msgspec.structs import replace

from rove.control.bus import auth
from rove.control.catalogue import subjects
from rove.control.errors import ConfigError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auth", help="make a job's NATS users and credentials", description=__doc__)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    init = verbs.add_parser("init", help="write nats-auth.conf and a credentials file per role")
    init.add_argument("--job", required=True, help="job name")
    init.add_argument(
        "--nodes", default="", help="the nodes' names, comma-separated (an agent user each)"
    )
    init.add_argument("--out", default="rove-auth", help="directory to write (default rove-auth)")
    init.add_argument("--tls-cert", help="the server's certificate (adds a tls block)")
    init.add_argument("--tls-key", help="the server's key")
    init.add_argument("--tls-ca", help="the CA that signs client certificates")
    init.add_argument(
        "--verify-and-map",
        action="store_true",
        help="clients are their certificates: each role's maps by email SAN (ROLE[-NODE]@JOB)",
    )
    init.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    job = subjects.check_name("job", args.job)
    nodes = [subjects.check_name("node", n.strip()) for n in args.nodes.split(",") if n.strip()]
    tls_files = (args.tls_cert, args.tls_key, args.tls_ca)
    if any(tls_files) and not all(tls_files):
        raise ConfigError("--tls-cert, --tls-key and --tls-ca go together")
    if args.verify_and_map and not all(tls_files):
        raise ConfigError("--verify-and-map needs TLS: give --tls-cert, --tls-key and --tls-ca")
    tls = (
        auth.Tls(
            Path(args.tls_cert),
            Path(args.tls_key),
            Path(args.tls_ca),
            verify_and_map=args.verify_and_map,
        )
        if all(tls_files)
        else None
    )
    roles = [
        auth.new_credentials("admin"),
        auth.new_credentials("master", job),
        auth.new_credentials("scaler", job),
        auth.new_credentials("bridge", job),
        auth.new_credentials("trainer", job),
        auth.new_credentials("operator", job),
        auth.new_credentials("cli", job),
        *(auth.new_credentials("agent", job, n) for n in nodes),
    ]
    if args.verify_and_map:
        roles = [replace(c, seed="") for c in roles]
    out = Path(args.out)
    lines = []
    for c in roles:
        name = "-".join(x for x in (c.role, c.node) if x)
        path = auth.write(c, out / f"{name}.json")
        who = f"certificate {auth.identity(c)}" if args.verify_and_map else "nkey"
        lines.append(f"  {path}  ({who})")
    config = auth.write_private(out / "nats-auth.conf", auth.server_config(roles, tls=tls).encode())
    print(f"{config}: the server's users (include it, or nats-server -c {config})")
    print("credentials, one per role (give each with --nats-auth FILE):")
    print("\n".join(lines))
    return 0
