"""The bus side of a data client: its own thread, event loop and NATS connection.

It connects with the credentials and TLS files of the environment
(`ROVE_NATS_CREDS`, `ROVE_NATS_USER`, ...; `rove run` passes its own to the
workers). The training process calls it from its main thread (the sampler runs there,
also with a multi-process DataLoader). Outgoing facts (registration, shard
requests, acknowledgements) are published in order, each retried until the
bus takes it, so a NATS blip or a master failover delays them but loses
nothing: the stream keeps a request until a master answers it. Answers
(`shard_leased`, `data_rejected`) arrive on this client's own subject and are
queued for the sampler.
"""

from __future__ import annotations

import asyncio
import os
import queue
import secrets
import threading
import time
from typing import Any

import structlog

from rove.control import events as ev
from rove.control import records, subjects
from rove.control.bus import Bus, options_from_env
from rove.control.errors import RoveError

log = structlog.get_logger("rove.data")

Answer = ev.ShardLeased | ev.DataRejected


def client_name(node: str, rank: int) -> str:
    """A name unique to this process: node, rank, pid and a random tag."""
    base = "".join(c if c.isalnum() or c in "-_" else "-" for c in (node or "local"))[:30]
    return f"{base}-r{rank}-{os.getpid()}-{secrets.token_hex(3)}"


class DataClient:
    def __init__(
        self,
        *,
        job: str,
        dataset: str,
        url: str,
        node: str = "",
        rank: int = 0,
        client: str | None = None,
    ) -> None:
        self.job = subjects.check_name("job", job)
        self.dataset = subjects.check_name("dataset", dataset)
        self.url = url
        self.node = node
        self.rank = rank
        self.client = subjects.check_name("client", client or client_name(node, rank))
        self.answers: queue.Queue[Answer] = queue.Queue()
        self._seq = 0
        self._loop = asyncio.new_event_loop()
        self._outgoing: asyncio.Queue[ev.Event | None] | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"rove-data-{dataset}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the data client for {dataset} did not connect to {url} in 30 s")
        if self._failed is not None:
            raise self._failed

    # ------------------------------------------------------------------ called from training

    def envelope(self) -> dict[str, Any]:
        self._seq += 1
        return {
            "job": self.job,
            "id": ev.make_id(self.client, self._seq),
            "producer": f"data:{self.client}",
            "ts": time.time(),
        }

    @property
    def seq(self) -> int:
        return self._seq

    def send(self, event: ev.Event) -> None:
        """Publish `event` (in order with earlier ones) without waiting."""
        self._loop.call_soon_threadsafe(self._put, event)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush what is queued (up to `timeout_s`), then disconnect."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._put, None)
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _put(self, event: ev.Event | None) -> None:
        assert self._outgoing is not None
        self._outgoing.put_nowait(event)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._outgoing = asyncio.Queue()
        try:
            bus = await Bus.connect(
                options_from_env(self.url, name=f"rove-data-{self.client}", reconnect_forever=True)
            )
            feed = await bus.subscribe(
                subjects.EVENTS_STREAM,
                subjects.data_answer(self.job, self.dataset, self.client),
                self._answered,
                lambda rej: log.error("unreadable answer from the master", error=rej.error),
            )
        except (RoveError, OSError) as exc:
            self._failed = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            while (event := await self._outgoing.get()) is not None:
                await self._publish(bus, event)
        finally:
            await feed.stop()
            await bus.close()

    def _answered(self, rec: records.Recorded) -> None:
        if isinstance(rec.event, ev.ShardLeased | ev.DataRejected):
            self.answers.put(rec.event)

    async def _publish(self, bus: Bus, event: ev.Event) -> None:
        delay = 0.2
        while True:
            try:
                await bus.publish(event, deadline_s=10.0)
                return
            except RoveError as exc:
                log.warning(
                    "data event not published yet, retrying",
                    kind=ev.kind(event),
                    error=str(exc),
                    dataset=self.dataset,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
