"""Peer replicas of flash checkpoints (issue 27, its first part): a node's agent sends
its ranks' newest step to a peer's agent over TCP, straight from shared memory; the
peer verifies, keeps it within a budget and says `replica_stored` on the bus; the
master folds which node's steps its peers hold. Real shared memory, real sockets, a
real nats-server; the store, the choice of peers and the fold are pure."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import xxhash

from rove.agent.facts import NodeFacts
from rove.agent.replicas import ReplicaSender, ReplicaServer, choose_peers, fetch
from rove.checkpoint import durable
from rove.checkpoint import replica as wire
from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.storage import Manifest, rebuild_verified
from rove.control.bus.client import Bus
from rove.control.bus.outbox import Outbox
from rove.control.catalogue import events as ev
from rove.control.cli import status_cmd
from rove.control.domain.words import counted
from rove.control.master import checkpoints as ckpt
from tests import factories
from tests.support import RunProc, eventually, stored_events
from tests.test_checkpoint_commit import running

JOB = "rj"


def offer(
    source: str, step: int, rank: int, data: bytes, ranks: tuple[int, ...] = (0, 1)
) -> wire.Offer:
    return wire.Offer(
        job=JOB,
        source=source,
        round=1,
        step=step,
        rank=rank,
        ranks=ranks,
        meta_len=0,
        data_len=len(data),
        checksum=xxhash.xxh3_64_intdigest(data),
    )


def test_a_peer_keeps_the_newest_complete_step_of_each_source_within_its_budget() -> None:
    store = wire.ReplicaStore(JOB, budget=300)
    a0, a1 = b"a" * 50, b"b" * 50
    assert store.refusal(offer("na", 10, 0, a0)) == ""
    assert store.put(offer("na", 10, 0, a0), bytearray(a0)) is False  # rank 1 still to come
    assert store.held("na") is None
    assert store.put(offer("na", 10, 1, a1), bytearray(a1)) is True
    held = store.held("na")
    assert held is not None and held[0] == 10 and [o.rank for o in held[1]] == [0, 1]
    # a newer step arriving keeps the complete one until it is complete itself
    store.put(offer("na", 20, 0, a0), bytearray(a0))
    assert store.held("na") is not None and store.held("na")[0] == 10  # type: ignore[index]
    assert store.used == 150
    store.put(offer("na", 20, 1, a1), bytearray(a1))
    assert store.held("na")[0] == 20 and store.used == 100  # type: ignore[index]
    assert store.get("na", 10, 0) is None and store.get("na", 20, 1) is not None
    # stale, foreign and over-budget offers are refused, saying why
    assert "not newer" in store.refusal(offer("na", 20, 0, a0))
    assert store.holds(offer("na", 20, 0, a0)) and not store.holds(offer("na", 20, 0, a1))
    foreign = wire.Offer(
        job="other",
        source="na",
        round=1,
        step=30,
        rank=0,
        ranks=(0,),
        meta_len=0,
        data_len=1,
        checksum=0,
    )
    assert "serves job rj, not other" in store.refusal(foreign)
    big = b"c" * 250
    assert "budget is full" in store.refusal(offer("nb", 5, 0, big, ranks=(0,)))
    # a corrupted rank never enters
    bad = bytearray(a0)
    bad[7] ^= 0xFF
    with pytest.raises(CheckpointError, match="checksum"):
        store.put(offer("nc", 5, 0, a0, ranks=(0,)), bad)
    assert store.held("nc") is None
    # a new lineage from step 15 forgets step 20
    store.drop_newer(15)
    assert store.held("na") is None


def _member(node: str, domain: str = "", port: int = 9) -> ev.RoundMember:
    return ev.RoundMember(
        node=node,
        incarnation="i",
        addr="127.0.0.1",
        nproc=2,
        first_rank=0,
        replica_port=port,
        domain=domain,
    )


def test_peers_are_chosen_in_a_ring_off_the_nodes_failure_domain_first() -> None:
    ring = [_member(n) for n in ("n0", "n1", "n2", "n3")]
    assert [m.node for m in choose_peers(ring, "n1", 1)] == ["n2"]
    assert [m.node for m in choose_peers(ring, "n3", 2)] == ["n0", "n1"]
    assert choose_peers(ring, "n1", 0) == [] and choose_peers(ring, "nx", 1) == []
    zoned = [_member("n0", "a"), _member("n1", "a"), _member("n2", "b"), _member("n3", "b")]
    assert [m.node for m in choose_peers(zoned, "n0", 1)] == ["n2"]
    assert [m.node for m in choose_peers(zoned, "n0", 3)] == ["n2", "n3", "n1"]
    # a node that takes no replicas (--peer-replicas 0) is never a peer
    assert [m.node for m in choose_peers([_member("n0"), _member("n1", port=0)], "n0", 1)] == []


def test_the_master_knows_which_nodes_steps_its_peers_hold_and_forgets_an_abandoned_lineage() -> (
    None
):
    c = ckpt.CkptState()
    c = ckpt.on_replica(c, factories.replica("n1", "n0", 20))
    c = ckpt.on_replica(c, factories.replica("n2", "n0", 20))
    c = ckpt.on_replica(c, factories.replica("n1", "n0", 10))  # older: a late report
    assert c.replicas["n0"] == (20, (0, 1), (("n1", "i1"), ("n2", "i1")))
    c = ckpt.on_replica(c, factories.replica("n2", "n0", 30))
    assert c.replicas["n0"] == (30, (0, 1), (("n2", "i1"),))
    # a round that goes on from step 25 abandons step 30: no peer's copy of it counts
    cut = msgspec.structs.replace(factories.round_completed(2, 1, "n0", "n1"), restore_step=25)
    c = ckpt.on_round(c, cut)
    assert "n0" not in c.replicas
    c = ckpt.on_replica(c, factories.replica("n1", "n0", 30, round=1))  # late, abandoned
    assert "n0" not in c.replicas


def test_status_says_which_peers_hold_a_nodes_step() -> None:
    s = running()
    s.apply(factories.in_memory("n1", 7, (0, 1)))
    s.apply(factories.replica("n2", "n1", 7))
    view = status_cmd.status_view(s.state, s.liveness, None, s.now)
    assert view["checkpoints"]["replicas"] == {"n1": {"step": 7, "held_by": ["n2"]}}
    assert "on peers: n1 step 7 on n2" in status_cmd.render(view)


async def test_a_nodes_step_reaches_its_peer_verified_and_is_said_on_the_bus(
    bus: Bus, tmp_path: Path
) -> None:
    """Two ranks' flash checkpoints in real shared memory go to a peer agent over TCP;
    the peer says `replica_stored` with each rank's size and checksum, those of the
    slot, and gives back bytes that rebuild to the very tensors saved."""
    outbox = Outbox(bus, what="test facts")
    outbox.start()
    try:
        holder = ReplicaServer(
            NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 64 << 20, _nothing
        )
        port = await holder.start()
        engines = {r: FlashEngine(f"{JOB}-x", r, directory=tmp_path) for r in (0, 1)}
        states = {r: {"w": torch.randn(300, 100), "step": torch.tensor([r])} for r in (0, 1)}
        for step in (4, 5):
            for r, engine in engines.items():
                engine.save(step, states[r])
        sender = ReplicaSender(NodeFacts(outbox, job=JOB, node="na"), replicas=1)
        sending = asyncio.create_task(sender.run())
        sender.new_round(1, [_member("na", port=0), _member("nb", port=port)], engines)
        sender.offer(5)

        async def replica_events() -> list[ev.ReplicaStored]:
            return [
                r.event
                for r in await stored_events(bus, JOB)
                if isinstance(r.event, ev.ReplicaStored)
            ]

        events = await eventually(replica_events, timeout=30)
        assert len(events) == 1, events
        e = events[0]
        assert (e.node, e.source, e.step, e.round) == ("nb", "na", 5, 1)
        for rr in e.ranks:
            h = engines[rr.rank].segments[engines[rr.rank].newest().slot].header()  # type: ignore[union-attr]
            assert h is not None and (rr.size, rr.checksum) == (h.meta_len + h.data_len, h.checksum)
        for r in (0, 1):
            got, raw = await fetch(
                "127.0.0.1", port, wire.Want(job=JOB, source="na", step=5, rank=r)
            )
            manifest = Manifest(
                step=5, rank=r, meta_len=got.meta_len, data_len=got.data_len, checksum=got.checksum
            )
            state = rebuild_verified(raw, manifest, 5, r, "replica")
            assert torch.equal(state["w"], states[r]["w"]) and torch.equal(
                state["step"], states[r]["step"]
            )
        with pytest.raises(CheckpointError, match="no replica of step 4"):
            await fetch("127.0.0.1", port, wire.Want(job=JOB, source="na", step=4, rank=0))
        sending.cancel()
        await holder.stop()
    finally:
        await outbox.stop()


class FlippingProxy:
    """A TCP proxy to the holder that flips one byte of what it forwards after the first
    `after` bytes, while `corrupt` is set: a transfer corrupted in transit."""

    def __init__(self, port: int, after: int = 4096, *, down: bool = False) -> None:
        """`down`: corrupt what the holder sends back (a fetch), not what it is sent."""
        self.port, self.after, self.corrupt, self.down = port, after, True, down
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.port)
        corrupt = self.corrupt

        async def pipe(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, flip: bool, eof: bool
        ) -> None:
            seen = 0
            while chunk := await src.read(65536):
                buf = bytearray(chunk)
                if flip and seen <= self.after < seen + len(buf):
                    buf[self.after - seen] ^= 0xFF
                seen += len(buf)
                dst.write(buf)
                await dst.drain()
            if eof:
                dst.write_eof()
            else:
                dst.close()

        await asyncio.gather(
            pipe(r, uw, corrupt and not self.down, True),
            pipe(ur, w, corrupt and self.down, False),
            return_exceptions=True,
        )


async def test_a_replica_corrupted_in_transit_is_refused_and_the_next_step_goes_through(
    bus: Bus, tmp_path: Path
) -> None:
    from structlog.testing import capture_logs

    outbox = Outbox(bus, what="test facts")
    outbox.start()
    holder = ReplicaServer(NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 64 << 20, _nothing)
    proxy = FlippingProxy(await holder.start())
    via = await proxy.start()
    engines = {0: FlashEngine(f"{JOB}-c", 0, directory=tmp_path)}
    sender = ReplicaSender(NodeFacts(outbox, job=JOB, node="na"), replicas=1)
    sending = asyncio.create_task(sender.run())
    try:
        sender.new_round(1, [_member("na", port=0), _member("nb", port=via)], engines)
        engines[0].save(1, {"w": torch.randn(200, 100)})
        with capture_logs() as logs:
            sender.offer(1)
            await eventually(lambda: "nb" in sender._backoff, timeout=30)
        assert holder.store.held("na") is None
        said = [e["event"] for e in logs if e["log_level"] == "warning"]
        assert any("refused it" in s and "checksum" in s for s in said), logs
        proxy.corrupt = False
        engines[0].save(2, {"w": torch.randn(200, 100)})
        sender.offer(2)  # after the backoff, the next step goes through whole
        await eventually(lambda: sender.sent.get("nb") == 2, timeout=30)
        held = holder.store.held("na")
        assert held is not None and held[0] == 2
    finally:
        sending.cancel()
        await holder.stop()
        await outbox.stop()


async def test_a_stalled_peer_never_holds_up_the_agent_and_is_left_alone_for_a_while(
    tmp_path: Path,
) -> None:
    """A peer that takes the connection and never answers: `offer` returns at once, the
    agent's loop keeps running, and the send fails after its timeout, into a backoff."""
    stalled: list[asyncio.StreamWriter] = []

    async def hold(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        stalled.append(w)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    engines = {0: FlashEngine(f"{JOB}-s", 0, directory=tmp_path)}
    engines[0].save(1, {"w": torch.randn(100, 100)})
    sender = ReplicaSender(NodeFacts(_Facts(), job=JOB, node="na"), replicas=1, io_timeout_s=1.0)  # type: ignore[arg-type]
    sending = asyncio.create_task(sender.run())
    try:
        sender.new_round(1, [_member("na", port=0), _member("nb", port=port)], engines)
        ticks = 0
        began = asyncio.get_running_loop().time()
        sender.offer(1)
        assert asyncio.get_running_loop().time() - began < 0.05
        while "nb" not in sender._backoff:
            await asyncio.sleep(0.05)
            ticks += 1
        assert ticks >= 10  # the loop went on for the whole stall
        assert sender.sent == {} and stalled
    finally:
        sending.cancel()
        server.close()


class _Facts:
    def put(self, event: ev.Event) -> None:
        raise AssertionError(f"a sender says nothing on the bus: {event}")


@pytest.mark.slow
async def test_in_a_real_job_each_nodes_steps_land_on_its_peer_as_they_reach_storage(
    bus: Bus, tmp_path: Path
) -> None:
    """Two `rove run` nodes in two failure domains: each one's flash checkpoints reach
    the other's agent while they train (`replica_stored`, as the job goes), with the
    checksum of the very file the node persisted of that step; `rove status` says so.

    Midway, na's agent is stopped (SIGSTOP: its replica server accepts and answers
    nothing, its workers go on), so nb's sends stall: meanwhile nb's agent goes on
    reporting its new flash checkpoints and both ranks keep training; once na's agent
    runs again, nb's newer steps reach it."""
    import os
    import signal

    from tests.support import MasterProc, RunProc, finished, rove_cli, trace_rows
    from tests.test_runtime import TRAIN

    job = "rj"
    master = MasterProc(bus.url, job, "m1", tmp_path, "--node-timeout", "60")
    trace = tmp_path / "trace.jsonl"
    nodes = {
        n: RunProc(
            tmp_path,
            n,
            *("--nats", bus.url, "--job", job, "--node-id", n, "--local-addr", "127.0.0.1"),
            *("--nnodes", "2", "--nproc-per-node", "1", "--failure-domain", f"rack-{n}"),
            *("--checkpoint-dir", str(tmp_path / "store"), "--heartbeat-interval", "0.5"),
            *(str(TRAIN), "--steps", "100", "--step-sleep", "0.1", "--ckpt-every", "5"),
            *("--ckpt-dir", str(tmp_path / "ckpt"), "--log-every", "100", "--trace", str(trace)),
        )
        for n in ("na", "nb")
    }

    async def newest(kind: type[ev.Event], node: str, source: str = "") -> int:
        return max(
            (
                r.event.step  # type: ignore[attr-defined]
                for r in await stored_events(bus, job)
                if isinstance(r.event, kind)
                and r.event.node == node
                and getattr(r.event, "source", "") == source
            ),
            default=-1,
        )

    na = nodes["na"].proc.pid
    stopped = False
    try:
        await eventually(lambda: _at_least(newest(ev.ReplicaStored, "na", "nb"), 10), timeout=120)
        os.kill(na, signal.SIGSTOP)  # na's agent only: its workers go on
        stopped = True
        held = await newest(ev.ReplicaStored, "na", "nb")
        reported = await newest(ev.CkptInMemory, "nb")
        trained = max(r["step"] for r in trace_rows(trace))
        # nb's agent reports three more saves while its peer takes nothing
        await eventually(
            lambda: _at_least(newest(ev.CkptInMemory, "nb"), reported + 15), timeout=60
        )
        assert max(r["step"] for r in trace_rows(trace)) >= trained + 10
        assert await newest(ev.ReplicaStored, "na", "nb") == held
        os.kill(na, signal.SIGCONT)
        stopped = False
        await eventually(
            lambda: _at_least(newest(ev.ReplicaStored, "na", "nb"), reported + 15), timeout=60
        )
        codes = await finished(bus, job, nodes, [master, *nodes.values()])
        assert codes == {"na": 0, "nb": 0}, {n: p.log()[-3000:] for n, p in nodes.items()}
        records = await stored_events(bus, job)
        replicas = [r.event for r in records if isinstance(r.event, ev.ReplicaStored)]
        by_source = {s: [e for e in replicas if e.source == s] for s in ("na", "nb")}
        assert {s: {e.node for e in es} for s, es in by_source.items()} == {
            "na": {"nb"},
            "nb": {"na"},
        }, replicas
        # while the job trained, not only at its end: several steps of each
        assert all(len({e.step for e in es}) >= 3 for es in by_source.values()), replicas
        checked = 0
        for e in replicas:
            for rr in e.ranks:
                manifest = durable.step_dir(tmp_path / "store", e.step) / f"rank-{rr.rank:05d}.json"
                if manifest.exists():
                    m = msgspec.json.decode(manifest.read_bytes(), type=Manifest)
                    assert (m.checksum, m.meta_len + m.data_len) == (rr.checksum, rr.size)
                    checked += 1
        assert checked >= 1, sorted((tmp_path / "store").iterdir())
        out = rove_cli("status", "--job", job, "--nats", bus.url)
        assert "on peers: na step" in out.stdout and "on nb" in out.stdout, out.stdout
    finally:
        if stopped:
            os.kill(na, signal.SIGCONT)
        for p in (master, *nodes.values()):
            p.stop()


def _nothing(_step: int, _rank: int) -> None:
    return None


def _fold(*events: ev.Event) -> ckpt.CkptState:
    c = ckpt.CkptState()
    for e in events:
        c = ckpt.on_in_memory(c, e) if isinstance(e, ev.CkptInMemory) else ckpt.on_replica(c, e)  # type: ignore[arg-type]
    return c


def test_a_lost_nodes_ranks_come_from_the_peer_that_holds_them_at_a_step_every_rank_has() -> None:
    """nb (ranks 2-3) is lost after it saved step 20; na (ranks 0-1) holds step 25 and
    20 in memory, and nb's replica of step 20. A new nb runs ranks 2-3: every rank has
    step 20 (na's own slots, and na's replica of nb), not 25: the round restores 20
    from peers, ranks 2 and 3 fetched from na."""
    c = _fold(
        factories.in_memory("na", 20, (0, 1)),
        factories.in_memory("nb", 20, (2, 3)),
        factories.replica("na", "nb", 20, ranks=(2, 3)),
        factories.replica("nb", "na", 20, ranks=(0, 1)),
        factories.in_memory("na", 25, (0, 1)),
    )
    assert c.previous["na"] == 20
    members = [("na", (0, 1)), ("nb", (2, 3))]
    # (nb's memory report is its lost agent's, i1: the new one, i2, holds nothing known)
    got = ckpt.restore_point(c, members, {"na": "i1", "nb": "i2"})
    assert (got.step, got.source) == (20, ev.RestoreSource.PEER)
    assert got.fetches == (ev.RestoreFetch(2, "na", "nb"), ev.RestoreFetch(3, "na", "nb"))
    # the peer lost too (a new na holds nothing it reported): storage's committed step
    both = msgspec.structs.replace(c, committed=12)
    got = ckpt.restore_point(both, members, {"na": "i2", "nb": "i2"})
    assert (got.step, got.source, got.fetches) == (12, ev.RestoreSource.STORAGE, ())
    # the committed step wins over an older step on peers
    newer = msgspec.structs.replace(c, committed=22)
    assert ckpt.restore_point(newer, members).source is ev.RestoreSource.STORAGE
    # with the holder gone too (not a member), there is no step on peers
    alone = ckpt.restore_point(c, [("nc", (0, 1)), ("nb", (2, 3))], {"nc": "i1", "nb": "i2"})
    assert alone.source is ev.RestoreSource.NONE
    # renumbered ranks: the surviving node runs 2-3 now; its own slots of 0-1 serve (the
    # new nb holds nothing: the replica of na it held went with its old incarnation)
    swapped = ckpt.restore_point(c, [("nb", (0, 1)), ("na", (2, 3))], {"nb": "i2", "na": "i1"})
    assert (swapped.step, swapped.source) == (20, ev.RestoreSource.PEER)
    assert swapped.fetches == (
        ev.RestoreFetch(0, "na", "na"),
        ev.RestoreFetch(1, "na", "na"),
        ev.RestoreFetch(2, "na", "nb"),
        ev.RestoreFetch(3, "na", "nb"),
    )


def test_a_survivor_whose_slots_moved_on_gives_its_own_ranks_from_the_copy_it_kept() -> None:
    """na and nb took each other's step 20 (each sender keeps its own copy of a step a
    peer took: `source_incarnation`); both saved 25 and 30 since, so na's slots hold 20
    no more, and nb is lost. The round restores 20 from peers: nb's ranks from na's
    replica of nb, na's own from the copy its agent kept (a fetch from itself)."""
    c = _fold(
        factories.in_memory("na", 20, (0, 1)),
        factories.in_memory("nb", 20, (2, 3)),
        factories.replica("na", "nb", 20, ranks=(2, 3), source_inc="i1"),
        factories.replica("nb", "na", 20, ranks=(0, 1), source_inc="i1"),
        factories.in_memory("na", 25, (0, 1)),
        factories.in_memory("nb", 25, (2, 3)),
        factories.in_memory("na", 30, (0, 1)),
    )
    assert c.kept["na"] == (20, (0, 1), "i1")
    members = [("na", (0, 1)), ("nb", (2, 3))]
    got = ckpt.restore_point(c, members, {"na": "i1", "nb": "i2"})
    assert (got.step, got.source) == (20, ev.RestoreSource.PEER)
    assert got.fetches == (
        ev.RestoreFetch(0, "na", "na"),
        ev.RestoreFetch(1, "na", "na"),
        ev.RestoreFetch(2, "na", "nb"),
        ev.RestoreFetch(3, "na", "nb"),
    )
    # without the kept copies (agents of before this field), no step pairs up
    old = msgspec.structs.replace(c, kept=type(c.kept)())
    assert ckpt.restore_point(old, members, {"na": "i1", "nb": "i2"}).source is (
        ev.RestoreSource.NONE
    )
    # na's agent restarted meanwhile: its copy went with it
    assert ckpt.restore_point(c, members, {"na": "i2", "nb": "i2"}).source is (
        ev.RestoreSource.NONE
    )
    # a newer step taken replaces the kept one; a new lineage from 10 forgets it
    newer = ckpt.on_replica(c, factories.replica("nb", "na", 25, source_inc="i1"))
    assert newer.kept["na"][0] == 25
    cut = ckpt.on_round(
        c, msgspec.structs.replace(factories.round_completed(2, 1, "na"), restore_step=10)
    )
    assert "na" not in cut.kept


async def test_a_sender_keeps_the_step_a_peer_took_and_restores_it_after_its_slots_moved_on(
    bus: Bus, tmp_path: Path
) -> None:
    """na's step 1 reaches its peer, then na saves 2 and 3 (its two slots hold them) and
    the peer dies before 3 arrives. na still gives rank 0 of step 1 back from the copy
    its sender kept: a restore of step 1 installs it into na's memory, bitwise."""
    from rove.agent.replicas import PeerReplicas
    from rove.agent.saver import Saver

    outbox = Outbox(bus, what="test facts")
    outbox.start()
    engines = {0: FlashEngine(f"{JOB}-k", 0, directory=tmp_path)}
    saver = Saver(f"{JOB}-k", None)
    saver.engines = engines
    na = PeerReplicas(NodeFacts(outbox, job=JOB, node="na"), "127.0.0.1", 1, 1 << 26, saver.raw)
    await na.start()
    holder = ReplicaServer(NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 1 << 26, _nothing)
    port = await holder.start()
    tasks = na.tasks()
    states = {step: {"w": torch.randn(200, 100)} for step in (1, 2, 3)}
    try:
        na.sender.new_round(1, [_member("na", port=na.port), _member("nb", port=port)], engines)
        engines[0].save(1, states[1])
        na.sender.offer(1)
        await eventually(lambda: na.sender.sent.get("nb") == 1, timeout=30)
        await holder.stop()  # the peer is lost: step 3 never reaches it
        engines[0].save(2, states[2])
        engines[0].save(3, states[3])
        na.sender.offer(3)
        await eventually(lambda: "nb" in na.sender._backoff, timeout=30)
        assert engines[0].slot_of(1) is None
        r = msgspec.structs.replace(
            factories.round_completed(2, 1, "na"),
            members=(_member("na", port=na.port),),
            restore_step=1,
            restore_source=ev.RestoreSource.PEER,
            fetches=(ev.RestoreFetch(0, "na", "na"),),
        )
        na.new_round(r, engines)
        await na.restore(r, engines)
        step, state = engines[0].load(1)
        assert step == 1 and torch.equal(state["w"], states[1]["w"])
    finally:
        for t in tasks:
            t.cancel()
        await na.stop()
        await outbox.stop()


async def test_a_step_whose_answer_never_came_is_kept_until_a_newer_one_is_taken(
    bus: Bus, tmp_path: Path
) -> None:
    """A peer takes the whole of step 1 and vanishes before it answers: it may have
    said `replica_stored`, so the sender keeps that copy (it never copies step 2 into
    it); once a peer takes step 2, step 2 is what it keeps."""

    async def take_and_vanish(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(4)
        offer = msgspec.json.decode(
            await r.readexactly(wire.length(await r.readexactly(4))), type=wire.Offer
        )
        w.write(wire.answer_frame(wire.Answer(ok=True)))
        await w.drain()
        await r.readexactly(offer.size)
        w.close()

    vanishing = await asyncio.start_server(take_and_vanish, "127.0.0.1", 0)
    gone = int(vanishing.sockets[0].getsockname()[1])
    outbox = Outbox(bus, what="test facts")
    outbox.start()
    holder = ReplicaServer(NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 1 << 26, _nothing)
    port = await holder.start()
    engines = {0: FlashEngine(f"{JOB}-m", 0, directory=tmp_path)}
    sender = ReplicaSender(NodeFacts(_Facts(), job=JOB, node="na"), replicas=1)  # type: ignore[arg-type]
    sending = asyncio.create_task(sender.run())
    try:
        sender.new_round(1, [_member("na", port=0), _member("nb", port=gone)], engines)
        engines[0].save(1, {"w": torch.randn(200, 100)})
        sender.offer(1)
        await eventually(lambda: "nb" in sender._backoff, timeout=30)
        one = sender.kept(1, 0)
        assert one is not None and "nb" not in sender.sent
        assert xxhash.xxh3_64_intdigest(one[1]) == one[0].checksum
        # a new round (going on from step 1) makes a live holder na's peer
        sender.new_round(2, [_member("na", port=0), _member("nb", port=port)], engines, 1)
        assert sender.kept(1, 0) == one
        engines[0].save(2, {"w": torch.randn(200, 100)})
        sender.offer(2)
        await eventually(lambda: sender.sent.get("nb") == 2, timeout=30)
        two = sender.kept(2, 0)
        assert two is not None and two[1] is not one[1]  # step 2 went into another buffer
        assert sender.kept(1, 0) is None and sender._maybe == {}
    finally:
        sending.cancel()
        vanishing.close()
        await holder.stop()
        await outbox.stop()


def test_an_engine_takes_a_replica_and_loads_it_verified(tmp_path: Path) -> None:
    from rove.agent.saver import Saver

    src = FlashEngine(f"{JOB}-a", 1, directory=tmp_path / "a")
    state = {"w": torch.randn(64, 32), "n": torch.arange(5)}
    src.save(7, state)
    saver = Saver(f"{JOB}-a", None)
    saver.engines = {1: src}
    got = saver.raw(7, 1)
    assert got is not None and saver.raw(8, 1) is None
    manifest, raw = got
    dst = FlashEngine(f"{JOB}-a", 1, directory=tmp_path / "b")
    dst.install(7, raw, manifest.meta_len, manifest.checksum)
    step, back = dst.load(7)
    assert step == 7 and torch.equal(back["w"], state["w"]) and torch.equal(back["n"], state["n"])
    # a replica installed with a wrong checksum is refused on load, never trained from
    bad = FlashEngine(f"{JOB}-a", 1, directory=tmp_path / "c")
    bad.install(7, raw, manifest.meta_len, manifest.checksum ^ 1)
    with pytest.raises(CheckpointError, match="checksum"):
        bad.load(7)


@pytest.mark.slow
async def test_a_whole_node_lost_after_a_flash_save_resumes_from_its_peer_not_storage(
    bus: Bus, tmp_path: Path
) -> None:
    """Two nodes that persist every 50th step. After a step N < 50 of nb reached na, the
    whole of nb (agent, warm servers, worker) is killed with SIGKILL and its shared
    memory deleted; a new nb (empty memory) joins: the round restores step N from peers
    (nb's rank fetched from na's replica), not from storage (which has nothing yet),
    both ranks resume right after it, and the job finishes."""
    import shutil

    from tests.support import MasterProc, patience, rove_cli, trace_rows

    job = "rp"
    master = MasterProc(bus.url, job, "m1", tmp_path, "--node-timeout", "3")
    trace = tmp_path / "trace.jsonl"

    def node(name: str, log: str) -> RunProc:
        # storage there, but nothing persisted yet when the node is lost
        return _node(tmp_path, bus.url, job, name, log, nnodes=2, persist_every=50)

    async def events(kind: type[ev.Event]) -> list[ev.Event]:
        return [r.event for r in await stored_events(bus, job) if isinstance(r.event, kind)]

    a, b = node("na", "na"), node("nb", "nb")
    b2 = None
    try:
        await eventually(lambda: _replica_of(events, "nb", at_least=15), timeout=120)
        # the whole node at once: its agent, its warm servers and its worker, with -9
        await _kill_whole([b])
        shutil.rmtree(tmp_path / "shm-nb")  # its memory is gone with it
        b2 = node("nb", "nb-again")
        first = (await events(ev.RoundCompleted))[0]
        assert isinstance(first, ev.RoundCompleted)
        old_nb = next(m.incarnation for m in first.members if m.node == "nb")

        async def resumed() -> ev.RoundCompleted | None:
            return next(  # the first round with the new nb
                (
                    r
                    for r in await events(ev.RoundCompleted)
                    if isinstance(r, ev.RoundCompleted)
                    and any(m.node == "nb" and m.incarnation != old_nb for m in r.members)
                ),
                None,
            )

        r2 = await eventually(resumed, timeout=120)
        facts = [
            (type(e).__name__, e.node, getattr(e, "source", ""), getattr(e, "step", None))
            for e in [*await events(ev.CkptInMemory), *await events(ev.ReplicaStored)]
        ]
        assert r2.restore_source is ev.RestoreSource.PEER, (r2, facts)
        step = r2.restore_step
        assert step is not None and step >= 15, r2
        # each rank whose runner does not hold it comes from na: nb's old rank from na's
        # replica of nb, na's old rank from na's own memory if another node runs it now
        ran = {m.first_rank: m.node for m in first.members}
        runs = {m.first_rank: m.node for m in r2.members}
        want = tuple(
            ev.RestoreFetch(r, "na", ran[r])
            for r in sorted(runs)
            if not (ran[r] == "na" and runs[r] == "na")
        )
        assert r2.fetches == want, (r2.fetches, want)
        # the new nb's agent received and sealed the fetched rank without torch: importing
        # it in the agent's event loop silenced its heartbeats past the node timeout on
        # busy cores (CI), and the master declared the new nb lost too
        await eventually(lambda: "fetched rank" in b2.log(), timeout=60)
        maps = Path(f"/proc/{b2.proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps
        assert a.proc.wait(patience(120)) == 0, a.log()[-3000:]
        assert b2.proc.wait(patience(60)) == 0, b2.log()[-3000:]
        resumed_rows = [r for r in trace_rows(trace) if r["source"] != "none"]
        firsts: dict[int, int] = {}
        for row in resumed_rows:
            firsts[row["rank"]] = min(firsts.get(row["rank"], 10**9), row["step"])
        assert firsts == {0: step + 1, 1: step + 1}, firsts  # not from scratch, not storage
        assert {r["source"] for r in resumed_rows} == {"memory"}  # the peer's, now local
        assert "fetched rank" in b2.log() and f"of step {step} from na" in b2.log()
        status = rove_cli("status", "--job", job, "--nats", bus.url).stdout
        assert f"restored step {step} from peer, {counted(len(want), 'rank')} fetched" in status, (
            status
        )
        goodput = rove_cli("goodput", "--job", job, "--nats", bus.url).stdout
        assert "1 from peer" in goodput, goodput
    finally:
        for p in (a, b, b2):
            if p is not None:
                p.stop()
        master.stop()


async def _replica_of(events: Any, source: str, at_least: int) -> bool:
    return any(e.source == source and e.step >= at_least for e in await events(ev.ReplicaStored))


async def test_a_restore_fetch_corrupted_in_transit_is_refused_and_storage_is_next(
    bus: Bus, tmp_path: Path
) -> None:
    """A rank fetched for a restore fails its checksum on the way: nothing enters this
    node's memory (the workers then find the step missing, and every rank falls back to
    storage together, `rove.checkpoint.restore`), and the log says which rank and why."""
    from structlog.testing import capture_logs

    from rove.agent.replicas import PeerReplicas
    from rove.agent.saver import Saver

    outbox = Outbox(bus, what="test facts")
    outbox.start()
    src = FlashEngine(f"{JOB}-r", 1, directory=tmp_path / "na")
    src.save(10, {"w": torch.randn(300, 100)})
    saver = Saver(f"{JOB}-r", None)
    saver.engines = {1: src}
    holder = PeerReplicas(NodeFacts(outbox, job=JOB, node="na"), "127.0.0.1", 1, 1 << 26, saver.raw)
    await holder.start()
    proxy = FlippingProxy(holder.port, down=True)
    via = await proxy.start()
    mine = {1: FlashEngine(f"{JOB}-r", 1, directory=tmp_path / "nb")}
    here = PeerReplicas(NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 1, 1 << 26, _nothing)
    r = msgspec.structs.replace(
        factories.round_completed(2, 1, "nb", "na"),
        members=(_member("nb", port=1), _member("na", port=via)),
        restore_step=10,
        restore_source=ev.RestoreSource.PEER,
        fetches=(ev.RestoreFetch(1, "na", "na"),),
    )
    try:
        with capture_logs() as logs:
            await here.restore(r, mine)
        said = [e["event"] for e in logs if e["log_level"] == "warning"]
        assert any(
            "could not fetch rank 1 of step 10 from na" in s and "checksum" in s for s in said
        ), logs
        assert mine[1].slots() == []
        proxy.corrupt = False  # the same fetch, whole: the rank is in memory, verified
        await here.restore(r, mine)
        step, state = mine[1].load(10)
        assert step == 10 and torch.equal(state["w"], src.load(10)[1]["w"])
    finally:
        await holder.stop()
        await outbox.stop()


@pytest.mark.slow
async def test_a_lost_node_whose_peer_is_lost_too_resumes_from_storage(
    cluster_bus: Bus, tmp_path: Path
) -> None:
    """Three nodes, each persisting every 10th step. Once a step of nb reached its peer
    and a step is committed, the whole of nb and the whole of the peer holding its
    replica are killed with SIGKILL, their shared memory deleted; new agents of both
    join. No member holds nb's ranks in memory: the round restores the committed step
    from storage, every rank resumes right after it, and the job finishes. On a 3-node
    NATS cluster (R3 streams); the single-node restore from a peer runs on one server."""
    bus = cluster_bus
    import shutil

    from tests.support import MasterProc, patience, trace_rows

    job = "rp3"
    master = MasterProc(bus.url, job, "m1", tmp_path, "--node-timeout", "3")
    trace = tmp_path / "trace.jsonl"

    def node(name: str, log: str) -> RunProc:
        return _node(tmp_path, bus.url, job, name, log, nnodes=3, persist_every=10)

    async def events(kind: type[ev.Event]) -> list[ev.Event]:
        return [r.event for r in await stored_events(bus, job) if isinstance(r.event, kind)]

    async def holder_of_nb() -> str | None:
        held = [e for e in await events(ev.ReplicaStored) if e.source == "nb"]  # type: ignore[attr-defined]
        committed = await events(ev.CkptCommitted)
        return held[0].node if held and committed else None

    procs = {n: node(n, n) for n in ("na", "nb", "nc")}
    again: list[RunProc] = []
    try:
        peer = await eventually(holder_of_nb, timeout=120)
        lost = ["nb", peer]
        (survivor,) = {"na", "nb", "nc"} - set(lost)
        first = next(e for e in await events(ev.RoundCompleted) if isinstance(e, ev.RoundCompleted))
        await _kill_whole([procs[n] for n in lost])  # both at once, with -9
        for n in lost:
            shutil.rmtree(tmp_path / f"shm-{n}")
        again = [node(n, f"{n}-again") for n in lost]
        old = {m.node: m.incarnation for m in first.members}

        async def resumed() -> ev.RoundCompleted | None:
            return next(  # the first round with both new agents
                (
                    r
                    for r in await events(ev.RoundCompleted)
                    if isinstance(r, ev.RoundCompleted)
                    and all(
                        any(m.node == n and m.incarnation != old[n] for m in r.members)
                        for n in lost
                    )
                ),
                None,
            )

        r2 = await eventually(resumed, timeout=120)
        committed = [e.step for e in await events(ev.CkptCommitted)]  # type: ignore[attr-defined]
        logs = "\n".join(p.log()[-1500:] for p in [*procs.values(), *again])
        assert r2.restore_source is ev.RestoreSource.STORAGE, (r2, logs)
        assert r2.restore_step is not None and r2.restore_step in committed, (r2, committed)
        assert r2.fetches == ()
        step = r2.restore_step
        for p in (procs[survivor], *again):
            assert p.proc.wait(patience(120)) == 0, p.log()[-3000:]
        resumed_rows = [r for r in trace_rows(trace) if r["source"] != "none" and r["step"] > 0]
        firsts: dict[int, int] = {}
        for row in resumed_rows:
            firsts[row["rank"]] = min(firsts.get(row["rank"], 10**9), row["step"])
        assert firsts == {0: step + 1, 1: step + 1, 2: step + 1}, firsts
        assert "storage" in {r["source"] for r in resumed_rows}
    finally:
        for p in [*procs.values(), *again]:
            p.stop()
        master.stop()


async def _at_least(value: Any, floor: int) -> bool:
    return bool(await value >= floor)


async def test_a_transfer_that_fails_on_a_bug_is_said_and_the_server_goes_on(
    tmp_path: Path,
) -> None:
    """A get whose own-memory lookup raises something no network explains: the server
    logs it with its traceback, ends that transfer only, and answers the next one."""
    from structlog.testing import capture_logs

    def broken(_step: int, _rank: int) -> None:
        raise RuntimeError("a bug in the lookup")

    holder = ReplicaServer(NodeFacts(_Facts(), job=JOB, node="nb"), "127.0.0.1", 1 << 20, broken)  # type: ignore[arg-type]
    port = await holder.start()
    try:
        with capture_logs() as logs:
            with pytest.raises(CheckpointError, match="left after 0 of 4 bytes"):
                await fetch("127.0.0.1", port, wire.Want(job=JOB, source="nb", step=1, rank=0))
            await eventually(lambda: any(e["event"] == "a replica transfer failed" for e in logs))
        failed = next(e for e in logs if e["event"] == "a replica transfer failed")
        assert failed["log_level"] == "error" and "a bug in the lookup" in str(failed["exc_info"])
        with pytest.raises(CheckpointError, match="no replica of step 1 rank 0 of na here"):
            await fetch("127.0.0.1", port, wire.Want(job=JOB, source="na", step=1, rank=0))
    finally:
        await holder.stop()


def _node(
    tmp_path: Path, url: str, job: str, name: str, log: str, *, nnodes: int, persist_every: int
) -> RunProc:
    """A `rove run` node of a replica job (one worker, its own shared memory in
    `shm-{log}`): a save every second, so a step's replica reaches its peer before the
    next save, persisted every `persist_every` steps."""
    from tests.test_runtime import TRAIN

    shm = tmp_path / f"shm-{log}"
    shm.mkdir()
    return RunProc(
        tmp_path,
        log,
        *("--nats", url, "--job", job, "--node-id", name, "--local-addr", "127.0.0.1"),
        *("--nnodes", str(nnodes), "--nproc-per-node", "1", "--max-restarts", "5"),
        *("--heartbeat-interval", "0.5", "--last-call-timeout", "1"),
        *("--checkpoint-dir", str(tmp_path / "store"), "--persist-every", str(persist_every)),
        *(str(TRAIN), "--steps", "60", "--step-sleep", "0.2", "--ckpt-every", "5"),
        *("--ckpt-dir", str(tmp_path / "ckpt"), "--trace", str(tmp_path / "trace.jsonl")),
        *("--log-every", "50"),
        env={"ROVE_SHM_DIR": str(shm)},
    )


async def _kill_whole(nodes: list[RunProc]) -> None:
    """SIGKILL the whole of each node at once (its agent, warm servers and workers), and
    wait until every one of those processes is gone."""
    import contextlib
    import os
    import signal

    import psutil

    from tests.support import pid_alive

    pids = [
        pid
        for n in nodes
        for pid in (
            n.proc.pid,
            *(c.pid for c in psutil.Process(n.proc.pid).children(recursive=True)),
        )
    ]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for n in nodes:
        n.proc.wait()
    await eventually(lambda: not any(pid_alive(p) for p in pids), timeout=30)


async def test_the_copies_of_ranks_a_node_no_longer_runs_go_once_a_newer_step_is_taken(
    bus: Bus, tmp_path: Path
) -> None:
    """na ran ranks 0 and 1 and its peer took step 1 of both; the next round renumbers
    na to rank 0 alone. Rank 1's copy of step 1 stays for that round's restore, and goes
    (with its memory) once the peer takes step 2: nothing of a rank na no longer runs is
    kept for good."""
    outbox = Outbox(bus, what="test facts")
    outbox.start()
    holder = ReplicaServer(NodeFacts(outbox, job=JOB, node="nb"), "127.0.0.1", 1 << 26, _nothing)
    port = await holder.start()
    engines = {r: FlashEngine(f"{JOB}-s{r}", r, directory=tmp_path) for r in (0, 1)}
    sender = ReplicaSender(NodeFacts(_Facts(), job=JOB, node="na"), replicas=1)  # type: ignore[arg-type]
    sending = asyncio.create_task(sender.run())
    try:
        sender.new_round(1, [_member("na", port=0), _member("nb", port=port)], engines)
        for engine in engines.values():
            engine.save(1, {"w": torch.randn(200, 100)})
        sender.offer(1)
        await eventually(lambda: sender.sent.get("nb") == 1, timeout=30)
        assert sender.kept(1, 0) is not None and sender.kept(1, 1) is not None
        mine = {0: engines[0]}
        sender.new_round(2, [_member("na", port=0), _member("nb", port=port)], mine, 1)
        assert sender.kept(1, 1) is not None, "kept for the new round's restore"
        engines[0].save(2, {"w": torch.randn(200, 100)})
        sender.offer(2)
        await eventually(lambda: sender.sent.get("nb") == 2, timeout=30)
        assert sender.kept(2, 0) is not None and sender.kept(1, 1) is None
        held = {*sender._copies, *sender._kept, *sender._maybe}
        assert held == {0}, "no buffer of rank 1 is left"
    finally:
        sending.cancel()
        await holder.stop()
        await outbox.stop()
