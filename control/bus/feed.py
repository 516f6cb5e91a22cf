"""A running subscription (`Feed`), the watchdog that heals it when it stalls, and how
a process says it rejected stored messages (`RejectionLog`).

`Bus.subscribe` returns a `Feed`: nats-py's ordered consumer with the sequence
it has delivered up to, an event set once the backlog is delivered, and a
watchdog that resubscribes from the next sequence if the consumer stops
delivering while its stream holds newer messages (`stalled`, pure).

The watchdog also notices a stream made anew under the same name: a memory stream
(the leases' answers) is lost when its server restarts, and the new one numbers its
messages from 1 again, which a feed skipping what it has delivered by sequence would
never read. After each reconnection (`recheck`), and when the stream's newest message
is older than the feed's, it asks the stream's leader when the stream was created and
its newest sequence (`StreamMark`), and reads the stream from its start if it is a new
one, or the same one numbering from 1 again: a cluster all of whose servers restarted
keeps a memory stream's definition, creation time included, and loses its messages.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.errors
import nats.js.errors

from rove.control.bus import records
from rove.control.errors import RoveError, plain
from rove.control.process import aio, logs

log = logs.get("rove.bus")


#: A feed that has not moved for this many checks while its stream holds newer
#: messages for it is resubscribed (`Feed.watch`).
STALL_CHECKS = 3
#: Seconds between two of those checks.
STALL_CHECK_S = 5.0
#: Seconds between two looks at a stream that did not answer after a reconnection (a
#: cluster whose every server restarted elects its streams' leaders a few seconds later).
RECHECK_S = 1.0


def stalled(history: list[int], newest: int, checks: int = STALL_CHECKS) -> bool:
    """Whether a feed is stuck: its last delivered sequence was the same at each of the
    last `checks` checks (`history`, oldest first) while the stream has `newest` > it."""
    recent = history[-checks:]
    return len(recent) == checks and len(set(recent)) == 1 and newest > recent[-1]


@dataclass(frozen=True)
class StreamMark:
    """A stream as its leader describes it: when it was created, its newest sequence."""

    created: object
    last_seq: int


@dataclass
class Feed:
    """A running subscription; `caught_up` is set once the backlog has been delivered."""

    sub: Any
    target_seq: int
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)
    last_seq: int = 0
    resubscribed: int = 0
    watchdog: asyncio.Task[None] | None = None
    #: when the stream this feed reads was created (None: not known)
    created: object | None = None
    #: times the stream was found made anew and read from its start
    renewed: int = 0
    #: set after a reconnection: the next check compares the stream's creation time
    recheck: bool = False
    #: `sub` was unsubscribed and no new one could be made yet (the next look makes one)
    unsubscribed: bool = False
    #: the first exception a handler raised that is not a `RoveError` (a bug)
    error: BaseException | None = None
    #: set with `error`: a one-shot reader waits for `caught_up` or this (`settled`)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _told: list[Callable[[], None]] | None = None

    def handler_failed(self, exc: BaseException, stream: str, seq: int, subject: str) -> None:
        """A handler raised `exc` on message `seq`: say it with its traceback and what it
        was reading (a long-lived reader goes on with the next message), and keep it for
        a reader that waits (`settled`)."""
        log.error(
            "a handler failed on a message; skipped",
            stream=stream,
            seq=seq,
            subject=subject,
            exc_info=exc,
        )
        if self.error is None:
            self.error = exc
        self.failed.set()

    async def settled(self) -> None:
        """Wait until the backlog is delivered; raise what a handler raised meanwhile (a
        reader whose handler fails would otherwise wait for ever, or read a hole)."""
        with contextlib.suppress(aio.Stopped):
            await aio.unless(self.failed, self.caught_up.wait())
        if self.error is not None:
            raise self.error

    def hear_reconnections(self, listeners: list[Callable[[], None]]) -> None:
        """Be told of each reconnection (`listeners`: the client's, until `stop()`)."""
        listeners.append(self.reconnected)
        self._told = listeners

    def reconnected(self) -> None:
        """The connection is back: the stream may be another one now (its server
        restarted); the watchdog checks at once."""
        self.recheck = True
        self._wake.set()

    async def watch(
        self,
        newest: Callable[[], Awaitable[int]],
        resubscribe: Callable[[int], Awaitable[Any]],
        created: Callable[[], Awaitable[StreamMark | None]],
        *,
        what: str,
        every_s: float = STALL_CHECK_S,
    ) -> None:
        """Resubscribe from the next sequence when this feed stalls (`stalled`), and
        from the start (`resubscribe(0)`) of a stream made anew (`created()`: its
        creation time differs from the feed's, or its newest sequence is older than
        the feed's; None while it is not there).

        nats-py's ordered consumer heals itself after missed heartbeats, but not
        when recreating its consumer fails and the healing task dies with it: a
        master or agent would then follow a frozen stream, alive and silent.
        Messages delivered twice across the switch are skipped by sequence.
        """
        history: list[int] = []
        while True:
            wait_s = min(every_s, RECHECK_S) if self.recheck else every_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), wait_s)
            self._wake.clear()
            try:
                if self.recheck:
                    await self._renew(created, resubscribe, what)
                history = await self._check(history, newest, resubscribe, what)
            except Exception:  # a watchdog that dies would leave its feed unwatched
                log.exception("the feed's stall check failed; checking again", feed=what)
                history = []

    async def _renew(
        self,
        created: Callable[[], Awaitable[StreamMark | None]],
        resubscribe: Callable[[int], Awaitable[Any]],
        what: str,
    ) -> None:
        """Read the stream from its start if it is another one than the feed's, or the
        same one numbering its messages from 1 again."""
        try:
            mark = await created()
        except (RoveError, nats.errors.Error, nats.js.errors.Error, TimeoutError):
            return  # asked again at the next check
        if mark is None:
            return  # not there (yet): whoever keeps the streams makes it again
        self.recheck = False
        same = self.created is None or mark.created == self.created
        if same and mark.last_seq >= self.last_seq:
            self.created = mark.created
            await self._resume_if_lost(resubscribe, what)
            return
        log.warning(
            "the stream was made anew (a memory stream whose server restarted, or every "
            "server of its cluster; or one deleted): reading it from its start",
            feed=what,
            delivered=self.last_seq,
            stream_has=mark.last_seq,
        )
        await unsubscribe(self.sub)  # (its messages' numbers mean nothing now)
        delivered, self.last_seq = self.last_seq, 0
        try:
            self.sub = await resubscribe(0)
        except BaseException:
            # not subscribed now (a server restarting again while the new one was being
            # made): the next look decides again, from what was delivered
            self.last_seq, self.recheck, self.unsubscribed = delivered, True, True
            raise
        self.unsubscribed = False
        self.created = mark.created
        self.renewed += 1

    async def _resume_if_lost(
        self, resubscribe: Callable[[int], Awaitable[Any]], what: str
    ) -> None:
        """The same stream: if its server lost the feed's consumer (a restart loses the
        ephemeral ones), resubscribe from the next sequence now, not after the stall
        checks (15 s) or nats-py's own healing, which may fail."""
        try:
            if not self.unsubscribed:
                await self.sub.consumer_info()
                return
        except nats.js.errors.NotFoundError:
            pass
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
            self.recheck = True  # asked again at the next check
            return
        log.info(
            "the feed's consumer was lost with its server: resubscribing",
            feed=what,
            delivered=self.last_seq,
        )
        if not await self._resubscribe_next(resubscribe, what):
            self.recheck = True  # still without a consumer: the next check tries again

    async def _check(
        self,
        history: list[int],
        newest: Callable[[], Awaitable[int]],
        resubscribe: Callable[[int], Awaitable[Any]],
        what: str,
    ) -> list[int]:
        """One stall check; returns the history of delivered sequences to keep."""
        history = [*history[-(STALL_CHECKS - 1) :], self.last_seq]
        if len(history) < STALL_CHECKS or len(set(history)) > 1:
            return history
        try:
            ahead = await newest()
        except RoveError:
            return history
        if ahead < self.last_seq:  # the stream is behind the feed: made anew?
            self.recheck = True
            return []
        if not stalled(history, ahead):
            return history
        log.warning(
            "subscription stalled: resubscribing",
            feed=what,
            delivered=self.last_seq,
            stream_has=ahead,
        )
        return [] if await self._resubscribe_next(resubscribe, what) else history

    async def _resubscribe_next(
        self, resubscribe: Callable[[int], Awaitable[Any]], what: str
    ) -> bool:
        """Subscribe again from the sequence after the last delivered, then drop the old
        subscription; False (said) if the new one could not be made."""
        old = self.sub
        try:
            self.sub = await resubscribe(self.last_seq + 1)
        except (RoveError, nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("could not resubscribe; will try again", feed=what, error=plain(exc))
            return False
        self.resubscribed += 1
        self.unsubscribed = False
        await unsubscribe(old)
        return True

    async def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self._told is not None and self.reconnected in self._told:
            self._told.remove(self.reconnected)
        await unsubscribe(self.sub)


async def unsubscribe(sub: Any) -> None:
    try:
        await sub.unsubscribe()
    except (nats.errors.ConnectionClosedError, nats.errors.BadSubscriptionError):
        pass


async def nothing_since(feed: Feed, target: int) -> None:
    """A feed starting at a time that has nothing to deliver from there is caught up,
    and stands at the stream's last message (what it holds is all older than its start).
    Nothing to deliver means the server sent nothing either: a message sent whose
    handler has not finished is not pending any more, and handled not yet (the feed
    said it had caught up before handling it: `rove events --since` printed nothing)."""
    try:
        info = await feed.sub.consumer_info()
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
        return  # not known: the first message (or the watchdog) settles it
    sent = info.delivered.consumer_seq if info.delivered is not None else 0
    if info.num_pending == 0 and not sent and feed.last_seq == 0:
        feed.last_seq = target
        feed.caught_up.set()


class RejectionLog:
    """How a process says it rejected stored messages: each message once, however many
    of its feeds read it, and a flood in a few lines. The first rejection from a sender
    (a subject) is logged with its error; after that, one line per sender every
    `every_s` with how many more there were."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.clock = clock
        self._seen: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()
        self._said: dict[str, tuple[float, int]] = {}  # subject -> (when, not said since)

    def saw(self, rej: records.Rejection) -> None:
        key = (rej.stream, rej.seq)
        if key in self._seen:
            return  # another feed of this process read it already
        self._seen[key] = None
        if len(self._seen) > 100_000:
            self._seen.popitem(last=False)
        now = self.clock()
        when, unsaid = self._said.get(rej.subject, (float("-inf"), 0))
        if now - when < self.every_s:
            self._said[rej.subject] = (when, unsaid + 1)
            return
        self._said[rej.subject] = (now, 0)
        more = f" (and {unsaid} more from it since the last line)" if unsaid else ""
        log.warning(
            f"rejected a stored message{more}",
            stream=rej.stream,
            seq=rej.seq,
            subject=rej.subject,
            error=rej.error,
        )
