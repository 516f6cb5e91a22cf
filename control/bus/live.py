"""Messages as they are published, the cheapest way: a core NATS subscription whose
messages are handed straight from the protocol parser.

For a flood that the reader only needs the newest of (the leader's heartbeats:
25,000 a second at 25,000 nodes). No stream sequence, nothing stored is replayed, and
what is published while the client reconnects is missed: a reader that needs that
reads the stream's newest on `on_reconnected`. A heartbeat costs its reader 9 µs this
way and 19 µs through a JetStream consumer (`benchmarks/heartbeat_path.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

import nats.errors

from rove.control.bus import connection
from rove.control.bus.client import Bus
from rove.control.bus.natsclient import RoveNatsClient
from rove.control.errors import PermissionDeniedError

#: Round trips after subscribing in which a server's refusal is looked for.
_ROUND_TRIPS = 3


async def listen(
    bus: Bus, subject_filter: str, on_message: Callable[[str, bytes], None]
) -> Callable[[], Awaitable[None]]:
    """Hand each message published from now on under `subject_filter` to
    `on_message(subject, payload)`; returns the function that stops.

    Raises:
        PermissionDeniedError: the server refused the subscription (this role may not
            read the subject: a server refuses it only in an asynchronous error, which
            one of the next few round trips brings).
    """
    nc = bus.nc
    assert isinstance(nc, RoveNatsClient)
    sub = await nc.subscribe(subject_filter)
    for _ in range(_ROUND_TRIPS):  # the refusal can follow the first round trip's answer
        await nc.flush()
        if connection.denied(nc, subject_filter, subscription=True):
            break
    if connection.denied(nc, subject_filter, subscription=True):
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()
        raise PermissionDeniedError(
            f"the server refused a subscription to {subject_filter}: these credentials' "
            "role may not read it (roles and their subjects: docs/operations.md)"
        )

    async def on_raw(subject: bytes, _reply: bytes, data: bytes, _h: bytes | None) -> None:
        on_message(subject.decode(), data)

    nc.raw_deliveries[sub._id] = on_raw

    async def stop() -> None:
        nc.raw_deliveries.pop(sub._id, None)
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()

    return stop


def on_reconnected(bus: Bus, listener: Callable[[], None]) -> Callable[[], None]:
    """Call `listener()` each time `bus` has reconnected; returns the function that
    stops it."""
    nc = bus.nc
    assert isinstance(nc, RoveNatsClient)
    nc.reconnected.append(listener)

    def stop() -> None:
        if listener in nc.reconnected:
            nc.reconnected.remove(listener)

    return stop


#: Seconds the event loop ran nothing that say this process was paused: stopped
#: (SIGSTOP, a terminal's Ctrl-Z), its machine frozen or starved, or held by a call.
#: Real seconds (`time.monotonic`), whatever clock the owner decides with.
PAUSED_S = 5.0
#: How often the loop stamps that it runs (`Hearing`).
BEAT_S = 0.25


class Hearing:
    """Since when a client has been able to hear live messages: its last reconnection,
    or now while it is away (nothing published meanwhile reached it), or its wake from
    a pause (nothing it could hear was read meanwhile). A leader counts a node's silence
    only from then: its own deafness is not the node's.

    A pause is the event loop running nothing for `PAUSED_S`: a callback of its own
    stamps the time every `BEAT_S`, and each ask looks at the stamp too (after a pause
    the leader's tick may run before the stamp's callback). It used to be the time
    between two asks, and a leader whose ticks took over `PAUSED_S` with the loop free
    (awaiting a slow publish; heartbeats read meanwhile) heard every node afresh at each
    tick: none could ever be found lost."""

    def __init__(self, bus: Bus, clock: Callable[[], float]) -> None:
        self._bus, self._clock = bus, clock
        self._since = clock()
        self._reconnects = self._count()
        self._stamp = time.monotonic()
        self._unhook = on_reconnected(bus, self._back)
        self._beat: asyncio.TimerHandle | None = None
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:  # (asked from no loop: each ask stamps alone)
            self._loop = None
        self._beats()

    def _count(self) -> int:
        return int(self._bus.nc.stats["reconnects"])

    def _back(self) -> None:
        self._since = self._clock()

    def _ran(self) -> None:
        """The loop runs now: after a pause, nothing before now was heard."""
        stamp, self._stamp = self._stamp, time.monotonic()
        if self._stamp - stamp > PAUSED_S:
            # (a standalone job's master woke from a Ctrl-Z that stopped its node too,
            # and declared that node lost for its own pause: a needless new round)
            self._since = self._clock()

    def _beats(self) -> None:
        self._ran()
        if self._loop is not None:
            self._beat = self._loop.call_later(BEAT_S, self._beats)

    def since(self) -> float:
        # (nats-py counts a reconnection, then is connected, then flushes, and only then
        # calls back: a leader's tick in between must not see the time before it)
        reconnects = self._count()
        if not self._bus.nc.is_connected or reconnects != self._reconnects:
            self._since, self._reconnects = self._clock(), reconnects
        self._ran()
        return self._since

    def close(self) -> None:
        self._unhook()
        if self._beat is not None:
            self._beat.cancel()
            self._beat = None
