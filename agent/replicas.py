"""Peer replicas, the agent's side: it sends its ranks' newest flash checkpoint to K
peers, keeps its peers' in memory (`rove.checkpoint.replica`), and fetches a round's
ranks from them before a restore.

- **Sending.** When every local rank holds a new step (the checkpoint duty reports it),
  the `ReplicaSender` copies each rank out of shared memory (a memory copy, which a
  newer save cannot tear) and sends it to the `replicas` peers `choose_peers` picks:
  nodes of the round in another failure domain first, in a ring from this node so that
  every node is some node's peer. A peer answers before any byte travels (go ahead,
  refused with why, or held already). One step is in flight at a time; a newer step
  saved meanwhile is sent next and the ones between are skipped, so a slow network never
  queues work, and training never waits (copies run in a thread, sends on the agent's
  event loop). A peer that cannot be reached or refuses is left alone for a while
  (`BACKOFF_S`, doubling), said once; the step it missed is sent when the backoff ends.
- **Holding.** The `ReplicaServer` listens on the agent's address; it verifies each
  rank's size and checksum before it keeps it (`ReplicaStore`, within `budget`
  bytes), and once it holds every rank a peer sent of a step it says so on the bus
  (`replica_stored`), so the master knows which steps are recoverable without
  storage. It answers gets of what it holds, and of its own ranks' slots.
- **Restoring.** `PeerReplicas.restore` fetches the ranks a round names in its
  `fetches`, verified, into this node's own shared memory before its workers start.

A torn or corrupted transfer fails its checksum and is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec
import structlog

from rove.agent.facts import NodeFacts
from rove.checkpoint import replica as wire
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.storage import Manifest, SlotOverwritten, copy_out
from rove.control.catalogue import events as ev

log = structlog.get_logger("rove.replicas")
T = TypeVar("T")
#: A rank's step from this node's own memory, as storage would write it (`Saver.raw`).
Local = Callable[[int, int], "tuple[Manifest, bytearray] | None"]

#: A peer that failed is not tried again for this long, doubling up to `BACKOFF_MAX_S`.
BACKOFF_S = 2.0
BACKOFF_MAX_S = 60.0
#: One read or write of a replica transfer that takes longer fails it.
IO_TIMEOUT_S = 30.0
#: Bytes written to or read from the socket at a time while a rank travels.
CHUNK = 4 << 20
#: The most a connection's reader buffers before it pauses the socket.
BUFFER = 4 * CHUNK


async def read_body(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """A header or an answer: its 4-byte length, then that many bytes."""
    n = wire.length(await asyncio.wait_for(reader.readexactly(4), timeout_s))
    return await asyncio.wait_for(reader.readexactly(n), timeout_s)


async def receive(reader: asyncio.StreamReader, size: int) -> bytearray:
    """`size` bytes from `reader`, in chunks into one buffer (never two copies of it)."""
    data = bytearray(size)
    got = 0
    while got < size:
        chunk = await asyncio.wait_for(reader.read(min(CHUNK, size - got)), IO_TIMEOUT_S)
        if not chunk:
            raise CheckpointError(f"the other side left after {got} of {size} bytes")
        data[got : got + len(chunk)] = chunk
        got += len(chunk)
    return data


def choose_peers(members: Sequence[ev.RoundMember], me: str, k: int) -> list[ev.RoundMember]:
    """The `k` peers `me` sends its replicas to: members that take replicas, those of
    another failure domain first (when domains are given), each group in ring order
    from `me` (so each node's replicas land on different nodes)."""
    if k <= 0:
        return []
    names = [m.node for m in members]
    if me not in names:
        return []
    start = names.index(me)
    ring = [members[(start + i) % len(members)] for i in range(1, len(members))]
    takers = [m for m in ring if m.replica_port > 0]
    mine = next(m.domain for m in members if m.node == me)
    away = [m for m in takers if not mine or m.domain != mine]
    near = [m for m in takers if mine and m.domain == mine]
    return (away + near)[:k]


class PeerReplicas:
    """The agent's two halves: its sender, and its server unless it sends none
    (`--peer-replicas 0`: it neither sends nor takes replicas)."""

    def __init__(
        self, facts: NodeFacts, addr: str, replicas: int, budget: int, local: Local
    ) -> None:
        """`local(step, rank)`: that rank's step from this node's own memory (`Saver.raw`)."""
        self.facts = facts
        self.server = ReplicaServer(facts, addr, budget, local) if replicas > 0 else None
        self.sender = ReplicaSender(facts, replicas)
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

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop()

    async def restore(self, r: ev.RoundCompleted, engines: dict[int, FlashEngine]) -> None:
        """Round `r` restores some ranks from peers: fetch those this node runs (its
        `engines`), verified, into its own memory before its workers start. A rank that
        cannot be fetched is said and left out: the workers then find the step missing
        and every rank falls back to storage together (`rove.checkpoint.restore`)."""
        step = r.restore_step
        members = {m.node: m for m in r.members}
        say = log.bind(job=self.facts.job, node=self.facts.node)
        for f in r.fetches:
            holder = members.get(f.node)
            if step is None or f.rank not in engines or holder is None:
                continue
            began = time.monotonic()
            want = wire.Want(job=self.facts.job, source=f.source, step=step, rank=f.rank)
            try:
                offer, raw = await fetch(holder.addr, holder.replica_port, want)
                await asyncio.to_thread(
                    engines[f.rank].install, step, raw, offer.meta_len, offer.checksum
                )
            except (OSError, TimeoutError, asyncio.IncompleteReadError, CheckpointError) as exc:
                say.warning(
                    f"could not fetch rank {f.rank} of step {step} from {f.node}: "
                    f"{exc or type(exc).__name__}; the ranks fall back to storage together"
                )
                continue
            whose = "its own memory" if f.source == f.node else f"its replica of {f.source}"
            say.info(
                f"fetched rank {f.rank} of step {step} from {f.node} ({whose}) in "
                f"{time.monotonic() - began:.2f} s",
                bytes=len(raw),
            )

    def new_round(self, r: ev.RoundCompleted, engines: dict[int, FlashEngine]) -> None:
        """Round `r` starts a lineage at its restore step: nothing newer is sent or kept."""
        self.sender.new_round(r.round, r.members, engines)
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
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen on the agent's address; the port."""
        # (a reader buffer of 64 KiB, the default, paused the socket every 128 KiB: 1 GiB
        # took 10 s to arrive beside training)
        self._server = await asyncio.start_server(self._serve, self.host, 0, limit=BUFFER)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            op = await asyncio.wait_for(reader.readexactly(4), IO_TIMEOUT_S)
            body = await read_body(reader, IO_TIMEOUT_S)
            if op == wire.PUT:
                await self._put(msgspec_decode(body, wire.Offer), reader, writer)
            elif op == wire.GET:
                await self._get(msgspec_decode(body, wire.Want), writer)
            else:
                raise CheckpointError(f"unknown operation {op!r}: not a rove peer")
        except (OSError, TimeoutError, asyncio.IncompleteReadError, CheckpointError) as exc:
            self.log.debug("a replica transfer ended early", error=str(exc) or type(exc).__name__)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _put(
        self, offer: wire.Offer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        # the first answer, before any byte of the rank travels: held already, refused
        # (with why), or go ahead
        if self.store.holds(offer):
            writer.write(wire.answer_frame(wire.Answer(ok=True, held=True)))
            await writer.drain()
            return
        refusal = self.store.refusal(offer)
        writer.write(wire.answer_frame(wire.Answer(ok=not refusal, error=refusal)))
        await writer.drain()
        if refusal:
            return
        data = await receive(reader, offer.size)
        problem = await asyncio.to_thread(wire.verify, offer, data)
        if problem:
            self.log.warning(
                f"refused a replica of step {offer.step} rank {offer.rank} from "
                f"{offer.source}: {problem}"
            )
            writer.write(wire.answer_frame(wire.Answer(ok=False, error=problem)))
            await writer.drain()
            return
        complete = self.store.put(offer, data)
        writer.write(wire.answer_frame(wire.Answer(ok=True)))
        await writer.drain()
        if complete:
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
                )
            )

    async def _get(self, want: wire.Want, writer: asyncio.StreamWriter) -> None:
        held = None
        if want.job == self.store.job and want.source == self.facts.node:
            mine = await asyncio.to_thread(self.local, want.step, want.rank)
            if mine is not None:
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
                )
                held = (offer, raw)
        elif want.job == self.store.job:
            held = self.store.get(want.source, want.step, want.rank)
        if held is None:
            error = f"no replica of step {want.step} rank {want.rank} of {want.source} here"
            writer.write(wire.answer_frame(wire.Answer(ok=False, error=error)))
        else:
            offer, data = held
            writer.write(wire.answer_frame(wire.Answer(ok=True, offer=offer)))
            writer.write(data)
        await writer.drain()


def msgspec_decode(body: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as exc:
        raise CheckpointError(f"an unreadable replica header: {exc}") from exc


class ReplicaSender:
    """Sends this node's newest step in memory to its peers, one step at a time."""

    def __init__(self, facts: NodeFacts, replicas: int, io_timeout_s: float = IO_TIMEOUT_S) -> None:
        self.facts = facts
        self.replicas = replicas
        self.io_timeout_s = io_timeout_s
        self.log = log.bind(job=facts.job, node=facts.node)
        self._peers: list[ev.RoundMember] = []
        self._round = 0
        self._engines: dict[int, FlashEngine] = {}
        self._due: int | None = None
        self._wake = asyncio.Event()
        #: peer -> (not before this monotonic time, the next backoff)
        self._backoff: dict[str, tuple[float, float]] = {}
        #: the newest step each peer took whole
        self.sent: dict[str, int] = {}

    def new_round(
        self, round_: int, members: Sequence[ev.RoundMember], engines: dict[int, FlashEngine]
    ) -> None:
        """Round `round_`'s peers and this node's ranks' engines; nothing older is sent."""
        self._round = round_
        self._peers = choose_peers(members, self.facts.node, self.replicas)
        self._engines = dict(engines)
        self._due = None
        self.sent = {}

    def offer(self, step: int) -> None:
        """Every local rank holds `step`: send it when the one in flight is done."""
        if self._peers and self._engines:
            self._due = step
            self._wake.set()

    async def run(self) -> None:
        """The sending loop (a long-lived task the agent keeps). A step a peer did not
        take (it was backing off) is tried again once the backoff ends, unless a newer
        one is due by then."""
        step: int | None = None
        while True:
            retry_in = self._retry_in(step)
            if retry_in is None:
                await self._wake.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), retry_in)
            self._wake.clear()
            if self._due is not None:
                step, self._due = self._due, None
            if step is None:
                continue
            for peer in list(self._peers):
                if self._due is not None:
                    break  # a newer step is due: send that one instead
                if not await self._send_to(peer, step):
                    step = None  # it left memory: the next step saved goes instead
                    break

    def _retry_in(self, step: int | None) -> float | None:
        """Seconds until a peer that has not taken `step` may be tried again (None: no
        such peer: wait for the next step)."""
        if step is None:
            return None
        waiting = [
            self._backoff.get(p.node, (0.0, 0.0))[0]
            for p in self._peers
            if self.sent.get(p.node, -1) < step
        ]
        if not waiting:
            return None
        return max(0.05, min(waiting) - time.monotonic())

    async def _send_to(self, peer: ev.RoundMember, step: int) -> bool:
        """Send `step` to `peer` unless it has it or is backing off; False when the step
        is no longer in memory (a newer save took its slot)."""
        now = time.monotonic()
        until, wait = self._backoff.get(peer.node, (0.0, BACKOFF_S))
        if now < until or self.sent.get(peer.node, -1) >= step:
            return True
        engines = dict(self._engines)
        try:
            for rank, engine in sorted(engines.items()):
                await self._send_rank(peer, step, rank, engine, tuple(sorted(engines)))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, CheckpointError) as exc:
            if isinstance(exc, Overtaken):
                return False
            if peer.node not in self._backoff:
                self.log.warning(
                    f"could not send the replica of step {step} to {peer.node}: "
                    f"{exc or type(exc).__name__}; trying again in {wait:.0f} s"
                )
            self._backoff[peer.node] = (now + wait, min(BACKOFF_MAX_S, wait * 2))
            return True
        if peer.node in self._backoff:
            self.log.info(f"replicas reach {peer.node} again")
            del self._backoff[peer.node]
        self.sent[peer.node] = step
        return True

    async def _answer(self, reader: asyncio.StreamReader) -> wire.Answer:
        return msgspec_decode(await read_body(reader, self.io_timeout_s), wire.Answer)

    async def _send_rank(
        self,
        peer: ev.RoundMember,
        step: int,
        rank: int,
        engine: FlashEngine,
        ranks: tuple[int, ...],
    ) -> None:
        slot = engine.slot_of(step)
        if slot is None:
            raise Overtaken(f"step {step} of rank {rank} is no longer in memory")
        # copied out first (a memory copy, well inside a save's interval), then sent from
        # the copy: a large state takes longer to send than the workers take to save
        # twice, and a newer save would tear a send straight from the slot
        try:
            manifest, raw = await asyncio.to_thread(copy_out, engine, slot, rank)
        except SlotOverwritten as exc:
            raise Overtaken(str(exc)) from exc
        offer = wire.Offer(
            job=self.facts.job,
            source=self.facts.node,
            round=self._round,
            step=step,
            rank=rank,
            ranks=ranks,
            meta_len=manifest.meta_len,
            data_len=manifest.data_len,
            checksum=manifest.checksum,
        )
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(peer.addr, peer.replica_port, limit=BUFFER), self.io_timeout_s
        )
        try:
            writer.write(wire.frame(wire.PUT, offer))
            await asyncio.wait_for(writer.drain(), self.io_timeout_s)
            go = await self._answer(reader)
            if go.held:
                return  # the peer holds this rank of the step already
            if not go.ok:
                raise CheckpointError(f"{peer.node} refused it: {go.error}")
            view = memoryview(raw)
            for at in range(0, len(view), CHUNK):
                writer.write(view[at : at + CHUNK])
                await asyncio.wait_for(writer.drain(), self.io_timeout_s)
            answer = await self._answer(reader)
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if not answer.ok:
            raise CheckpointError(f"{peer.node} refused it: {answer.error}")


class Overtaken(CheckpointError):
    """The step being sent left memory (a newer save took its slot)."""


async def fetch(addr: str, port: int, want: wire.Want) -> tuple[wire.Offer, bytearray]:
    """One rank of a peer's replica, verified. Raises CheckpointError (with why) or OSError."""
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection(addr, port, limit=BUFFER), IO_TIMEOUT_S
    )
    try:
        writer.write(wire.frame(wire.GET, want))
        await writer.drain()
        answer = msgspec_decode(await read_body(reader, IO_TIMEOUT_S), wire.Answer)
        if not answer.ok or answer.offer is None:
            raise CheckpointError(answer.error or "the peer sent no replica")
        offer = answer.offer
        data = await receive(reader, offer.size)
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    problem = await asyncio.to_thread(wire.verify, offer, data)
    if problem:
        raise CheckpointError(f"step {offer.step} rank {offer.rank} from {addr}: {problem}")
    return offer, data
