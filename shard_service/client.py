"""The bus side of a data client: its own thread, event loop and NATS connection.

It connects with the credentials and TLS files of the environment
(`ROVE_NATS_CREDS`, `ROVE_NATS_USER`, ...; `rove run` passes its own to the
workers). The training process calls it from its main thread (the sampler runs there,
also with a multi-process DataLoader). Outgoing facts (registration, shard
requests, acknowledgements) go through an `Outbox`: published in order, each
retried until the bus takes it, so a NATS blip or a master failover delays them
but loses nothing: the stream keeps a request until a master answers it.

A lease is one stored event: the client's acknowledgements of the shards it trained
ride in its next request (`ShardRequested.done`), or after `ACK_DELAY_S` in a request
for nothing, and so does the newest request whose shards reached it (`answered`). A
main process acknowledging its DataLoader workers' shards sends a request for nothing
per worker client every `ACK_DELAY_S` at most.
Answers arrive on this client's own subjects and are queued for the sampler: leases
(`shard_leased`, stream ROVE_ANSWERS; one announced twice, after a master failover,
is queued once; one announced as `lapsed`, its leases expired before it came, is
queued empty and the grant itself ignored should it still come) and refusals
(`data_rejected`, stored with the facts).
"""

from __future__ import annotations

import asyncio
import os
import queue
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from rove.agent import progress
from rove.control.bus import records
from rove.control.bus.client import Bus
from rove.control.bus.options import options_from_env
from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.domain import shards
from rove.control.errors import RoveError
from rove.control.process import aio, logs

log = logs.get("rove.data")

Answer = ev.ShardLeased | ev.DataRejected

#: Seconds an acknowledgement waits to ride in a request before it is sent on its own.
ACK_DELAY_S = 1.0
#: Requests whose leases a client remembers, to keep a lease announced twice once.
REMEMBERED_LEASES = 1024


@dataclass(frozen=True)
class Placement:
    """Where a data client runs: its NATS, job, node, rank and rendezvous round."""

    url: str
    job: str
    node: str
    rank: int
    round: int


def placement(
    what: str,
    *,
    nats: str | None,
    job: str | None,
    node: str | None,
    rank: int | None,
    round: int | None,
) -> Placement:
    """The arguments given, else what `rove run` put in the environment.

    Raises:
        ValueError: no NATS URL or no job (the message says how to give them).
    """
    env = os.environ
    url = nats or env.get("ROVE_NATS_URL", "")
    job = job or env.get("ROVE_JOB") or env.get("TORCHELASTIC_RUN_ID", "")
    if not url or not job:
        raise ValueError(
            f"the {what} needs a NATS URL and a job: run under `rove run`, or pass "
            "nats='nats://host:4222' and job='name' (or set ROVE_NATS_URL and ROVE_JOB)"
        )
    return Placement(
        url=url,
        job=job,
        node=node if node is not None else env.get("ROVE_NODE", ""),
        rank=rank if rank is not None else int(env.get("RANK", "0")),
        round=round if round is not None else int(env.get("ROVE_ROUND", "0")),
    )


def dataset_spec(dataset: str, **fields: Any) -> ev.DatasetSpec:
    """A validated spec. Raises ValueError naming the dataset and the problem."""
    spec = ev.DatasetSpec(**fields)
    problem = shards.spec_problem(spec)
    if problem:
        raise ValueError(f"dataset {dataset}: {problem}")
    return spec


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
        round: int = 0,
        client: str | None = None,
    ) -> None:
        self.job = subjects.check_name("job", job)
        self.dataset = subjects.check_name("dataset", dataset)
        self.url = url
        self.node = node
        self.rank = rank
        self.round = round
        self.client = subjects.check_name("client", client or client_name(node, rank))
        self.answers: queue.Queue[Answer] = queue.Queue()
        self._seq = 0
        #: numbering events and queueing them, from the training thread or the bus's
        self._lock = threading.Lock()
        #: shards trained and not yet acknowledged, by the client holding their lease
        self._acks: dict[str, list[ev.ShardRef]] = {}
        self._ack_timer: asyncio.TimerHandle | None = None
        #: the newest request whose lease reached this client, and the `answered` last
        #: sent; the requests whose leases did (the latest `REMEMBERED_LEASES`)
        self.answered = 0
        self._confirmed = 0
        self._leased: dict[int, None] = {}
        self._loop = asyncio.new_event_loop()
        aio.quiet_nats_reconnect_race(self._loop)
        self._outbox: Outbox | None = None
        self._closing: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"rove-data-{dataset}", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError(f"the data client for {dataset} did not connect to {url} in 30 s")
        if self._failed is not None:
            raise self._failed

    @classmethod
    def at(cls, where: Placement, dataset: str, client: str | None = None) -> DataClient:
        return cls(
            job=where.job,
            dataset=dataset,
            url=where.url,
            node=where.node,
            rank=where.rank,
            round=where.round,
            client=client,
        )

    # ------------------------------------------------------------------ called from training

    def envelope(self) -> ev.Envelope:
        self._seq += 1
        return ev.envelope(self.job, f"data:{self.client}", time.time(), self.client, self._seq)

    @property
    def seq(self) -> int:
        return self._seq

    def send(self, event: ev.Event) -> None:
        """Publish `event` (in order with earlier ones) without waiting.

        Raises:
            RoveError: the client can no longer publish (its outbox failed on a fact it
                may never send): the worker stops, with the reason, rather than wait
                for answers that cannot come.
        """
        failure = self._outbox.failure if self._outbox is not None else None
        if failure is not None:
            raise RoveError(
                f"the data client of {self.dataset} cannot publish: {failure!r}"
            ) from failure
        self._loop.call_soon_threadsafe(self._put, event)

    def register(self, spec: ev.DatasetSpec) -> None:
        self.send(
            ev.DatasetRegistered(
                **self.envelope(),
                dataset=self.dataset,
                spec=spec,
                client=self.client,
                node=self.node,
                rank=self.rank,
                round=self.round,
            )
        )

    def request(self, count: int, held: tuple[int, ...], **first: Any) -> int:
        """Ask for `count` more shards, renewing `held` and acknowledging the shards
        trained since the last request; returns the request's number.

        `first`: the restore fields of the client's first request in its round
        (`first_request()`).
        """
        with self._lock:
            return self._request(count, held, **first)

    def _request(
        self, count: int, held: tuple[int, ...], owner: str | None = None, **first: Any
    ) -> int:
        """(Under the lock.) With `owner`, a request for nothing on behalf of the client
        holding the leases it acknowledges (a DataLoader worker's)."""
        envelope = self.envelope()
        mine = owner is None or owner == self.client
        client = self.client if mine else str(owner)
        acks = tuple(self._acks.pop(client, ()))
        if mine:
            self._confirmed = self.answered
        self.send(
            ev.ShardRequested(
                **envelope,
                dataset=self.dataset,
                client=client,
                request=self._seq,
                count=count,
                node=self.node,
                rank=self.rank,
                round=self.round,
                held=held,
                done=acks,
                answered=self.answered if mine else 0,
                **first,
            )
        )
        return self._seq

    def done(self, shard: ev.ShardRef, owner: str | None = None) -> None:
        """`shard` was trained; `owner`: the client holding its lease, if not this one.

        This client's own shards are acknowledged with its next request; any not taken
        along within `ACK_DELAY_S`, and another client's, in a request for nothing (one
        per client whose leases they are)."""
        with self._lock:
            waiting = any(self._acks.values())
            self._acks.setdefault(owner or self.client, []).append(shard)
        if not waiting:
            self._loop.call_soon_threadsafe(self._arm_acks)

    def _arm_acks(self) -> None:
        if self._ack_timer is None:
            self._ack_timer = self._loop.call_later(ACK_DELAY_S, self._send_acks)

    def _send_acks(self, last: bool = False) -> None:
        """Acknowledge what no request took along, in a request for nothing; the `last`
        one also confirms the leases that reached this client (the master stops
        announcing them)."""
        if self._ack_timer is not None:
            self._ack_timer.cancel()
            self._ack_timer = None
        with self._lock:
            for owner in [o for o, acks in self._acks.items() if acks]:
                self._request(0, (), owner)
            if last and self.answered > self._confirmed:
                self._request(0, ())

    def close(self, timeout_s: float = 10.0) -> None:
        """Acknowledge what is trained, flush what is queued (up to `timeout_s`), then
        disconnect."""
        if self._thread.is_alive():
            # in this order: the acknowledgement is queued before the close is seen
            self._loop.call_soon_threadsafe(self._send_acks, True)
            self._loop.call_soon_threadsafe(self._put, None)
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the thread

    def _put(self, event: ev.Event | None) -> None:
        if event is None:
            assert self._closing is not None
            self._closing.set()
            return
        assert self._outbox is not None
        self._outbox.put(event)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._closing = asyncio.Event()
        try:
            bus = await Bus.connect(
                options_from_env(
                    self.url,
                    name=f"rove-data-{self.client}",
                    reconnect_forever=True,
                    # a worker of a rove agent (ROVE_NODE): the agent says a lost connection
                    says_connection="ROVE_NODE" not in os.environ,
                )
            )

            def unreadable(rej: records.Rejection) -> None:
                log.error("unreadable answer from the master", error=rej.error)

            feeds = [
                await bus.subscribe(
                    subjects.ANSWER_STREAM,
                    subjects.lease_answer(self.job, self.dataset, self.client),
                    self._answered,
                    unreadable,
                ),
                await bus.subscribe(
                    subjects.EVENTS_STREAM,
                    subjects.data_answer(self.job, self.dataset, self.client),
                    self._answered,
                    unreadable,
                ),
            ]
        except (RoveError, OSError) as exc:
            self._failed = exc
            self._ready.set()
            return
        # requests, registrations and acknowledgements: in order, kept while the bus is down
        self._outbox = Outbox(bus, what=f"data events of {self.dataset}")
        self._outbox.start()
        self._ready.set()
        try:
            await self._closing.wait()
            await self._outbox.flush(timeout_s=None)
        finally:
            await self._outbox.stop()
            for feed in feeds:
                await feed.stop()
            await bus.close()

    def _answered(self, rec: records.Recorded) -> None:
        answer = rec.event
        if isinstance(answer, ev.ShardLeased) and (
            answer.shards or answer.exhausted or answer.lapsed
        ):
            if answer.request in self._leased:
                # announced again by a new master: these shards are here already; or
                # the grant of a request already answered as lapsed (its leases expired)
                return
            if answer.lapsed:
                log.warning(
                    "a lease expired before it reached this client (the master took longer"
                    " than the lease to answer); asking again",
                    dataset=self.dataset,
                    client=self.client,
                    request=answer.request,
                )
            self._leased[answer.request] = None
            if len(self._leased) > REMEMBERED_LEASES:
                del self._leased[next(iter(self._leased))]
            self.answered = max(self.answered, answer.request)
        if isinstance(answer, ev.ShardLeased | ev.DataRejected):
            self.answers.put(answer)


def first_request(dataset: str, position: ev.DataPosition | None) -> dict[str, Any]:
    """The restore fields of a client's first request in a round.

    The step is the one the worker's checkpointer says it restored, else the one the
    round named (`ROVE_RESTORE_STEP`: older when the named one could not be read). Warns
    when a checkpoint was restored but no data position was loaded: the data would
    start over while the model does not.
    """
    named = os.environ.get("ROVE_RESTORE_STEP", "")
    loaded = progress.restored_step()
    step = loaded if loaded is not None else int(named) if named else None
    if step is not None and position is None:
        log.warning(
            "the model restores a checkpoint but the data position was not loaded: "
            "save state_dict() with the model and call load_state_dict()",
            step=step,
            dataset=dataset,
        )
    return {"restore": position, "restore_step": step}
