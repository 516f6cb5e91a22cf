"""The master's record of done shards (pure): a floor below which every shard is done,
and a map of the done shards past a hole, so that the state (and every snapshot of it)
is the size of what is in flight, not of how far the dataset got."""

from __future__ import annotations

import random

import immutables
from msgspec.structs import replace

from rove.control.catalogue import events as ev
from rove.control.master import data as data_fold
from rove.control.master.state import decode_state, encode_state
from tests.sim import Sim
from tests.test_data_fold import Data

BIG = ev.DatasetSpec(size=1_000_000, shard_size=1, lease_s=3600.0)


def _dataset(d: Data) -> data_fold.Dataset:
    return d.sim.state.data.datasets["d"]


class Trainers:
    """Clients that lease one shard per request and acknowledge it in the next."""

    def __init__(self, d: Data, clients: int, seed: int) -> None:
        self.d, self.clients, self.rng = d, clients, random.Random(seed)
        self.held: dict[str, tuple[ev.ShardRef, ...]] = {}
        self.answered: dict[str, int] = {}

    def train(self, leases: int) -> None:
        """`leases` requests, from clients in an order the random generator draws."""
        for _ in range(leases):
            c = f"c{self.rng.randrange(self.clients)}"
            got = self.d.request(c, 1, done=self.held.pop(c, ()), answered=self.answered.get(c, 0))
            assert isinstance(got, ev.ShardLeased)
            self.held[c], self.answered[c] = got.shards, got.request

    def holding(self) -> list[int]:
        return sorted(ref.key for refs in self.held.values() for ref in refs)


def test_the_done_shards_are_a_floor_and_the_few_past_a_hole() -> None:
    d = Data(Sim(ev.RdzvParams()))
    d.register("c0", BIG)
    trainers = Trainers(d, clients=8, seed=1)
    trainers.train(3000)
    ds, held = _dataset(d), trainers.holding()
    assert data_fold.done_count(d.sim.state.data, ds) == 3000 - len(held)
    assert ds.done_floor == held[0], "every shard below the oldest one held is done"
    assert sorted(ds.done) == [k for k in range(held[0], 3000) if k not in held]
    small = len(encode_state(d.sim.state))
    trainers.train(3000)
    assert data_fold.done_count(d.sim.state.data, _dataset(d)) == 6000 - len(trainers.holding())
    assert len(encode_state(d.sim.state)) < small + 200, "the state does not grow with the data"


def test_a_shard_held_long_keeps_the_ones_after_it_until_it_is_done() -> None:
    d = Data(Sim(ev.RdzvParams()))
    d.register("c0", BIG)
    slow = d.request("slow", 1)
    assert isinstance(slow, ev.ShardLeased) and slow.shards[0].key == 0
    trainers = Trainers(d, clients=2, seed=3)
    trainers.train(100)
    ds = _dataset(d)
    assert ds.done_floor == 0 and len(ds.done) == 98 and not data_fold.is_done(ds, 0)
    d.ask("slow", 0, done=slow.shards, answered=slow.request)
    ds, held = _dataset(d), trainers.holding()
    assert ds.done_floor == held[0], "the floor rose to the oldest shard still held"
    assert sorted(ds.done) == [k for k in range(held[0], 101) if k not in held]
    # acknowledging it again is still a duplicate, below the floor
    again = d.request("slow", 1, done=slow.shards)
    assert isinstance(again, ev.DataRejected)
    assert "duplicate acknowledgement of shard 0" in again.reason


def test_a_restored_position_puts_its_prefix_under_the_floor() -> None:
    d = Data(Sim(ev.RdzvParams(min_nodes=1, max_nodes=2)))
    d.register("c1", BIG)
    pos = ev.DataPosition(done=((0, 4), (6, 8)), partial=(ev.ShardRef(5, 2),))
    got = d.request("c1", 2, round=1, restore=pos, restore_step=3)
    assert isinstance(got, ev.ShardLeased)
    assert [(r.key, r.offset) for r in got.shards] == [(5, 2), (9, 0)]
    ds = _dataset(d)
    assert ds.done_floor == 5 and sorted(ds.done) == [6, 7, 8]
    assert ds.restored_done == 8 and data_fold.done_count(d.sim.state.data, ds) == 8
    d.ask("c1", 0, done=got.shards[:1], answered=got.request, round=1)
    assert _dataset(d).done_floor == 9 and not _dataset(d).done


def test_a_state_of_an_earlier_version_with_every_done_shard_folds_on() -> None:
    """Snapshots written before the floor hold every done key, and no floor."""
    d = Data(Sim(ev.RdzvParams()))
    d.register("c0", BIG)
    got = d.request("c0", 1)
    assert isinstance(got, ev.ShardLeased) and got.shards[0].key == 0
    ds = _dataset(d)
    old = replace(ds, cursor=50, done=immutables.Map({k: True for k in range(1, 50)}))
    state = d.sim.state
    d.sim.state = decode_state(
        encode_state(
            replace(state, data=replace(state.data, datasets=state.data.datasets.set("d", old)))
        )
    )
    assert data_fold.done_count(d.sim.state.data, _dataset(d)) == 49
    d.ask("c0", 0, done=got.shards, answered=got.request)
    ds = _dataset(d)
    assert ds.done_floor == 50 and not ds.done
