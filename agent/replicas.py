"""Peer replicas, the agent's side: it sends its ranks' newest flash checkpoint to K
peers, keeps its peers' in memory (`rove.checkpoint.replica`), and fetches a round's
ranks from them before a restore.

- **Sending.** When every local rank holds a new step (the checkpoint duty reports it),
  the `ReplicaSender` (`rove.agent.replica_sender`) copies each rank out of shared
  memory (a memory copy, which a newer save cannot tear) and sends it to the `replicas`
  peers `choose_peers` picks: nodes of the round in another failure domain first, in a
  ring from this node so that every node is some node's peer. A peer answers before any
  byte travels (go ahead, refused with why, or held already). One step is in flight at a
  time; a newer step saved meanwhile is sent next and the ones between are skipped, so a
  slow network never queues work, and training never waits (copies run in a thread,
  sends on the agent's event loop). A peer that cannot be reached or refuses is left
  alone for a while (`BACKOFF_S`, doubling), said once; the step it missed is sent when
  the backoff ends. Each rank's copy is kept (its buffer reused for the next step), so a
  step goes through memory once whatever the number of peers.
- **Holding.** The `ReplicaServer` listens on the agent's address; it verifies each
  rank's size and checksum before it keeps it (`ReplicaStore`, within `budget`
  bytes), and once it holds every rank a peer sent of a step it says so on the bus
  (`replica_stored`), so the master knows which steps are recoverable without
  storage. It answers gets of what it holds, and of its own ranks' slots.
- **Restoring.** `PeerReplicas.restore` fetches the ranks a round names in its
  `fetches`, all at once, verified, straight into this node's own shared memory
  before its workers start.

Bytes travel on a `Channel` (the event loop's socket calls, into and out of the
buffers themselves), not asyncio's streams, which copy every byte on the way.

A torn or corrupted transfer fails its checksum and is refused.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

import structlog

from rove.agent.channel import IO_TIMEOUT_S, TRANSFER_ERRORS, Channel
from rove.agent.facts import NodeFacts
from rove.agent.replica_sender import ReplicaSender as ReplicaSender
from rove.agent.replica_sender import choose_peers as choose_peers
from rove.checkpoint import replica as wire
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.storage import Manifest
from rove.control.catalogue import events as ev
from rove.control.process.aio import cancel_and_wait

log = structlog.get_logger("rove.replicas")
#: A rank's step from this node's own memory, as storage would write it (`Saver.raw`).
Local = Callable[[int, int], "tuple[Manifest, bytearray] | None"]

#: How long a peer waits for its `replica_stored` to reach the bus before it answers.
SAY_S = 5.0


class PeerReplicas:
    """The agent's two halves: its sender, and its server unless it sends none
    (`--peer-replicas 0`: it neither sends nor takes replicas)."""

    def __init__(
        self, facts: NodeFacts, addr: str, replicas: int, budget: int, local: Local
    ) -> None:
        """`local(step, rank)`: that rank's step from this node's own memory (`Saver.raw`)."""
        self.facts = facts
        self.sender = ReplicaSender(facts, replicas)

        def own(step: int, rank: int) -> tuple[Manifest, bytearray] | None:
            # its slots, else the copy its sender keeps of the step its peers took
            return local(step, rank) or self.sender.kept(step, rank)

        self.own = own
        self.server = ReplicaServer(facts, addr, budget, own) if replicas > 0 else None
        if self.server is not None:
            self.sender.lent = self.server.store.serving
        #: where peers send to (0: nowhere)
        self.port = 0

    async def start(self) -> None:
        """Listen for peers; a node that cannot listen on its address takes none (said)."""
        if self.server is None:
            return
        try:
            self.port = await self.server.start()
        except OSError as exc:
            self.server.log.warning(
                f"cannot take peers' checkpoint replicas on {self.server.host}: {exc}; "
                "this node keeps none (it still sends its own)"
            )
            self.server = None

    def tasks(self) -> list[asyncio.Task[None]]:
        """Its long-lived tasks, for the agent to keep: the sender, and the server's
        accept loop (started by `start`)."""
        sending = asyncio.create_task(self.sender.run(), name="replica sender")
        serving = self.server.task if self.server is not None else None
        return [sending] if serving is None else [sending, serving]

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    async def restore(self, r: ev.RoundCompleted, engines: dict[int, FlashEngine]) -> None:
        """Round `r` restores some ranks from peers: fetch those this node runs (its
        `engines`), all at once, verified, straight into its own memory before its
        workers start. A rank that cannot be fetched is said and left out (its slot
        unsealed): the workers then find the step missing and every rank falls back to
        storage together (`rove.checkpoint.restore`)."""
        step = r.restore_step
        members = {m.node: m for m in r.members}
        say = log.bind(job=self.facts.job, node=self.facts.node)

        async def one(f: ev.RestoreFetch, step: int, holder: ev.RoundMember) -> None:
            began = time.monotonic()
            want = wire.Want(job=self.facts.job, source=f.source, step=step, rank=f.rank)
            seals: list[Callable[[int], None]] = []

            def land(offer: wire.Offer) -> list[memoryview]:
                meta, data, seal = engines[f.rank].receive(step, offer.meta_len, offer.data_len)
                seals.append(seal)
                return [meta, data]

            try:
                if f.node == self.facts.node:  # held here: no socket on the way
                    offer = await asyncio.to_thread(self._install_own, want, engines[f.rank])
                else:
                    offer = await fetch_into(holder.addr, holder.replica_port, want, land)
                    seals[0](offer.checksum)
            except TRANSFER_ERRORS as exc:
                say.warning(
                    f"could not fetch rank {f.rank} of step {step} from {f.node}: "
                    f"{exc or type(exc).__name__}; the ranks fall back to storage together"
                )
                return
            whose = "its own memory" if f.source == f.node else f"its replica of {f.source}"
            say.info(
                f"fetched rank {f.rank} of step {step} from {f.node} ({whose}) in "
                f"{time.monotonic() - began:.2f} s",
                bytes=offer.size,
            )

        await asyncio.gather(
            *(
                one(f, step, members[f.node])
                for f in r.fetches
                if step is not None and f.rank in engines and f.node in members
            )
        )

    def _install_own(self, want: wire.Want, engine: FlashEngine) -> wire.Offer:
        """What this node holds of `want` (its own rank, or a peer's replica),
        verified, into `engine`'s slot. Blocking: run it in a thread."""
        store = self.server.store if self.server is not None else None
        held = lookup(self.facts, want, self.own, store)
        if held is None:
            raise CheckpointError(
                f"this node no longer holds step {want.step} rank {want.rank} of {want.source}"
            )
        offer, raw = held
        problem = wire.verify(offer, raw)
        if problem:
            raise CheckpointError(f"its copy of step {want.step} rank {want.rank}: {problem}")
        engine.install(want.step, raw, offer.meta_len, offer.checksum)
        return offer

    def new_round(self, r: ev.RoundCompleted, engines: dict[int, FlashEngine]) -> None:
        """Round `r` starts a lineage at its restore step: nothing newer is sent or kept."""
        self.sender.new_round(r.round, r.members, engines, r.restore_step)
        if self.server is not None:
            self.server.store.drop_newer(-1 if r.restore_step is None else r.restore_step)


class ReplicaServer:
    """Takes peers' replicas into a bounded `ReplicaStore` and serves them back."""

    def __init__(self, facts: NodeFacts, host: str, budget: int, local: Local) -> None:
        self.facts = facts
        self.host = host
        self.local = local
        self.store = wire.ReplicaStore(facts.job, budget)
        self.log = log.bind(job=facts.job, node=facts.node)
        self._sock: socket.socket | None = None
        #: the accept loop, once started (a long-lived task the agent keeps)
        self.task: asyncio.Task[None] | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen on the agent's address and start taking connections; the port."""
        loop = asyncio.get_running_loop()
        family, kind, proto, _, where = (
            await loop.getaddrinfo(self.host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(where)
            sock.listen(64)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.task = asyncio.create_task(self.serve(sock), name="replica server")
        return int(sock.getsockname()[1])

    async def serve(self, sock: socket.socket) -> None:
        """Take peers' connections, each served on its own (a transfer's failure ends
        that transfer only)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of file descriptors, say: tried again shortly
                self.log.warning(f"cannot take a peer's connection: {exc}; trying again")
                await asyncio.sleep(1.0)
                continue
            task = asyncio.create_task(self._serve(conn), name="replica transfer")
            self._conns.add(task)
            task.add_done_callback(self._served)

    def _served(self, task: asyncio.Task[None]) -> None:
        """A transfer ended: one that failed unexpectedly (a bug, not the network) is said
        with its traceback; it ends that transfer only."""
        self._conns.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.log.error("a replica transfer failed", exc_info=exc)

    async def stop(self) -> None:
        await cancel_and_wait([t for t in (self.task, *self._conns) if t is not None])
        if self._sock is not None:
            self._sock.close()

    async def _serve(self, conn: socket.socket) -> None:
        chan = Channel(conn, IO_TIMEOUT_S)
        try:
            op = await chan.exactly(4)
            body = await chan.body()
            if op == wire.PUT:
                await self._put(wire.decode(body, wire.Offer), chan)
            elif op == wire.GET:
                await self._get(wire.decode(body, wire.Want), chan)
            else:
                raise CheckpointError(f"unknown operation {op!r}: not a rove peer")
        except TRANSFER_ERRORS as exc:
            self.log.debug("a replica transfer ended early", error=str(exc) or type(exc).__name__)
        finally:
            chan.close()

    async def _put(self, offer: wire.Offer, chan: Channel) -> None:
        # the first answer, before any byte of the rank travels: held already, refused
        # (with why), or go ahead
        if self.store.holds(offer):
            await chan.send(wire.answer_frame(wire.Answer(ok=True, held=True)))
            return
        refusal = self.store.refusal(offer)
        await chan.send(wire.answer_frame(wire.Answer(ok=not refusal, error=refusal)))
        if refusal:
            return
        data = self.store.buffer(offer)
        await chan.fill(memoryview(data))
        problem = await asyncio.to_thread(wire.verify, offer, data)
        if problem:
            self.log.warning(
                f"refused a replica of step {offer.step} rank {offer.rank} from "
                f"{offer.source}: {problem}"
            )
            await chan.send(wire.answer_frame(wire.Answer(ok=False, error=problem)))
            return
        if self.store.put(offer, data, verified=True):
            held = self.store.held(offer.source)
            assert held is not None
            step, offers = held
            self.facts.emit(
                ev.ReplicaStored(
                    **self.facts.envelope(),
                    source=offer.source,
                    step=step,
                    round=offer.round,
                    ranks=tuple(ev.ReplicaRank(o.rank, o.size, o.checksum) for o in offers),
                    source_incarnation=offer.incarnation,
                )
            )
            # said on the bus before the sender hears it was taken: the master's newest
            # step of the source is never older than the one the sender keeps a copy of
            # (bounded: a bus that is down does not stop replication)
            await self.facts.outbox.flush(SAY_S)
        await chan.send(wire.answer_frame(wire.Answer(ok=True)))

    async def _get(self, want: wire.Want, chan: Channel) -> None:
        held = await asyncio.to_thread(lookup, self.facts, want, self.local, self.store)
        if held is None:
            error = f"no replica of step {want.step} rank {want.rank} of {want.source} here"
            await chan.send(wire.answer_frame(wire.Answer(ok=False, error=error)))
            return
        offer, data = held
        self.store.serving.add(id(data))  # not reused for an arriving replica meanwhile
        try:
            await chan.send(wire.answer_frame(wire.Answer(ok=True, offer=offer)))
            await chan.send(data)
        finally:
            self.store.serving.discard(id(data))


def lookup(
    facts: NodeFacts, want: wire.Want, local: Local, store: wire.ReplicaStore | None
) -> tuple[wire.Offer, bytearray] | None:
    """What this node holds of `want`: its own rank's step (`local`: its slots, or the
    copy its sender kept), or a peer's replica in `store`. Blocking (a copy out of
    shared memory): run it in a thread."""
    if want.job != facts.job:
        return None
    if want.source != facts.node:
        return None if store is None else store.get(want.source, want.step, want.rank)
    mine = local(want.step, want.rank)
    if mine is None:
        return None
    m, raw = mine
    offer = wire.Offer(
        job=want.job,
        source=want.source,
        round=0,
        step=m.step,
        rank=m.rank,
        ranks=(m.rank,),
        meta_len=m.meta_len,
        data_len=m.data_len,
        checksum=m.checksum,
        incarnation=facts.incarnation,
    )
    return offer, raw


async def fetch_into(
    addr: str, port: int, want: wire.Want, land: Callable[[wire.Offer], list[memoryview]]
) -> wire.Offer:
    """One rank of a peer's replica (or of its own memory), received straight into the
    buffers `land(offer)` gives (their lengths adding up to its size), then verified.
    Raises CheckpointError (with why), TimeoutError or OSError; the buffers' contents
    are then undefined."""
    chan = await Channel.connect(addr, port, IO_TIMEOUT_S)
    parts: list[memoryview] = []
    try:
        await chan.send(wire.frame(wire.GET, want))
        answer = wire.decode(await chan.body(), wire.Answer)
        if not answer.ok or answer.offer is None:
            raise CheckpointError(answer.error or "the peer sent no replica")
        offer = answer.offer
        if (offer.source, offer.step, offer.rank) != (want.source, want.step, want.rank):
            raise CheckpointError(
                f"asked for step {want.step} rank {want.rank} of {want.source}, "
                f"was sent step {offer.step} rank {offer.rank} of {offer.source}"
            )
        # (in a thread: a fresh slot is allocated and every page of it touched first)
        parts = await asyncio.to_thread(land, offer)
        if sum(len(p) for p in parts) != offer.size:
            raise CheckpointError(f"no room for the {offer.size} bytes of the replica")
        for part in parts:
            await chan.fill(part)
        problem = await asyncio.to_thread(wire.verify, offer, *parts)
    finally:
        chan.close()
        for part in parts:
            part.release()
    if problem:
        raise CheckpointError(f"step {offer.step} rank {offer.rank} from {addr}: {problem}")
    return offer


async def fetch(addr: str, port: int, want: wire.Want) -> tuple[wire.Offer, bytearray]:
    """One rank of a peer's replica, verified, in a buffer of its own."""
    got: list[bytearray] = []

    def land(offer: wire.Offer) -> list[memoryview]:
        got.append(bytearray(offer.size))
        return [memoryview(got[0])]

    offer = await fetch_into(addr, port, want, land)
    return offer, got[0]
