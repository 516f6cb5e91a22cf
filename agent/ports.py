"""The ports a node offers its next round: where nothing else on the machine takes them.

A node offers free ports in its join and its heartbeats; a round uses them later (rank
0's rendezvous store, `MASTER_PORT`; one per task of a TensorFlow round). Between the
offer and the round's bind the port must stay free, and a port the kernel hands out
(`bind(0)`) does not: the kernel hands the same range to every outgoing connection on
the machine, and one of them can take the offered port first (the round then fails to
bind and starts again).

So offers come from `OFFER_WIDTH` ports just below the kernel's ephemeral range
(`/proc/sys/net/ipv4/ip_local_port_range`), which it never hands out, and below
Kubernetes' NodePort range (30000-32767), where a Service may listen on every node:
20000-29999 on a machine with Linux's defaults. Only another explicit pick can take one
there, and each pick is random among thousands. Where there is no room below the
ephemeral range (it was widened to start near 1024), offers are the kernel's choice, as
before.
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

#: where Linux says which ports it hands to connections and `bind(0)`
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Linux's default, when that file cannot be read
EPHEMERAL_LOW = 32768
#: Kubernetes' default Service NodePort range (`--service-node-port-range`)
NODE_PORTS = range(30000, 32768)
#: how many ports offers are picked from
OFFER_WIDTH = 10_000
#: the lowest port an offer may be (below: the well-known and the privileged)
LOWEST = 1024
#: picks tried before the rest of the offer is the kernel's choice
TRIES = 100


def offer_range(ephemeral_low: int) -> range:
    """The ports to offer from, given the first port of the kernel's ephemeral range:
    up to `OFFER_WIDTH` ports below it and below the NodePort range, none under
    `LOWEST`. Empty when there is no room."""
    top = min(ephemeral_low, NODE_PORTS.start)
    return range(max(LOWEST, top - OFFER_WIDTH), max(LOWEST, top))


def ephemeral_low() -> int:
    """This machine's first ephemeral port (Linux's default where it cannot say)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def free_ports(addr: str, n: int = 2, within: range | None = None) -> tuple[int, ...]:
    """`n` distinct ports free right now on every address of `addr`'s family, picked at
    random from `within` (default: `offer_range` of this machine). Fewer when the
    machine cannot bind that many."""
    pool = offer_range(ephemeral_low()) if within is None else within
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    held: list[socket.socket] = []
    try:
        for _ in range(TRIES if pool else 0):
            if len(held) == n:
                break
            s = socket.socket(family)
            try:
                s.bind(("", random.choice(pool)))
            except OSError:
                s.close()
                continue
            held.append(s)
        while len(held) < n:  # a crowded range: the kernel's choice for the rest
            s = socket.socket(family)
            s.bind(("", 0))
            held.append(s)
    except OSError:
        pass  # no socket of that family on this machine: what was found
    finally:
        ports = tuple(int(s.getsockname()[1]) for s in held)
        for s in held:
            s.close()
    return ports


def taken(port: int, addr: str = "") -> bool:
    """Whether some process holds `port` on every address of `addr`'s family (IPv4
    without one), as a server listening there would find it: a round's store, a
    TensorFlow task's server."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        try:
            s.bind(("", port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False
