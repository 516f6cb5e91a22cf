"""The bus client: the only way rove's parts talk to each other.

`Bus.connect(options)` connects to `options.url` (user/password, token,
nkeys, creds files and TLS supported) or, with no URL, starts an embedded
`nats-server -js` and stops it on `close()`. It then creates the streams and
the lease bucket idempotently.

Publishing uses the event id as `Nats-Msg-Id`, so a retry after a timeout or
a JetStream leader change is stored once; retries back off inside one total
deadline. A `Fence` makes a master write conditional on its own election
still being the newest (the server rejects a deposed master's write).
Subscriptions are callback-driven ordered consumers (the fastest replay path
in nats-py); every message is decoded and validated, and bad payloads are
handed to `on_rejected` instead of ever stopping the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    ConsumerConfig,
    DeliverPolicy,
    Header,
    StreamConfig,
)
from nats.js.kv import KeyValue

from rove.control.bus import (
    catchup,
    connection,
    embedded,
    lease_bucket,
    records,
    retry,
    stored,
    streams,
)
from rove.control.bus import options as bus_options
from rove.control.bus.embedded import EmbeddedServer
from rove.control.bus.feed import STALL_CHECK_S, Feed, RejectionLog, StreamMark, nothing_since
from rove.control.bus.natsclient import RoveNatsClient, ack_position, stored_time
from rove.control.bus.options import BusOptions as BusOptions  # (Bus.connect takes them)
from rove.control.catalogue import events as ev
from rove.control.catalogue import parts, subjects
from rove.control.errors import (
    BusUnavailableError,
    ConfigError,
    FencedError,
    PermissionDeniedError,
    RoveError,
    TemporaryError,
)
from rove.control.process import aio, logs, metrics

log = logs.get("rove.bus")

EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
WRONG_LAST_SEQUENCE = 10071


class Busy(Exception):
    """A clustered stream's busy answer that the caller retries itself (not retryable
    here: `retry.backoff` lets it through)."""

    def __init__(self, answer: nats.js.errors.APIError) -> None:
        super().__init__(str(answer))
        self.answer = answer


class Fence(NamedTuple):
    """A master write is accepted only while `subject`'s last sequence is `seq`."""

    subject: str
    seq: int

    def headers(self) -> dict[str, str]:
        return {
            Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value: str(self.seq),
            EXPECTED_LAST_SUBJECT_SEQ_SUBJECT: self.subject,
        }


OnRecorded = Callable[[records.Recorded], Awaitable[None] | None]
OnRejected = Callable[[records.Rejection], Awaitable[None] | None]


class Bus:
    """A connection to NATS JetStream with rove's streams, publishing and consumers."""

    def __init__(
        self,
        nc: NatsClient,
        options: BusOptions,
        server: EmbeddedServer | None = None,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=5.0, publish_async_max_pending=4000)
        self.options = options
        self.server = server
        self.rejections = RejectionLog()
        self._lease_kv: KeyValue | None = None
        #: seconds between two stall checks of each feed (`Feed.watch`)
        self.stall_check_s = STALL_CHECK_S
        self._watchdogs: set[asyncio.Task[None]] = set()
        #: the embedded server's keeper (`embedded.keep`), when this bus started one
        self._keeper: asyncio.Task[None] | None = None
        #: told each time the keeper started the embedded server again (the agent's fact)
        self.server_restarted: list[Callable[[embedded.Restarted], object]] = []
        if server is not None:
            again = self.ensure_streams if options.create_streams else None
            self._keeper = asyncio.create_task(
                embedded.keep(server, again, told=self.server_restarted), name="nats-server keeper"
            )

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(cls, options: BusOptions) -> Bus:
        """Connect (or start an embedded server), then ensure streams exist.

        A daemon (`reconnect_forever`) waits for a server that is down, or a JetStream
        without quorum, however long, saying so once a minute.

        Raises:
            ConfigError: malformed URL or options; refused credentials.
            BusUnavailableError: the server could not be reached in time (not a daemon).
        """
        server: EmbeddedServer | None = None
        url = options.url
        if not url:
            store = options.embedded_dir
            if store is None:
                raise ConfigError("no NATS URL and no directory for an embedded server")
            server = EmbeddedServer(store, config=options.embedded_config)
            try:
                url = await asyncio.to_thread(server.start)
            except BaseException:
                await asyncio.to_thread(server.stop)
                stored.discard_read_copy(options)
                raise
        servers = bus_options.servers(url)
        try:
            if options.reconnect_forever:
                # a daemon started while NATS is down, or JetStream has no quorum, waits
                # (until it connects, or a signal cancels the wait)
                nc = await retry.wait_out(
                    lambda: connection.open_client(servers, options),
                    what=f"connecting to NATS at {', '.join(servers)} (is the URL right?)",
                )
            else:
                nc = await connection.open_client(servers, options)
        except BaseException:
            if server is not None:
                await asyncio.to_thread(server.stop)
            stored.discard_read_copy(options)
            raise
        bus = cls(nc, options, server)
        if options.create_streams:
            try:
                if options.reconnect_forever:
                    await retry.wait_out(bus.ensure_streams, what="JetStream's streams")
                else:
                    await bus.ensure_streams()
            except BaseException:
                await bus.close()
                raise
        return bus

    async def close(self) -> None:
        for task in list(self._watchdogs):
            task.cancel()
        if self._keeper is not None:  # before the server stops: that is no failure
            await aio.cancel_and_wait([self._keeper])
        await connection.quiet_close(self.nc)
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        stored.discard_read_copy(self.options)

    @property
    def stored_job(self) -> bool:
        """Whether this bus reads an ended job's stored stream (a copy, read only)."""
        return self.options.stored_job is not None

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def url(self) -> str:
        cu = self.nc.connected_url
        return f"{cu.scheme}://{cu.netloc}" if cu else (self.options.url or "")

    # ------------------------------------------------------------------ streams

    def stream_configs(self) -> list[StreamConfig]:
        return streams.configs(self.options)

    async def ensure_streams(self) -> None:
        """Create rove's streams and lease bucket, or leave them as they are."""
        for cfg in self.stream_configs():
            await self._retry(functools.partial(self._ensure_stream, cfg), deadline_s=30.0)
        await self.lease_bucket()

    async def _ensure_stream(self, cfg: StreamConfig) -> None:
        assert cfg.name is not None
        try:
            await self.js.stream_info(cfg.name)
            return
        except nats.js.errors.NotFoundError:
            pass
        try:
            await self.js.add_stream(cfg)
            log.info("created stream", stream=cfg.name, replicas=cfg.num_replicas)
        except nats.js.errors.BadRequestError as exc:
            # 10058: created concurrently by another component; fine.
            if exc.err_code != 10058:
                raise

    async def lease_bucket(self) -> tuple[KeyValue, float]:
        """The leader-lease bucket and its actual TTL in seconds (`lease_bucket.open`,
        retried)."""

        async def once() -> tuple[KeyValue, float]:
            try:
                kv, ttl = await lease_bucket.open(self.js, self.options, self._lease_kv)
            except TemporaryError:
                self._lease_kv = None  # found or made again at the next try
                raise
            self._lease_kv = kv
            return kv, ttl

        found: tuple[KeyValue, float] = await self._retry(once, deadline_s=30.0)
        return found

    # ------------------------------------------------------------------ publishing

    async def publish(
        self,
        event: ev.Event,
        *,
        fence: Fence | None = None,
        deadline_s: float = 10.0,
        busy_retried: bool = True,
    ) -> int:
        """Publish `event` on its subject; return its stream sequence.

        A duplicate of an already stored event (same id) returns the stored sequence.
        With `busy_retried=False`, a clustered stream's "busy" answer (`retry.BUSY_CODES`)
        is raised at once instead of retried (the caller sends the write again itself).

        Raises:
            FencedError: `fence` no longer holds: a newer master was elected.
            PublishDeadlineError: retryable failures lasted past `deadline_s`.
            nats.js.errors.APIError: a busy answer, with `busy_retried=False`.
        """
        seq = 0
        for each in parts.split(event):  # a decision that grows with the cluster: in parts
            headers: dict[str, str] = {Header.MSG_ID.value: each.id}
            if fence is not None:
                headers.update(fence.headers())
            seq = await self.publish_raw(
                subjects.subject_for(each),
                ev.encode(each),
                headers,
                deadline_s=deadline_s,
                busy_retried=busy_retried,
            )
        return seq

    async def publish_raw(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        deadline_s: float = 10.0,
        busy_retried: bool = True,
    ) -> int:
        async def attempt(wait_s: float) -> int:
            try:
                ack = await self.js.publish(
                    subject, payload, timeout=wait_s, headers=dict(headers or {})
                )
            except TimeoutError:
                # (nats-py lowercases the server's message, subject included)
                if connection.denied(self.nc, subject):
                    raise PermissionDeniedError(
                        f"the server refused a publish to {subject}: these credentials' "
                        "role may not write it (roles and their subjects: docs/operations.md)"
                    ) from None
                raise
            except nats.js.errors.BadRequestError as exc:
                if (
                    exc.err_code == WRONG_LAST_SEQUENCE
                    and headers
                    and (
                        EXPECTED_LAST_SUBJECT_SEQ_SUBJECT in headers
                        or Header.EXPECTED_LAST_SUBJECT_SEQUENCE.value in headers
                    )
                ):
                    raise FencedError(
                        f"the server refused a write to {subject}: {exc.description}; "
                        "a newer master holds the lease"
                    ) from exc
                if not busy_retried and exc.err_code in retry.BUSY_CODES:
                    raise Busy(exc) from exc
                raise
            return int(ack.seq)

        try:
            seq: int = await self._retry_with_timeout(attempt, deadline_s=deadline_s, what=subject)
        except Busy as busy:
            raise busy.answer from None  # for the caller to send again
        except FencedError:
            raise  # a deposed master's write: the fence working, not a failure
        except Exception:
            metrics.PUBLISH_ERRORS.labels(metrics.subject_class(subject)).inc()
            raise
        return seq

    async def publish_many(
        self, events: Iterable[ev.Event], *, deadline_s: float = 30.0
    ) -> list[int]:
        """Pipelined publish of many events (windowed `publish_async`); sequences in order.

        Each event keeps its id, so events whose ack was lost are re-sent and
        deduplicated by the server.
        """
        batch = list(events)
        seqs: list[int] = [0] * len(batch)
        pending = list(range(len(batch)))

        async def window(wait_s: float) -> None:
            nonlocal pending
            futures = []
            for i in pending:
                e = batch[i]
                futures.append(
                    await self.js.publish_async(
                        subjects.subject_for(e), ev.encode(e), headers={Header.MSG_ID.value: e.id}
                    )
                )
            results = await asyncio.gather(
                *(asyncio.wait_for(f, wait_s) for f in futures), return_exceptions=True
            )
            failed = []
            for i, res in zip(pending, results, strict=True):
                if isinstance(res, BaseException):
                    if not isinstance(res, Exception) or not retry.backoff(res):
                        raise res
                    failed.append(i)
                else:
                    seqs[i] = int(res.seq)
            pending = failed
            if pending:
                raise BusUnavailableError(
                    f"{len(pending)} of {len(batch)} events were not acknowledged; "
                    "is JetStream available?"
                )

        if batch:
            await retry.call(
                window, what=f"{len(batch)} events", deadline_s=deadline_s, attempt_s=deadline_s
            )
        return seqs

    async def _retry(self, fn: Callable[[], Awaitable[Any]], *, deadline_s: float) -> Any:
        return await retry.call(lambda _t: fn(), what="request", deadline_s=deadline_s)

    async def _retry_with_timeout(
        self, fn: Callable[[float], Awaitable[Any]], *, deadline_s: float, what: str
    ) -> Any:
        return await retry.call(fn, what=what, deadline_s=deadline_s)

    # ------------------------------------------------------------------ consuming

    async def last_seq(self, stream: str, subject_filter: str) -> int:
        """Stream sequence of the newest message matching `subject_filter` (0 if none)."""
        seq, _ = await self.last_message(stream, subject_filter, direct=True)
        return seq

    async def last_message(
        self, stream: str, subject_filter: str, *, direct: bool = False
    ) -> tuple[int, bytes]:
        """(sequence, body) of the newest message matching `subject_filter`, ((0, b"")
        if none), retried. From the stream's leader unless `direct`: a direct get may be
        served by a replica that lags, which may not yet hold a message another replica
        has just named."""

        async def get() -> tuple[int, bytes]:
            try:
                msg = await self.js.get_last_msg(stream, subject_filter, direct=direct)
            except nats.js.errors.NotFoundError:
                return 0, b""
            return int(msg.seq or 0), msg.data or b""

        found: tuple[int, bytes] = await self._retry(get, deadline_s=15.0)
        return found

    async def stream_bounds(self, stream: str) -> tuple[int, int]:
        """(first, last) sequence the stream holds now (last is 0 when it is empty)."""

        async def info() -> tuple[int, int]:
            state = (await self.js.stream_info(stream)).state
            return int(state.first_seq), int(state.last_seq)

        bounds: tuple[int, int] = await self._retry(info, deadline_s=15.0)
        return bounds

    async def job_exists(self, job: str) -> bool:
        return await self.last_seq(subjects.EVENTS_STREAM, subjects.job_events(job)) > 0

    async def subscribe(
        self,
        stream: str,
        subject_filter: str,
        on_recorded: OnRecorded,
        on_rejected: OnRejected,
        *,
        start_seq: int | None = None,
        start_time: dt.datetime | None = None,
        last_per_subject: bool = False,
        stored_times: bool = False,
    ) -> Feed:
        """Deliver every stored and future message matching `subject_filter`, in order.

        Starts at `start_seq`, or at `start_time`, or with the newest message
        per subject (`last_per_subject`), else at the beginning. `stored_times`: each
        `Recorded` says when the server stored it (`stored`; not in a bulk catch-up,
        which `last_per_subject` never takes). Handlers may
        be coroutines. A handler that raises a `RoveError` is logged with the
        message's sequence and the feed goes on; anything else is a bug, logged with
        its traceback and kept in `feed.error` (a one-shot reader raises it:
        `Feed.settled`), and the feed goes on; in the first catch-up it propagates.
        """
        target = await self.last_seq(stream, subject_filter)
        feed = Feed(sub=None, target_seq=target)
        first = max(1, start_seq) if start_seq is not None else 1
        if target == 0 or (start_seq is not None and target < first):
            feed.caught_up.set()

        def mark(seq: int, pending: int) -> None:
            feed.last_seq = seq
            if not feed.caught_up.is_set() and (seq >= target or pending == 0):
                feed.caught_up.set()

        async def finish(result: Awaitable[None], seq: int, pending: int) -> None:
            try:
                await result
            except RoveError:
                log.exception("handler failed on a stored message; skipped", stream=stream, seq=seq)
            mark(seq, pending)

        joiner = parts.Joiner()

        def deliver(
            seq: int, subject: str, data: bytes, pending: int = -1, stored: float = 0.0
        ) -> Awaitable[None] | None:
            """Hand one stored message to its handler; an awaitable if the handler is async.

            Synchronous (no coroutine per message) when the handlers are: this is
            the replay hot path.
            """
            if seq <= feed.last_seq:
                return None  # handed over from the bulk catch-up; already delivered
            item = records.read(stream, seq, subject, data, stored)
            if type(item) is records.Recorded and type(item.event) in parts.JOINED:
                try:
                    whole = joiner.take(item.event)
                except parts.Incomplete as exc:
                    log.warning(f"skipped a decision seen in part: {exc}", seq=seq)
                    whole = None
                if whole is None:
                    mark(seq, pending)
                    return None
                item = item._replace(event=whole)  # type: ignore[arg-type]
            try:
                if type(item) is records.Recorded:
                    result = on_recorded(item)
                else:
                    assert isinstance(item, records.Rejection)
                    self.rejections.saw(item)
                    result = on_rejected(item)
            except RoveError:
                log.exception("handler failed on a stored message; skipped", stream=stream, seq=seq)
                result = None
            if result is not None:
                return finish(result, seq, pending)
            mark(seq, pending)
            return None

        async def on_msg(msg: Msg) -> None:
            seq, pending = ack_position(msg.reply)
            stored = stored_time(msg.reply) if stored_times else 0.0
            try:
                result = deliver(seq, msg.subject, msg.data, pending, stored)
                if result is not None:
                    await result
            except Exception as exc:  # noqa: BLE001 - a bug in a handler: said with its traceback
                feed.handler_failed(exc, stream, seq, msg.subject)
                mark(seq, pending)

        from_time = start_time is not None or last_per_subject
        if not from_time and target - first + 1 >= catchup.MIN_BACKLOG:
            assert isinstance(self.nc, RoveNatsClient)
            last = await catchup.catch_up(
                self.nc, self.js, stream, subject_filter, first, target, deliver
            )
            first = last + 1
        if start_time is not None:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start_time
            )
        elif last_per_subject:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        else:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first
            )
        feed.sub = await self.js.subscribe(
            subject_filter,
            stream=stream,
            cb=on_msg,
            ordered_consumer=True,
            config=config,
        )
        if start_time is not None and not feed.caught_up.is_set():
            await nothing_since(feed, target)

        async def from_seq(seq: int) -> Any:
            if seq <= 0:  # a stream made anew: all of it (or the feed's time, the last)
                restart = config if from_time else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
            elif feed.last_seq == 0:  # nothing delivered yet: the feed's own start
                restart = config
            else:
                restart = ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=seq
                )
            return await self.js.subscribe(
                subject_filter, stream=stream, cb=on_msg, ordered_consumer=True, config=restart
            )

        async def newest() -> int:
            return await self.last_seq(stream, subject_filter)

        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
            # (not known: the first check after a reconnection learns it)
            known = await self.stream_created(stream)
            feed.created = known.created if known is not None else None
        feed.watchdog = asyncio.create_task(
            feed.watch(
                newest,
                from_seq,
                functools.partial(self.stream_created, stream),
                what=f"{stream} {subject_filter}",
                every_s=self.stall_check_s,
            )
        )
        self._watchdogs.add(feed.watchdog)
        feed.watchdog.add_done_callback(self._watchdogs.discard)
        assert isinstance(self.nc, RoveNatsClient)
        feed.hear_reconnections(self.nc.reconnected)
        return feed

    async def stream_created(self, stream: str) -> StreamMark | None:
        """When `stream` was created and its newest sequence, from its leader (None if it
        is not there): a stream made anew under the same name (a memory stream after its
        server restarted) has another creation time; one whose every server restarted
        has the same, and numbers its messages from 1 again."""
        try:
            info = await self.js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return None
        return StreamMark(info.created, int(info.state.last_seq))

    async def read(self, stream: str, subject_filter: str, on_recorded: OnRecorded) -> None:
        """Deliver every message stored now under `subject_filter`, in order, and
        return (dead letters are skipped: `rove events` shows them)."""
        feed = await self.subscribe(stream, subject_filter, on_recorded, lambda _rej: None)
        try:
            await feed.settled()
        finally:
            await feed.stop()
