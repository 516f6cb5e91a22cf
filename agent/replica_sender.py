"""The sending half of peer replicas (`rove.agent.replicas`): this node's newest flash
checkpoint, copied once out of shared memory, to the K peers `choose_peers` picks, one
step at a time; and the copy of the newest step a peer took, kept so that this node
can give its own ranks of that step back after its slots moved on."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import structlog

from rove.agent.channel import IO_TIMEOUT_S, TRANSFER_ERRORS, Channel
from rove.agent.facts import NodeFacts
from rove.checkpoint import replica as wire
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.storage import Manifest, SlotOverwritten, copy_out
from rove.control.catalogue import events as ev

log = structlog.get_logger("rove.replicas")

#: A peer that failed is not tried again for this long, doubling up to `BACKOFF_MAX_S`.
BACKOFF_S = 2.0
BACKOFF_MAX_S = 60.0


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
        #: rank -> (step, manifest, bytes): each rank's copy out of shared memory, sent
        #: to every peer; its buffer is reused for the rank's next step
        self._copies: dict[int, tuple[int, Manifest | None, bytearray]] = {}
        #: the same, of the newest step a peer took whole: kept (until a peer takes a
        #: newer one) so that this node can give its own ranks of that step back after
        #: its slots moved on, to pair with its peers' replicas of the same step
        self._kept: dict[int, tuple[int, Manifest | None, bytearray]] = {}
        #: the same, of a step whose last rank went whole but whose answer never came
        #: (the peer may have taken it and said so): kept too, until a newer step is taken
        self._maybe: dict[int, tuple[int, Manifest | None, bytearray]] = {}
        #: the step whose last payload went out, its answer awaited
        self._unanswered: int | None = None
        #: the ids of buffers being sent back to a peer now: never copied into meanwhile
        self.lent: set[int] = set()

    def new_round(
        self,
        round_: int,
        members: Sequence[ev.RoundMember],
        engines: dict[int, FlashEngine],
        restore_step: int | None = None,
    ) -> None:
        """Round `round_`'s peers and this node's ranks' engines, its lineage going on
        from `restore_step` (None: afresh); nothing older is sent."""
        self._round = round_
        self._peers = choose_peers(members, self.facts.node, self.replicas)
        self._engines = dict(engines)
        self._due = None
        self.sent = {}
        # the new lineage may reach the same step numbers again: a copy of a step past
        # where it starts is not that step (it stays a buffer to reuse)
        keep = -1 if restore_step is None else restore_step
        for copies in (self._copies, self._kept, self._maybe):
            for r, (step, _m, buf) in list(copies.items()):
                if step > keep:
                    copies[r] = (-1, None, buf)

    def kept(self, step: int, rank: int) -> tuple[Manifest, bytearray] | None:
        """`rank`'s `step` as this node copied and sent it, if it still has that copy."""
        for copies in (self._kept, self._maybe, self._copies):
            held, m, buf = copies.get(rank, (-1, None, None))
            if held == step and m is not None and buf is not None:
                return m, buf
        return None

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
        self._unanswered = None
        try:
            for rank, engine in sorted(engines.items()):
                await self._send_rank(peer, step, rank, engine, tuple(sorted(engines)))
        except TRANSFER_ERRORS as exc:
            if isinstance(exc, Overtaken):
                return False
            if self._unanswered == step:
                self._pin(step)
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
        self._keep(step)
        return True

    def _keep(self, step: int) -> None:
        """A peer took `step` whole: keep this node's copy of it (the kept copy of an
        older step, and one only maybe taken, become buffers to copy the next into)."""
        for rank in sorted({*self._copies, *self._maybe}):
            if self._kept.get(rank, (-1,))[0] >= step:
                continue
            pool = next(
                (p for p in (self._maybe, self._copies) if p.get(rank, (-1,))[0] == step), None
            )
            if pool is None:
                continue
            spare = [e for e in (self._kept.get(rank),) if e is not None]
            self._kept[rank] = pool.pop(rank)
            if self._maybe.get(rank, (step,))[0] < step:
                spare.append(self._maybe.pop(rank))
            for _, _, buf in spare:
                if rank not in self._copies and id(buf) not in self.lent:
                    self._copies[rank] = (-1, None, buf)  # (one being sent back is not)
        # ranks this node no longer runs (renumbered in a new round): their copies were
        # kept for that round's restore; a newer step taken whole supersedes them
        for rank in {*self._copies, *self._kept, *self._maybe} - set(self._engines):
            for copies in (self._copies, self._kept, self._maybe):
                copies.pop(rank, None)

    def _pin(self, step: int) -> None:
        """`step` went whole but its answer never came: the peer may have taken it, and
        said so, so the copy is kept (not copied into) until a newer step is taken."""
        for rank, entry in list(self._copies.items()):
            if entry[0] == step:
                self._maybe[rank] = self._copies.pop(rank)

    async def _copy(self, step: int, rank: int, engine: FlashEngine) -> tuple[Manifest, bytearray]:
        """`rank`'s `step` copied out of shared memory (a memory copy, well inside a
        save's interval, that a newer save cannot tear: a large state takes longer to
        send than the workers take to save twice), once for all peers."""
        have = self.kept(step, rank)
        if have is not None:
            return have
        buf = self._copies.get(rank, (-1, None, None))[2]
        if buf is not None and id(buf) in self.lent:
            buf = None  # being sent back to a peer: a fresh one
        slot = engine.slot_of(step)
        if slot is None:
            raise Overtaken(f"step {step} of rank {rank} is no longer in memory")
        self._copies.pop(rank, None)  # torn while it is copied into
        try:
            copied, raw = await asyncio.to_thread(copy_out, engine, slot, rank, buf)
        except SlotOverwritten as exc:
            raise Overtaken(str(exc)) from exc
        self._copies[rank] = (step, copied, raw)
        return copied, raw

    async def _send_rank(
        self,
        peer: ev.RoundMember,
        step: int,
        rank: int,
        engine: FlashEngine,
        ranks: tuple[int, ...],
    ) -> None:
        manifest, raw = await self._copy(step, rank, engine)
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
            incarnation=self.facts.incarnation,
        )
        chan = await Channel.connect(peer.addr, peer.replica_port, self.io_timeout_s)
        try:
            await chan.send(wire.frame(wire.PUT, offer))
            go = wire.decode(await chan.body(), wire.Answer)
            if go.held:
                return  # the peer holds this rank of the step already
            if not go.ok:
                raise CheckpointError(f"{peer.node} refused it: {go.error}")
            await chan.send(raw)
            self._unanswered = step
            answer = wire.decode(await chan.body(), wire.Answer)
            self._unanswered = None
        finally:
            chan.close()
        if not answer.ok:
            raise CheckpointError(f"{peer.node} refused it: {answer.error}")


class Overtaken(CheckpointError):
    """The step being sent left memory (a newer save took its slot)."""
