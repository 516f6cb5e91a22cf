"""The shard sampler against a real nats-server and a real `rove master` process."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.shard_service import DataError, ShardSampler
from tests.support import MasterProc, eventually, rove_cli, stored_events

JOB = "dj"


class Indexed(Dataset[torch.Tensor]):
    """Sample i is the tensor [i]: a batch says which indices it holds."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@pytest.fixture
def master(bus: Bus, tmp_path: Path) -> Any:
    m = MasterProc(bus.url, JOB, "m1", tmp_path)
    yield m
    m.stop()


def sampler(bus: Bus, node: str, rank: int, **kw: Any) -> ShardSampler:
    params: dict[str, Any] = {"batch_size": 8, "shard_size": 16, "epochs": 2, "seed": 5}
    params.update(kw)
    return ShardSampler("ds", 500, nats=bus.url, job=JOB, node=node, rank=rank, **params)


def acknowledged(stored: list[Any]) -> list[int]:
    """The shard keys acknowledged in the stream: in requests, and one by one (on behalf
    of a DataLoader worker's lease)."""
    keys = []
    for rec in stored:
        if isinstance(rec.event, ev.ShardRequested):
            keys.extend(ref.key for ref in rec.event.done)
        elif isinstance(rec.event, ev.ShardDone):
            keys.append(rec.event.shard.key)
    return keys


async def test_two_samplers_see_every_index_once_per_epoch(bus: Bus, master: Any) -> None:
    a, b = sampler(bus, "na", 0), sampler(bus, "nb", 1, prefetch=3)
    seen: list[tuple[int, int]] = []

    def consume() -> None:
        # a with worker processes, b in-process; the two alternate batches
        la = iter(a.loader(Indexed(500), num_workers=2))
        lb = iter(b.loader(Indexed(500)))
        live = {"a": la, "b": lb}
        samplers = {"a": a, "b": b}
        while live:
            for name in list(live):
                batch = next(live[name], None)
                if batch is None:
                    del live[name]
                    continue
                got = samplers[name].last_delivered
                assert [i for _, i in got] == batch.flatten().tolist()
                seen.extend(got)

    await asyncio.to_thread(consume)
    count = collections.Counter(seen)
    assert sorted(count) == [(e, i) for e in range(2) for i in range(500)]
    assert set(count.values()) == {1}, "no index twice in an epoch"
    total_shards = 2 * 32  # ceil(500 / 16) per epoch
    assert a.shards_done + b.shards_done == total_shards
    done: list[int] = []
    for _ in range(100):  # (the last acknowledgements ride alone, ACK_DELAY_S later)
        done = acknowledged(await stored_events(bus, JOB))
        if len(done) == total_shards:
            break
        await asyncio.sleep(0.1)
    assert sorted(done) == list(range(total_shards)), "each shard acknowledged once"
    status = rove_cli("status", "--job", JOB, "--nats", bus.url, check=True)
    assert "dataset ds" in status.stdout and "na" in status.stdout and "nb" in status.stdout
    a.close()
    b.close()


async def test_a_conflicting_registration_is_a_clear_error(bus: Bus, master: Any) -> None:
    first = sampler(bus, "na", 0)
    it = iter(first)
    await asyncio.to_thread(next, it)
    other = ShardSampler(
        "ds", 501, batch_size=8, shard_size=16, epochs=2, seed=5, nats=bus.url, job=JOB
    )
    with pytest.raises(DataError, match=r"registered with size=500.*registers size=501"):
        await asyncio.to_thread(next, iter(other))
    first.close()
    other.close()


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="needs a NATS URL and a job"):
        ShardSampler("ds", 10, batch_size=2, nats="", job="")
    with pytest.raises(ValueError, match="shard_size must be at least 1"):
        ShardSampler("ds", 10, batch_size=2, shard_size=0, nats="nats://x:1", job="j")
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        ShardSampler("ds", 10, batch_size=0, nats="nats://x:1", job="j")


async def test_a_slower_worker_gets_fewer_shards(bus: Bus, master: Any) -> None:
    fast, slow = sampler(bus, "fast", 0, epochs=1), sampler(bus, "slow", 1, epochs=1)
    got: dict[str, int] = {}

    def run(name: str, s: ShardSampler, pause: float) -> None:
        for _ in s.loader(Indexed(500)):
            time.sleep(pause)
        got[name] = s.shards_done

    threads = [
        threading.Thread(target=run, args=("fast", fast, 0.0)),
        # (a shard of the slow one lasts about 0.8 s: the fast one's, its lease's round
        # trips, stays far shorter on a busy machine; at 0.02 s a sample CI once saw
        # 18 against 14)
        threading.Thread(target=run, args=("slow", slow, 0.05)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        await asyncio.to_thread(t.join, 120)
    assert got["fast"] + got["slow"] == 32
    assert got["slow"] < got["fast"] / 2, got
    fast.close()
    slow.close()


async def test_the_iterable_dataset_with_worker_processes_resumes_exactly_once(
    bus: Bus, master: Any
) -> None:
    """Two loader workers lease their own shards; the run stops half-way, a new round
    restores the position it saved, and the two runs together train every index of
    both epochs exactly once."""
    from rove.shard_service import ShardedIterable

    def make(round_: int) -> Any:
        return ShardedIterable(
            "it", Indexed(300), shard_size=16, epochs=2, seed=3, nats=bus.url, job=JOB, round=round_
        )

    def first_half() -> tuple[list[tuple[int, int]], dict[str, Any]]:
        data = make(1)
        loader = data.loader(batch_size=8, num_workers=2)
        seen: list[tuple[int, int]] = []
        for n, batch in enumerate(loader):
            assert [i for _, i in loader.last_delivered] == batch.flatten().tolist()
            seen += loader.last_delivered
            if n == 40:  # ~330 samples in; the workers have leased more than that
                break
        state = data.state_dict()
        data.close()
        return seen, state

    def second(state: dict[str, Any]) -> tuple[list[tuple[int, int]], int]:
        data = make(2)
        data.load_state_dict(state)
        loader = data.loader(batch_size=8, num_workers=2)
        seen: list[tuple[int, int]] = []
        for _ in loader:
            seen += loader.last_delivered
        data.close()
        return seen, data.shards_done

    before, state = await asyncio.to_thread(first_half)
    after, _ = await asyncio.to_thread(second, state)
    count = collections.Counter(before + after)
    assert sorted(count) == [(e, i) for e in range(2) for i in range(300)]
    assert set(count.values()) == {1}, [k for k, v in count.items() if v > 1][:10]
    restored = [
        r.event for r in await stored_events(bus, JOB) if isinstance(r.event, ev.DataRestored)
    ]
    assert [(e.dataset, e.round) for e in restored][-1] == ("it", 2)


@pytest.fixture(params=["one server", "3-node cluster"])
def shaped(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """(bus, URL) with a `rove master` on one server (R1) or on the 3-node cluster (R3)."""
    if request.param == "one server":
        bus = request.getfixturevalue("bus")
        url = bus.url
    else:
        bus = request.getfixturevalue("cluster_bus")
        url = request.getfixturevalue("shared_cluster").url
    m = MasterProc(url, JOB, "m1", tmp_path)
    yield bus, url
    m.stop()


async def test_a_lease_costs_one_stored_event_and_one_announced_twice_is_taken_once(
    shaped: tuple[Bus, str],
) -> None:
    """The client's acknowledgements ride in its next request, or alone after
    ACK_DELAY_S; the lease itself is on the memory stream, not with the facts; and a
    lease announced again (a new leader, past the deduplication window) reaches the
    sampler once. On one server and on a 3-node cluster."""
    from rove.control.catalogue import subjects
    from rove.shard_service.client import ACK_DELAY_S, DataClient

    bus, url = shaped
    client = await asyncio.to_thread(
        DataClient, job=JOB, dataset="one", url=url, node="na", client="c1"
    )
    try:
        client.register(ev.DatasetSpec(size=100, shard_size=10))
        first = client.request(2, ())
        lease = await asyncio.to_thread(client.answers.get, True, 30)
        assert isinstance(lease, ev.ShardLeased) and lease.request == first
        assert [r.key for r in lease.shards] == [0, 1]
        # the same lease, announced again under another message id: not queued twice
        await bus.publish_raw(subjects.subject_for(lease), ev.encode(lease), {"Nats-Msg-Id": "x"})
        client.done(lease.shards[0])
        second = client.request(1, (1,))
        nxt = await asyncio.to_thread(client.answers.get, True, 30)
        assert isinstance(nxt, ev.ShardLeased) and nxt.request == second, "no repeat of the first"
        client.done(lease.shards[1])  # no request follows: it goes alone
        await asyncio.sleep(ACK_DELAY_S)

        async def requests() -> list[ev.ShardRequested]:
            stored = await stored_events(bus, JOB)
            return [r.event for r in stored if isinstance(r.event, ev.ShardRequested)]

        deadline = time.monotonic() + 30
        while len(await requests()) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        one, two, alone = await requests()
        assert one.done == () and two.done == (lease.shards[0],) and two.answered == first
        assert alone.count == 0 and alone.done == (lease.shards[1],)
        stored = await stored_events(bus, JOB)
        assert not [r for r in stored if isinstance(r.event, ev.ShardLeased | ev.ShardDone)]
        answers = await bus.js.stream_info(subjects.ANSWER_STREAM)
        assert answers.state.messages == 3, "two leases, and the one announced again"
        assert alone.answered == second
        # closing confirms a lease that came after the last request: no master announces
        # it again
        third = client.request(1, ())
        await asyncio.to_thread(client.answers.get, True, 30)
        await asyncio.to_thread(client.close)
        deadline = time.monotonic() + 30
        while len(await requests()) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        last = (await requests())[-1]
        assert last.count == 0 and last.done == () and last.answered == third
        # a main process acknowledges a DataLoader worker's shard on its behalf: a
        # request for nothing in the worker's name, not an event per shard
        main = await asyncio.to_thread(
            DataClient, job=JOB, dataset="one", url=url, node="na", client="c1-main"
        )
        main.done(ev.ShardRef(3), owner="c1")
        await asyncio.to_thread(main.close)
        deadline = time.monotonic() + 30
        while len(await requests()) < 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        behalf = (await requests())[-1]
        assert behalf.client == "c1" and behalf.producer == "data:c1-main"
        assert behalf.count == 0 and behalf.done == (ev.ShardRef(3),)
        stored = await stored_events(bus, JOB)
        assert not [r for r in stored if isinstance(r.event, ev.ShardDone | ev.DataRejected)]
    finally:
        await asyncio.to_thread(client.close)


async def test_a_request_folded_after_its_lease_expired_is_answered_lapsed(
    shaped: tuple[Bus, str],
) -> None:
    """A request that waited out an outage longer than `lease_s` in the client's outbox
    is folded with its own time, and its leases expire at once: the master answers it
    `lapsed` (the client stops waiting and asks again) rather than not at all, and the
    grant itself, should a late master still announce it, is not taken. On one server
    and on a 3-node cluster."""
    from msgspec.structs import replace

    from rove.control.catalogue import subjects
    from rove.shard_service.client import DataClient

    bus, url = shaped
    client = await asyncio.to_thread(
        DataClient, job=JOB, dataset="late", url=url, node="na", client="c1"
    )
    try:
        client.register(ev.DatasetSpec(size=100, shard_size=10, lease_s=30.0))

        async def registered() -> bool:
            stored = await stored_events(bus, JOB)
            return any(isinstance(r.event, ev.DatasetRegistered) for r in stored)

        await eventually(registered, timeout=30)
        old = time.time() - 40
        await bus.publish(
            ev.ShardRequested(
                job=JOB,
                id="c1:old",
                producer="data:c1",
                ts=old,
                dataset="late",
                client="c1",
                request=500,
                count=2,
                node="na",
            )
        )
        lapsed = await asyncio.to_thread(client.answers.get, True, 30)
        assert isinstance(lapsed, ev.ShardLeased) and lapsed.lapsed, lapsed
        assert lapsed.request == 500 and lapsed.shards == ()
        assert client.answered == 500, "the lapsed answer is confirmed with the next request"
        grant = replace(lapsed, id="late-master", lapsed=False, shards=(ev.ShardRef(0),))
        await bus.publish_raw(subjects.subject_for(grant), ev.encode(grant), {})
        again = client.request(2, ())
        lease = await asyncio.to_thread(client.answers.get, True, 30)
        assert isinstance(lease, ev.ShardLeased) and lease.request == again, lease
        assert [r.key for r in lease.shards] == [0, 1], "the expired leases, requeued"
        assert client.answers.empty()
    finally:
        await asyncio.to_thread(client.close)


@pytest.mark.slow
async def test_a_lease_lost_from_the_memory_stream_is_announced_again(
    shaped: tuple[Bus, str],
) -> None:
    """The answers stream is memory: a lease it lost before its client read it (here:
    purged) is announced again by the leader until the client confirms it, under an id
    of its own (the stream still remembers the first one's)."""
    from rove.control.catalogue import subjects
    from rove.control.master.runner import REANNOUNCE_S

    bus, _ = shaped

    def env(n: int) -> dict[str, Any]:
        return {"job": JOB, "id": f"ghost:{n}", "producer": "ghost", "ts": time.time()}

    spec = ev.DatasetSpec(size=100, shard_size=10)
    await bus.publish(ev.DatasetRegistered(**env(1), dataset="lost", spec=spec, client="ghost"))
    await bus.publish(
        ev.ShardRequested(**env(2), dataset="lost", client="ghost", request=2, count=3)
    )
    deadline = time.monotonic() + 30
    while (await bus.js.stream_info(subjects.ANSWER_STREAM)).state.messages < 1:
        assert time.monotonic() < deadline, "the lease was never announced"
        await asyncio.sleep(0.05)
    await bus.js.purge_stream(subjects.ANSWER_STREAM)
    got: asyncio.Queue[ev.ShardLeased] = asyncio.Queue()
    feed = await bus.subscribe(
        subjects.ANSWER_STREAM,
        subjects.lease_answer(JOB, "lost", "ghost"),
        lambda rec: got.put_nowait(rec.event),
        lambda rej: None,
    )
    try:
        lease = await asyncio.wait_for(got.get(), REANNOUNCE_S * 3)
        assert lease.request == 2 and [r.key for r in lease.shards] == [0, 1, 2]
        assert ":again:" in lease.id
    finally:
        await feed.stop()
