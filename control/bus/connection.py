"""How rove opens a connection to NATS: `BusOptions` made into nats-py's arguments
(servers, credentials, TLS, reconnects), the client's callbacks (what a disconnect, a
reconnect or a refused publish says), and a failed first connection made into rove's
own errors with what to do. `rove.control.bus.client` builds on it.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import nats
import nats.errors
from nats.aio.client import Client as NatsClient

from rove.control.bus import auth
from rove.control.bus import options as bus_options
from rove.control.bus.natsclient import RoveNatsClient
from rove.control.bus.options import BusOptions
from rove.control.errors import BusUnavailableError, ConfigError, NotAuthorizedError, plain
from rove.control.process import logs

log = logs.get("rove.bus")

#: While reconnecting, how often a failed attempt's error is said (each is logged at debug).
AWAY_SAY_S = 60.0

#: The server's answer to a publish or subscription the connection's permissions do not
#: allow.
_DENIED = re.compile(r'permissions violation for (publish|subscription) to "([^"]+)"', re.I)


async def open_client(servers: list[str], o: BusOptions) -> NatsClient:
    state: dict[str, Any] = {"connected": False, "closing": False, "denied": set()}
    # the connection's losses: warnings, unless another process says them (a worker's
    # agent: `BusOptions.says_connection`)
    lost = log.warning if o.says_connection else log.info

    async def on_error(exc: Exception) -> None:
        if "authorization violation" in str(exc).lower():
            state["refused"] = True
        denied = _DENIED.search(str(exc))
        if denied:  # a permanent answer: `publish_raw` raises it instead of retrying
            what, subject = denied.group(1).lower(), denied.group(2)
            state["denied"].add(subject.lower() if what == "publish" else f"sub:{subject.lower()}")
            log.warning(f"the server denied a {what} to this role", subject=subject)
            return
        if not state["connected"] or state["closing"]:
            log.debug("NATS client error", error=plain(exc))
        elif (away := state.get("away_since")) is None:
            lost("NATS client error", error=plain(exc))
        elif (now := time.monotonic()) - state["away_said"] >= AWAY_SAY_S:
            # each reconnect attempt fails with its error: once a minute, not each time
            state["away_said"] = now
            lost(f"still reconnecting to NATS after {now - away:.0f}s", error=plain(exc))
        else:
            log.debug("NATS client error", error=plain(exc))

    async def on_disconnected() -> None:
        if state["connected"] and not state["closing"]:
            state["away_since"] = state["away_said"] = time.monotonic()
            lost("disconnected from NATS; reconnecting", servers=servers)

    async def on_reconnected() -> None:
        away = state.pop("away_since", None)
        log.info(
            "reconnected to NATS",
            server=str(nc.connected_url and nc.connected_url.netloc),
            after_s=None if away is None else round(time.monotonic() - away, 1),
        )
        for listener in list(nc.reconnected):
            listener()

    kwargs: dict[str, Any] = {
        "servers": servers,
        "name": o.name,
        "connect_timeout": o.connect_timeout_s,
        "allow_reconnect": True,
        # Daemons ride out any outage; one-shot commands fail fast and say why.
        "max_reconnect_attempts": -1 if o.reconnect_forever else 3,
        "reconnect_time_wait": 0.5,
        "error_cb": on_error,
        "disconnected_cb": on_disconnected,
        "reconnected_cb": on_reconnected,
        "tls": bus_options.tls_context(o),
        "tls_handshake_first": o.tls_handshake_first,
    }
    if o.user:
        kwargs["user"], kwargs["password"] = o.user, o.password
    if o.token:
        kwargs["token"] = o.token
    if o.creds_file:
        kwargs["user_credentials"] = o.creds_file
    if o.nkey_seed_file:
        kwargs["nkeys_seed"] = o.nkey_seed_file
    if o.inbox_prefix:
        kwargs["inbox_prefix"] = o.inbox_prefix
    if o.auth_file:
        try:
            creds = auth.read(o.auth_file)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if creds.seed:  # (none: the client is its TLS certificate)
            kwargs["nkeys_seed_str"] = creds.seed
        kwargs["inbox_prefix"] = creds.inbox_prefix
    nc = RoveNatsClient()
    nc._rove_state = state  # type: ignore[attr-defined]  # read by quiet_close, denied
    try:
        # The first connection gets one pass over the servers: an
        # unreachable URL is a user error to report, not to wait out.
        await asyncio.wait_for(
            nc.connect(**{**kwargs, "max_reconnect_attempts": 1}),
            timeout=o.connect_timeout_s * max(2, len(servers)) + 1,
        )
    except (TimeoutError, OSError, nats.errors.NoServersError) as exc:
        state["closing"] = True
        await quiet_close(nc)
        if state.get("refused"):
            raise NotAuthorizedError(
                f"the NATS server at {', '.join(servers)} refused these credentials "
                "(authorization violation): give the role's credentials with --nats-auth "
                "(or --nats-user/--nats-password, --nats-creds, --nats-nkey); a standalone "
                "job's are under its job directory (docs/operations.md)"
            ) from exc
        unknown = await _unresolved(servers)
        raise BusUnavailableError(
            f"cannot connect to NATS at {', '.join(servers)}: "
            + (
                f"no address for host {', '.join(unknown)} (the name does not resolve); "
                f"check the host name in {o.url_from}"
                if unknown
                else f"{exc or type(exc).__name__}; check that the server runs and that "
                f"{o.url_from} points at it"
            )
        ) from exc
    except nats.errors.Error as exc:
        state["closing"] = True
        await quiet_close(nc)
        raise BusUnavailableError(
            f"NATS at {', '.join(servers)} refused the connection: {exc}; "
            "check credentials (--nats-user/--nats-creds) and TLS settings"
        ) from exc
    nc.options["max_reconnect_attempts"] = kwargs["max_reconnect_attempts"]
    state["connected"] = True
    return nc


def denied(nc: NatsClient, subject: str, *, subscription: bool = False) -> bool:
    """Whether the server has denied this connection's publishes to `subject` (a
    permanent answer: the publish is not retried), or with `subscription` its
    subscription to it."""
    state = getattr(nc, "_rove_state", {})
    key = f"sub:{subject.lower()}" if subscription else subject.lower()
    return key in state.get("denied", ())


async def quiet_close(nc: NatsClient) -> None:
    """Close `nc`, saying nothing of the errors a closing connection raises."""
    state = getattr(nc, "_rove_state", None)
    if state is not None:
        state["closing"] = True
    if nc.is_closed:
        return
    try:
        await nc.close()
    except (nats.errors.Error, OSError, asyncio.CancelledError):
        pass
    except RuntimeError:
        pass  # uvloop: the transport was already closed under nats-py (the server is gone)


async def _unresolved(servers: list[str]) -> list[str]:
    """The servers' host names that resolve to no address (nats-py says only "no servers
    available for connection" for a misspelt host)."""
    unknown = []
    loop = asyncio.get_running_loop()
    for server in servers:
        host = urlsplit(server).hostname
        if not host:
            continue
        try:
            await asyncio.wait_for(loop.getaddrinfo(host, None), timeout=5.0)
        except socket.gaierror:
            unknown.append(host)
        except (TimeoutError, OSError):
            continue  # (a slow or odd resolver: not said to be the cause)
    return unknown
