"""Datasets and shard leases in the master's fold (pure): allocation, acknowledgement,
requeue, rollback to a checkpoint's position, and refused input."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.control.master import data as data_fold
from rove.control.master.state import JobState
from shard_service.tracker import Tracker
from tests import factories
from tests.sim import Sim

SPEC = ev.DatasetSpec(size=100, shard_size=10, epochs=2, seed=3, lease_s=30.0)


class Data:
    """A simulated master plus data clients publishing facts with a clock."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        self.n = 0

    def _env(self, client: str) -> dict[str, object]:
        self.n += 1
        return {"job": "j1", "id": f"{client}:{self.n}", "producer": client, "ts": self.sim.now}

    def register(
        self, client: str, spec: ev.DatasetSpec = SPEC, name: str = "d", round: int = 0
    ) -> None:
        self.sim.apply(
            ev.DatasetRegistered(
                **self._env(client),  # type: ignore[arg-type]
                dataset=name,
                spec=spec,
                client=client,
                round=round,
            )
        )

    def request(self, client: str, count: int, **kw: object) -> ev.ShardLeased | ev.DataRejected:
        answers = self.ask(client, count, **kw)
        assert len(answers) == 1, answers
        return answers[0]

    def ask(self, client: str, count: int, **kw: object) -> list[ev.ShardLeased | ev.DataRejected]:
        """Request `count` shards, stamped by the node's clock (`Sim.stamp`); the answers
        the next tick gives `client` (none while a stream's request is parked)."""
        node = str(kw.pop("node", "na"))
        req = ev.ShardRequested(
            **{**self._env(client), "ts": self.sim.stamp(node)},  # type: ignore[arg-type]
            dataset=kw.pop("dataset", "d"),  # type: ignore[arg-type]
            client=client,
            request=self.n,
            count=count,
            node=node,
            **kw,  # type: ignore[arg-type]
        )
        self.sim.apply(req)
        return self.answers(client, self.sim.tick())

    @staticmethod
    def answers(
        client: str, decisions: list[ev.Decision]
    ) -> list[ev.ShardLeased | ev.DataRejected]:
        return [
            d
            for d in decisions
            if isinstance(d, ev.ShardLeased | ev.DataRejected) and d.client == client
        ]

    def done(self, client: str, ref: ev.ShardRef, **kw: object) -> list[ev.Decision]:
        self.sim.apply(
            ev.ShardDone(**self._env(client), dataset="d", client=client, shard=ref, **kw)  # type: ignore[arg-type]
        )
        return self.sim.tick()

    @property
    def state(self) -> JobState:
        return self.sim.state


@pytest.fixture
def data() -> Data:
    d = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    d.register("c1")
    return d


def test_shards_are_handed_out_in_order_and_cover_every_index_once_per_epoch() -> None:
    per = shards.per_epoch(SPEC)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for key in range(shards.total(SPEC)):
        seen[shards.epoch_of(SPEC, key)].extend(shards.indices(SPEC, ev.ShardRef(key)))
    assert per == 10
    assert sorted(seen[0]) == list(range(100)) == sorted(seen[1])
    assert seen[0] != seen[1], "each epoch has its own order"
    assert seen[0] != list(range(100)), "shuffled"
    assert shards.indices(SPEC, ev.ShardRef(3, 4)) == shards.indices(SPEC, ev.ShardRef(3))[4:]


def test_requests_get_distinct_shards_and_exhaustion_is_said(data: Data) -> None:
    a = data.request("c1", 3)
    data.register("c2")
    b = data.request("c2", 20, node="nb")
    assert isinstance(a, ev.ShardLeased) and isinstance(b, ev.ShardLeased)
    assert [r.key for r in a.shards] == [0, 1, 2]
    assert [r.key for r in b.shards] == list(range(3, 20))
    assert not b.exhausted
    last = data.request("c2", 1, node="nb")
    assert isinstance(last, ev.ShardLeased) and last.shards == () and last.exhausted
    # announced, not folded: each grant is kept until its client says it arrived
    assert sorted(data.state.data.datasets["d"].grants) == ["c1/2", "c2/4", "c2/5"]
    assert data.ask("c2", 0, node="nb", answered=last.request) == []
    assert data.ask("c1", 0, answered=a.request - 1) == []
    assert sorted(data.state.data.datasets["d"].grants) == ["c1/2"], "c1's is not yet answered"
    data.ask("c1", 0, answered=a.request)
    assert len(data.state.data.datasets["d"].grants) == 0
    assert len(data.state.data.datasets["d"].granted) == 0


def test_done_counts_per_node_and_bad_acknowledgements_are_refused(data: Data) -> None:
    a = data.request("c1", 2)
    assert isinstance(a, ev.ShardLeased)
    data.done("c1", a.shards[0])
    before = data.state.data.datasets["d"]
    assert before.nodes["na"].shards == 1 and before.nodes["na"].samples == 10
    data.register("c2")
    cases = {
        "duplicate acknowledgement of shard 0": ("c1", ev.ShardRef(0)),
        "shard 1 is leased to c1, not to c2": ("c2", ev.ShardRef(1)),
        "shard 7 is not leased to anyone": ("c1", ev.ShardRef(7)),
        "shard 99 is out of range": ("c1", ev.ShardRef(99)),
    }
    for reason, (client, ref) in cases.items():
        out = data.done(client, ref)
        (rejected,) = [d for d in out if isinstance(d, ev.DataRejected)]
        assert reason in rejected.reason and rejected.client == client
        after = data.state.data.datasets["d"]
        assert (after.leases, after.done, after.nodes) == (before.leases, before.done, before.nodes)
    assert data.state.data.rejections == (), "every rejection was announced"


def test_unknown_dataset_conflicting_and_invalid_registrations_are_refused(data: Data) -> None:
    out = data.request("c1", 1, dataset="nope")
    assert isinstance(out, ev.DataRejected) and "unknown dataset nope" in out.reason
    data.register("c1")  # the same spec again: idempotent
    data.register("c9", ev.DatasetSpec(size=101, shard_size=10, epochs=2, seed=3, lease_s=30.0))
    (rej,) = [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert "registered with size=100" in rej.reason and "registers size=101" in rej.reason
    assert data.state.data.datasets["d"].spec == SPEC
    refused = data.request("c9", 1)
    assert isinstance(refused, ev.DataRejected) and "registration was refused" in refused.reason
    data.register("c1", ev.DatasetSpec(size=0, shard_size=1), name="bad")
    (rej,) = [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert "size must be at least 1" in rej.reason and "bad" not in data.state.data.datasets


def test_expired_leases_and_leases_of_lost_nodes_go_back_to_todo_first() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2), node_timeout=5))
    data.register("c1")
    data.sim.join("na")
    data.sim.join("nb")
    a = data.request("c1", 2)
    assert isinstance(a, ev.ShardLeased)
    data.sim.wait(4, "na", "nb")
    data.sim.wait(4, "na", "nb")
    data.sim.apply(
        ev.ShardRequested(
            **data._env("c1"), dataset="d", client="c1", request=99, count=0, node="na", held=(0,)
        )  # type: ignore[arg-type]
    )  # renews shard 0 only; a renewal gets no answer
    for _ in range(6):  # shard 1's lease (30 s) expires, shard 0's was renewed
        data.sim.wait(4, "na", "nb")
    (requeued,) = [d for d in data.sim.decisions if isinstance(d, ev.ShardRequeued)]
    assert requeued.reason == "lease_expired" and [r.key for r in requeued.shards] == [1]
    data.register("c2")
    again = data.request("c2", 1, node="nb")
    assert isinstance(again, ev.ShardLeased) and [r.key for r in again.shards] == [1]

    data.sim.wait(6, "na")  # nb stops heartbeating: lost
    lost = [
        d for d in data.sim.decisions if isinstance(d, ev.ShardRequeued) and d.reason == "node_lost"
    ]
    assert [r.key for d in lost for r in d.shards] == [1]


def test_the_leases_of_a_node_that_left_go_back_to_todo_as_left_not_lost() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2), node_timeout=5))
    data.register("c1")
    data.sim.join("na")
    data.sim.join("nb")
    a = data.request("c1", 1, node="na")
    b = data.request("c1", 2, node="nb")
    assert isinstance(a, ev.ShardLeased) and isinstance(b, ev.ShardLeased)
    data.sim.apply(factories.left("nb", ts=data.sim.stamp("nb")))  # stopped on purpose
    requeued = [d for d in data.sim.wait(1, "na") if isinstance(d, ev.ShardRequeued)]
    assert [(d.reason, [r.key for r in d.shards]) for d in requeued] == [
        ("node_left", [r.key for r in b.shards])
    ], "its own leases, at once, said as a leave (rove events read node_lost)"
    for _ in range(3):  # and only once; na's leases are untouched
        assert not [d for d in data.sim.wait(1, "na") if isinstance(d, ev.ShardRequeued)]


def test_a_new_round_rolls_the_dataset_back_to_the_restored_position(data: Data) -> None:
    a = data.request("c1", 4, round=1)
    assert isinstance(a, ev.ShardLeased)
    for ref in a.shards[:3]:
        data.done("c1", ref, round=1)
    # the checkpoint had shards 0 and 1 done and shard 2 trained up to 4
    pos = ev.DataPosition(done=((0, 1),), partial=(ev.ShardRef(2, 4),))
    b = data.request("c1", 3, round=2, restore=pos, restore_step=17)
    fresh, restored = [d for d in data.sim.decisions if isinstance(d, ev.DataRestored)]
    assert (fresh.round, fresh.step) == (1, None)
    assert (restored.round, restored.step, restored.done_shards, restored.partial_shards) == (
        2,
        17,
        2,
        1,
    )
    assert isinstance(b, ev.ShardLeased)
    assert b.shards == (ev.ShardRef(2, 4), ev.ShardRef(3, 0), ev.ShardRef(4, 0))
    old = data.done("c1", ev.ShardRef(3), round=1)
    assert any(isinstance(d, ev.DataRejected) and "round 1" in d.reason for d in old)
    stale = data.request("c1", 1, round=1)
    assert isinstance(stale, ev.DataRejected) and "finished round" in stale.reason


def test_a_newer_round_may_ask_for_more_epochs_of_the_same_shards_and_goes_on_where_it_stood(
    data: Data,
) -> None:
    """A job cut off and run again with more steps goes on with its run: its new round
    registers more epochs. (It was refused: "use the same parameters".)"""
    longer = ev.DatasetSpec(size=100, shard_size=10, epochs=5, seed=3, lease_s=60.0)
    data.register("c1", SPEC, round=1)
    a = data.request("c1", 3, round=1)
    assert isinstance(a, ev.ShardLeased)
    for ref in a.shards:
        data.done("c1", ref, round=1)
    data.register("c1", longer, round=1)  # the same round: not another spec
    (rej,) = [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert "registered with size=100 shard_size=10 epochs=2" in rej.reason
    data.register("c2", longer, round=2)
    data.register("c3", longer, round=2)  # every rank of the round registers
    assert not [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert data.state.data.datasets["d"].spec == longer
    pos = ev.DataPosition(done=((0, 2),))
    b = data.request("c2", 2, round=2, restore=pos, restore_step=3)
    assert isinstance(b, ev.ShardLeased) and [r.key for r in b.shards] == [3, 4]
    assert "3/50 shards done" in _status_line(data), "5 epochs of 10 shards"
    data.register("c4", SPEC, round=1)  # a worker of the round before: refused
    (stale,) = [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert "registered with size=100 shard_size=10 epochs=5" in stale.reason
    other = ev.DatasetSpec(size=100, shard_size=10, epochs=5, seed=4, lease_s=60.0)
    data.register("c5", other, round=3)  # other shards: never
    (refused,) = [d for d in data.sim.tick() if isinstance(d, ev.DataRejected)]
    assert "seed=4" in refused.reason and data.state.data.datasets["d"].spec == longer


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**31), st.integers(2, 4))
def test_exactly_once_in_the_lineage_across_random_failures(seed: int, ranks: int) -> None:
    """Ranks train batches in lockstep, checkpoint, and crash at random; every
    restore rolls back to the newest checkpoint. Replaying the lineage of the
    final model, every index of every epoch is trained exactly once. A rank
    acknowledges a shard alone or in its next request (lost if it crashes first)."""
    rnd = random.Random(seed)
    spec = ev.DatasetSpec(
        size=rnd.randint(20, 120), shard_size=rnd.randint(1, 9), epochs=2, seed=seed
    )
    d = Data(Sim(ev.RdzvParams()))
    round_, step = 1, 0
    checkpoint: tuple[int, ev.DataPosition] | None = None
    lineage: dict[int, list[tuple[int, int]]] = {}  # step -> (epoch, index) trained
    restore: ev.DataPosition | None = None

    for _ in range(400):
        world = rnd.randint(1, ranks)
        trackers = [Tracker(spec) for _ in range(world)]
        clients = [f"r{round_}-{i}" for i in range(world)]
        for c in clients:
            d.register(c, spec)
        for t in trackers:
            if restore is not None:
                t.restore(restore)
        first = {c: True for c in clients}
        exhausted = {c: False for c in clients}
        acks: dict[str, list[ev.ShardRef]] = {c: [] for c in clients}  # to ride in a request
        answered = {c: 0 for c in clients}
        crash_at = step + rnd.randint(1, 12)
        while step < crash_at:
            step += 1
            trained: list[tuple[int, int]] = []
            for c, t in zip(clients, trackers, strict=True):
                batch: list[tuple[int, int]] = []
                while len(batch) < 3 and not exhausted[c]:
                    if t.untaken() == 0:
                        extra = (
                            {"restore": restore, "restore_step": checkpoint and checkpoint[0]}
                            if first[c]
                            else {}
                        )
                        first[c] = False
                        ans = d.request(
                            c,
                            rnd.randint(1, 2),
                            round=round_,
                            held=tuple(t.held),
                            done=tuple(acks[c]),
                            answered=answered[c],
                            **extra,
                        )
                        acks[c] = []
                        assert isinstance(ans, ev.ShardLeased), ans
                        answered[c] = ans.request
                        t.add(ans.shards)
                        exhausted[c] = ans.exhausted
                        continue
                    got = t.take(3 - len(batch))
                    keys = [k for k, n in t.inflight[-1] for _ in range(n)] if got else []
                    batch += [(shards.epoch_of(spec, k), i) for k, i in zip(keys, got, strict=True)]
                if batch:
                    while t.inflight:
                        for ref in t.delivered():
                            if rnd.random() < 0.5:
                                d.done(c, ref, round=round_)
                            else:
                                acks[c].append(ref)
                trained += batch
            lineage[step] = trained
            if all(exhausted.values()) and all(t.untaken() == 0 for t in trackers):
                break
            if rnd.random() < 0.5:  # checkpoint: the position of every rank, merged
                checkpoint = (step, shards.merge(t.position() for t in trackers))
        if all(exhausted.values()) and all(t.untaken() == 0 for t in trackers):
            break
        # crash: restore the newest checkpoint (or start over) in a new round
        round_ += 1
        restored = checkpoint[0] if checkpoint else 0
        restore = checkpoint[1] if checkpoint else None
        lineage = {s: v for s, v in lineage.items() if s <= restored}
        step = restored
    samples = sorted(x for v in lineage.values() for x in v)
    expected = sorted((e, i) for e in range(spec.epochs) for i in range(spec.size))
    assert samples == expected


def test_the_fast_shuffle_gives_exactly_pythons_shuffle() -> None:
    """Positions saved in checkpoints point into this order: it must never change."""
    import random

    from rove.control.domain.shards import shuffle

    for seed in range(100):
        for n in (0, 1, 2, 3, 255, 256, 257, 512):
            expected, got = list(range(n)), list(range(n))
            random.Random(seed).shuffle(expected)
            shuffle(got, random.Random(seed))
            assert got == expected, (seed, n)


STREAM = ev.DatasetSpec(size=0, shard_size=0, stream=True, lease_s=30.0)


def _cut(data: Data, *ranges: tuple[int, int, int]) -> None:
    shards_ = tuple(ev.StreamShard(p, a, b) for p, a, b in ranges)
    data.sim.apply(
        ev.StreamShardsAdded(
            **data._env("bridge:b1"),  # type: ignore[arg-type]
            dataset="d",
            topic="clicks",
            bridge="b1",
            shards=shards_,
        )
    )


def test_a_stream_dataset_leases_the_shards_a_bridge_cut_with_their_offset_ranges() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    assert data.ask("c1", 2) == [], "nothing cut yet: the request waits in the master"
    _cut(data, (0, 0, 10), (1, 0, 4), (0, 10, 20))
    (got,) = data.answers("c1", data.sim.tick())
    assert isinstance(got, ev.ShardLeased), "the cut shards go to the parked request"
    assert [r.key for r in got.shards] == [0, 1] and got.request == data.n - 1
    assert got.ranges == (ev.StreamShard(0, 0, 10), ev.StreamShard(1, 0, 4))
    assert not got.exhausted, "a stream never ends"
    assert not data.state.data.datasets["d"].parked
    data.done("c1", ev.ShardRef(0))
    ds = data.state.data.datasets["d"]
    assert data_fold.is_done(ds, 0) and not data_fold.is_done(ds, 1)
    assert data_fold.done_count(data.state.data, ds) == 1 and ds.nodes["na"].samples == 10
    # a new round restores a checkpoint that had trained shard 0 and 3 records of shard 1
    pos = ev.DataPosition(done=((0, 0),), partial=(ev.ShardRef(1, 3),))
    again = data.request("c1", 3, round=1, restore=pos, restore_step=7)
    assert isinstance(again, ev.ShardLeased)
    assert [(r.key, r.offset) for r in again.shards] == [(1, 3), (2, 0)]
    assert again.ranges == (ev.StreamShard(1, 0, 4), ev.StreamShard(0, 10, 20))


def test_a_stream_spec_with_a_size_or_epochs_is_refused() -> None:
    assert shards.spec_problem(STREAM) is None
    bad = ev.DatasetSpec(size=10, shard_size=0, stream=True)
    assert "stream dataset has size 0" in (shards.spec_problem(bad) or "")
    assert "stream" in (
        shards.spec_problem(ev.DatasetSpec(size=0, shard_size=0, epochs=2, stream=True)) or ""
    )


def _saved(data: Data, step: int, position: ev.DataPosition, round_: int = 0) -> None:
    data.sim.apply(
        ev.StreamCheckpointed(
            **data._env("c1-main"),  # type: ignore[arg-type]
            dataset="d",
            client="c1-main",
            step=step,
            round=round_,
            done=position.done,
            partial=tuple((r.key, r.offset) for r in position.partial),
        )
    )


def _committed(data: Data, step: int, round_: int = 0) -> None:
    data.sim.apply(replace(factories.committed(step, epoch=1), round=round_))


def test_a_commit_prunes_the_stream_below_its_position_and_older_restores_are_refused() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    _cut(data, (0, 0, 10), (1, 0, 4), (0, 10, 20), (1, 4, 8))  # keys 0..3
    assert [r.key for r in data.request("c1", 4).shards] == [0, 1, 2, 3]  # type: ignore[union-attr]
    for key in (0, 1, 3):
        data.done("c1", ev.ShardRef(key))
    position = ev.DataPosition(done=((0, 1), (3, 3)), partial=(ev.ShardRef(2, 6),))
    _saved(data, 5, position)
    vector = data.state.data.streams.streams["d"].saved[-1].offsets
    assert vector == ((0, 16), (1, 8))
    _committed(data, 5)
    stream = data.state.data.streams.streams["d"]
    ds = data.state.data.datasets["d"]
    assert stream.floor == 2 and set(stream.shards) == {2, 3}, "shards 0 and 1 are pruned"
    assert set(ds.done) == {3} and data_fold.done_count(data.state.data, ds) == 3
    # the same position's offset vector is unchanged by the pruning
    _saved(data, 6, position)
    assert data.state.data.streams.streams["d"].saved[-1].offsets == vector
    # a restore to the committed position resumes as before
    _cut(data, (0, 20, 30))
    again = data.request("c1", 3, round=1, restore=position, restore_step=5)
    assert isinstance(again, ev.ShardLeased)
    assert [(r.key, r.offset) for r in again.shards] == [(2, 6), (4, 0)]
    assert again.ranges == (ev.StreamShard(0, 10, 20), ev.StreamShard(0, 20, 30))
    # positions older than the floor, or none, cannot be replayed: refused, saying why
    older = data.request("c1", 1, round=2, restore=ev.DataPosition(done=((0, 0),)))
    assert isinstance(older, ev.DataRejected)
    assert "shards 0..1 were pruned" in older.reason and "newest committed" in older.reason
    fresh = data.request("c1", 1, round=2)
    assert isinstance(fresh, ev.DataRejected) and "a fresh start" in fresh.reason


def test_an_acknowledgement_that_comes_after_a_commit_pruned_its_shard_is_taken() -> None:
    """Acknowledgements ride in the next request, so a checkpoint that trained a shard can
    be committed (and prune it) first: the lease goes, nothing fails, nothing is counted
    twice. (The fold raised KeyError here, and every master skipped the request.)"""
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    _cut(data, (0, 0, 10), (1, 0, 4), (0, 10, 20))  # keys 0..2
    a = data.request("c1", 3)
    assert isinstance(a, ev.ShardLeased) and [r.key for r in a.shards] == [0, 1, 2]
    position = ev.DataPosition(done=((0, 1),))
    _saved(data, 5, position)
    _committed(data, 5)
    assert data.state.data.streams.streams["d"].floor == 2
    _cut(data, (1, 4, 8))
    b = data.request("c1", 1, done=a.shards[:2], answered=a.request, held=(2,))
    assert isinstance(b, ev.ShardLeased) and [r.key for r in b.shards] == [3]
    ds = data.state.data.datasets["d"]
    assert sorted(ds.leases) == [2, 3] and set(ds.done) == set()
    assert data_fold.done_count(data.state.data, ds) == 2, "the floor's, once"


def _leased(
    answers: list[ev.ShardLeased | ev.DataRejected],
) -> list[tuple[int, int, ev.StreamShard]]:
    """(key, offset, range) of each shard the answers lease."""
    out = []
    for a in answers:
        assert isinstance(a, ev.ShardLeased), a
        out.extend((r.key, r.offset, rng) for r, rng in zip(a.shards, a.ranges, strict=True))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_pruning_changes_nothing_a_restorable_lineage_sees(seed: int) -> None:
    """Two masters fold the same stream script; one also folds the checkpoint commits
    (and prunes). Every lease, range and offset vector is the same in both."""
    rnd = random.Random(seed)
    pruned, whole = (Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))) for _ in range(2))
    for d in (pruned, whole):
        d.register("c1", STREAM)
    nxt = {0: 0, 1: 0, 2: 0}
    held: dict[int, int] = {}  # key -> records trained of it
    done: set[int] = set()
    saves: list[tuple[int, ev.DataPosition]] = []
    committed_at, step, round_ = -1, 0, 0
    for _ in range(120):
        roll = rnd.random()
        if roll < 0.25:  # the bridge cuts
            p = rnd.randrange(3)
            n = rnd.randint(1, 9)
            for d in (pruned, whole):
                _cut(d, (p, nxt[p], nxt[p] + n))
            nxt[p] += n
            # a request parked on the empty stream gets the new shards
            answers = [Data.answers("c1", d.sim.tick()) for d in (pruned, whole)]
            assert _leased(answers[0]) == _leased(answers[1])
            held.update((k, o) for k, o, _ in _leased(answers[0]))
        elif roll < 0.45:  # a lease (or a request parked until the next cut)
            count = rnd.randint(1, 3)
            answers = [d.ask("c1", count, round=round_) for d in (pruned, whole)]
            assert _leased(answers[0]) == _leased(answers[1])
            held.update((k, o) for k, o, _ in _leased(answers[0]))
        elif roll < 0.65 and held:  # train: a shard done, or part of one
            key = rnd.choice(sorted(held))
            if rnd.random() < 0.6:
                for d in (pruned, whole):
                    d.done("c1", ev.ShardRef(key), round=round_)
                done.add(key)
                del held[key]
            else:
                held[key] += 1
        elif roll < 0.8 and any(nxt.values()):  # a save of the lineage's position
            step += 1
            position = ev.DataPosition(
                done=shards.to_ranges(done),
                partial=tuple(ev.ShardRef(k, o) for k, o in sorted(held.items()) if o),
            )
            saves.append((step, position))
            for d in (pruned, whole):
                _saved(d, step, position, round_)
            vectors = [d.state.data.streams.streams["d"].saved[-1] for d in (pruned, whole)]
            assert vectors[0].offsets == vectors[1].offsets
        elif roll < 0.9 and saves:  # the newest save commits (only the pruned master sees it)
            committed_at = len(saves) - 1
            _committed(pruned, saves[committed_at][0], round_)
        elif saves and committed_at >= 0:  # a failure: restore a save at or after the commit
            at = rnd.randrange(committed_at, len(saves))
            restore_step, position = saves[at]
            round_ += 1
            answers = [
                d.ask("c1", 2, round=round_, restore=position, restore_step=restore_step)
                for d in (pruned, whole)
            ]
            assert not any(isinstance(a, ev.DataRejected) for a in answers[0]), answers[0]
            assert _leased(answers[0]) == _leased(answers[1])
            done = set(shards.from_ranges(position.done))
            held = {k: o for k, o, _ in _leased(answers[0])}
            saves = saves[: at + 1]
            committed_at = min(committed_at, at)
    assert pruned.state.data.streams.streams["d"].floor > 0, "the script pruned something"
    assert len(pruned.state.data.streams.streams["d"].shards) < len(
        whole.state.data.streams.streams["d"].shards
    )


def test_parked_stream_requests_get_shards_oldest_first_and_only_as_many_as_cut() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    data.register("c2", STREAM)
    assert data.ask("c1", 2) == []
    data.sim.now += 1
    assert data.ask("c2", 2, node="nb") == []
    assert "0 leased, 0 requeued, 2 waiting for records" in _status_line(data)
    _cut(data, (0, 0, 10), (1, 0, 4), (0, 10, 20))  # 3 shards for 4 asked
    decisions = data.sim.tick()
    (first,) = data.answers("c1", decisions)
    (second,) = data.answers("c2", decisions)
    assert isinstance(first, ev.ShardLeased) and isinstance(second, ev.ShardLeased)
    assert [r.key for r in first.shards] == [0, 1], "the older request first, in full"
    assert [r.key for r in second.shards] == [2]
    ds = data.state.data.datasets["d"]
    assert ds.leases[2].client == "c2" and ds.leases[2].node == "nb"
    assert ds.leases[2].deadline == data.sim.now + STREAM.lease_s
    assert not ds.parked and sorted(ds.grants) == [f"c1/{first.request}", f"c2/{second.request}"]
    assert "waiting for records" not in _status_line(data)


def _status_line(data: Data, ended: bool = False) -> str:
    """What `rove status` says of dataset d (of a job that has `ended`)."""
    from rove.control.cli.status_data import dataset_line, dataset_view

    return dataset_line(dataset_view(data.state.data, data.state.data.datasets["d"]), ended)


def test_an_ended_jobs_dataset_line_does_not_count_the_leases_its_workers_took_along() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", SPEC)
    assert len(data.ask("c1", 3)) == 1
    assert "0/20 shards done, 3 leased, 0 requeued" in _status_line(data)
    assert "0/20 shards done, 0 requeued" in _status_line(data, ended=True)


def test_a_request_parked_too_long_is_answered_empty_and_shards_cut_meanwhile_still_reach_it() -> (
    None
):
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    assert data.ask("c1", 2) == []
    assert data.answers("c1", data.sim.tick(data_fold.PARK_S / 2)) == [], "still waiting"
    (empty,) = data.answers("c1", data.sim.tick(data_fold.PARK_S))
    assert isinstance(empty, ev.ShardLeased) and empty.shards == () and not empty.exhausted
    assert data.answers("c1", data.sim.tick()) == [], "announced once"
    # shards cut before the client asks again still go to the request it made
    _cut(data, (0, 0, 10))
    (got,) = data.answers("c1", data.sim.tick())
    assert isinstance(got, ev.ShardLeased) and [r.key for r in got.shards] == [0]
    assert got.request == empty.request
    assert got.id != empty.id, "two answers to one request, neither lost as a duplicate"
    ds = data.state.data.datasets["d"]
    assert not ds.parked and ds.leases[0].client == "c1"
    # a client asking again voids its request answered empty: no shards go to that one
    assert data.ask("c1", 1) == []
    (again,) = data.answers("c1", data.sim.tick(data_fold.PARK_S))
    assert isinstance(again, ev.ShardLeased) and again.shards == ()
    assert data.ask("c1", 1) == []
    assert [w.request for w in data.state.data.datasets["d"].parked.values()] == [data.n]
    _cut(data, (0, 10, 20), (0, 20, 30))
    (last,) = data.answers("c1", data.sim.tick())
    assert last.request == data.n - 1 and [r.key for r in last.shards] == [1]
    assert data.state.data.datasets["d"].cursor == 2, "shard 2 waits for the next request"


def test_a_new_round_drops_the_requests_parked_by_the_round_before() -> None:
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    assert data.ask("c1", 2) == []
    assert data.ask("c2", 1, round=1) == []  # a worker of the next round, fresh start
    ds = data.state.data.datasets["d"]
    assert [w.client for w in ds.parked.values()] == ["c2"]
    _cut(data, (0, 0, 10), (0, 10, 20))
    decisions = data.sim.tick()
    assert data.answers("c1", decisions) == []
    (got,) = data.answers("c2", decisions)
    assert isinstance(got, ev.ShardLeased) and [r.key for r in got.shards] == [0]


def test_a_request_acknowledges_the_shards_trained_since_the_last_one(data: Data) -> None:
    a = data.request("c1", 3)
    assert isinstance(a, ev.ShardLeased)
    b = data.request("c1", 1, done=a.shards[:2], answered=a.request)
    assert isinstance(b, ev.ShardLeased) and [r.key for r in b.shards] == [3]
    ds = data.state.data.datasets["d"]
    assert _done_keys(ds) == [0, 1] and sorted(ds.leases) == [2, 3]
    assert ds.nodes["na"].shards == 2 and ds.nodes["na"].samples == 20
    assert sorted(ds.grants) == [f"c1/{b.request}"], "the first grant reached the client"
    # acknowledging only (count 0): nothing more is leased, nothing is answered
    assert data.ask("c1", 0, done=(a.shards[2],)) == []
    assert _done_keys(data.state.data.datasets["d"]) == [0, 1, 2]


def _done_keys(ds: data_fold.Dataset) -> list[int]:
    return [*range(ds.done_floor), *sorted(ds.done)]


@pytest.mark.parametrize(
    ("acks", "reason"),
    [
        ((ev.ShardRef(3),), "not leased to anyone"),
        ((ev.ShardRef(0), ev.ShardRef(0)), "duplicate acknowledgement of shard 0"),
        ((ev.ShardRef(999),), "out of range"),
        (tuple(ev.ShardRef(0) for _ in range(data_fold.MAX_REQUEST + 1)), "at most 1024"),
    ],
)
def test_a_request_with_a_bad_acknowledgement_is_refused_whole(
    data: Data, acks: tuple[ev.ShardRef, ...], reason: str
) -> None:
    a = data.request("c1", 2)
    assert isinstance(a, ev.ShardLeased)
    before = data.state.data.datasets["d"]
    refused = data.request("c1", 5, done=acks, answered=a.request)
    assert isinstance(refused, ev.DataRejected) and reason in refused.reason
    after = data.state.data.datasets["d"]
    assert after.leases == before.leases and after.done == before.done
    assert after.cursor == before.cursor and after.grants == before.grants, "nothing changed"


def test_a_lease_announced_again_is_the_same_and_confirmed_ones_are_not() -> None:
    """A new leader announces every grant not yet confirmed by its client, and only
    those: the same events (ids) the old leader announced."""
    sim = Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))
    data = Data(sim)
    data.register("c1")
    data.register("c2")
    a = data.request("c1", 2)
    b = data.request("c2", 1, node="nb")
    data.ask("c1", 0, answered=a.request)
    sim.announced.clear()  # a new leader: it knows only what the stream folded
    again = [d for d in sim.tick() if isinstance(d, ev.ShardLeased)]
    assert again == [b], "c2's lease is announced again, unchanged; c1's reached it"


def test_a_grant_unconfirmed_past_its_lease_is_announced_lapsed_then_not_at_all() -> None:
    """A grant unconfirmed: announced again while its leases could be alive; once they
    expired (its shards requeued), announced as lapsed, with no shards, so that a live
    client stops waiting and asks again; after one more lease, its client is gone and
    nothing is announced. The lapsed answer, confirmed, ends it."""
    sim = Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))
    data = Data(sim)
    data.register("c1")
    a = data.request("c1", 1)
    assert isinstance(a, ev.ShardLeased) and not a.lapsed
    sim.announced.clear()
    assert [d.id for d in sim.tick(SPEC.lease_s / 2) if isinstance(d, ev.ShardLeased)] == [a.id]
    sim.announced.clear()
    later = sim.tick(SPEC.lease_s)
    (lapsed,) = [d for d in later if isinstance(d, ev.ShardLeased)]
    assert lapsed.lapsed and lapsed.request == a.request and lapsed.shards == ()
    assert lapsed.id != a.id and not lapsed.exhausted
    (requeue,) = [d for d in later if isinstance(d, ev.ShardRequeued)]
    assert requeue.shards == a.shards, "and its lease expired"
    sim.announced.clear()
    assert not [d for d in sim.tick(SPEC.lease_s * 2.5) if isinstance(d, ev.ShardLeased)]
    # a client that got the lapsed answer confirms it, and asks again: the requeued
    # shard is its, and the lapsed grant is gone
    again = data.request("c1", 1, answered=a.request)
    assert isinstance(again, ev.ShardLeased) and again.shards == a.shards
    assert list(data.state.data.datasets["d"].grants) == [f"c1/{again.request}"]


def test_a_request_folded_after_its_lease_would_have_expired_is_answered_lapsed() -> None:
    """A request held in a client's outbox through an outage longer than `lease_s`
    is folded with its own time: its grant's leases expire at once. The client hears
    so (rather than waiting for an answer that never comes) and asks again."""
    sim = Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))
    data = Data(sim)
    data.register("c1")
    sim.now += SPEC.lease_s + 5  # the request below was made before the outage
    req = ev.ShardRequested(
        job="j1",
        id="c1:old",
        producer="c1",
        ts=sim.now - SPEC.lease_s - 5,
        dataset="d",
        client="c1",
        request=7,
        count=2,
        node="na",
    )
    sim.apply(req)
    answers = data.answers("c1", sim.tick())
    (lapsed,) = [d for d in answers if isinstance(d, ev.ShardLeased)]
    assert lapsed.lapsed and lapsed.request == 7 and lapsed.shards == ()
    again = data.request("c1", 2, answered=7)
    assert isinstance(again, ev.ShardLeased) and [r.key for r in again.shards] == [0, 1]


@pytest.mark.parametrize("measured", [True, False])
def test_a_node_whose_clock_is_far_behind_keeps_its_leases(measured: bool) -> None:
    """Its request is stamped eleven minutes back, longer than a lease (30 s here, 600
    by default): read on the leader's clock once its heartbeats tell how far off it is,
    its grant stands and its leases last; a leader that has not measured it yet takes
    the request for one held through an outage, its grant expired before it was said."""
    sim = Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))
    data = Data(sim)
    data.register("c1")
    sim.skew("na", -660.0, measured=measured)
    leased = [d for d in data.ask("c1", 2, node="na") if isinstance(d, ev.ShardLeased) and d.shards]
    if not measured:
        assert leased == []  # expired before it was announced
        return
    (answer,) = leased
    assert not answer.lapsed and [r.key for r in answer.shards] == [0, 1]
    sim.tick(SPEC.lease_s / 2)
    assert not [d for d in sim.decisions if isinstance(d, ev.ShardRequeued)]
    sim.tick(SPEC.lease_s)  # never renewed: its leases expire a lease after they were made
    (requeued,) = [d for d in sim.decisions if isinstance(d, ev.ShardRequeued)]
    assert requeued.reason == "lease_expired" and [r.key for r in requeued.shards] == [0, 1]


def test_a_pruned_shard_whose_lease_is_requeued_is_not_leased_again() -> None:
    """A shard a committed checkpoint trained (pruned) whose acknowledgement never came:
    its lease expiring gives it back to no one (the fold raised KeyError leasing it)."""
    data = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    data.register("c1", STREAM)
    _cut(data, (0, 0, 10), (1, 0, 4), (0, 10, 20))  # keys 0..2
    a = data.request("c1", 3)
    assert isinstance(a, ev.ShardLeased) and [r.key for r in a.shards] == [0, 1, 2]
    _saved(data, 5, ev.DataPosition(done=((0, 1),)))
    _committed(data, 5)
    expired = data.sim.tick(STREAM.lease_s + 1)
    (requeue,) = [d for d in expired if isinstance(d, ev.ShardRequeued)]
    assert [r.key for r in requeue.shards] == [0, 1, 2]
    ds = data.state.data.datasets["d"]
    assert not ds.leases and [r.key for r in ds.requeued] == [2], "0 and 1 are pruned: done"
    _cut(data, (1, 4, 8))
    b = data.request("c1", 3)
    assert isinstance(b, ev.ShardLeased) and [r.key for r in b.shards] == [2, 3]
