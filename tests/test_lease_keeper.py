"""The lease keeper's decisions, with scripted answers and an injected clock (pure logic)."""

from __future__ import annotations

import queue
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rove.control.catalogue import events as ev
from rove.shard_service.keeper import MAX_AHEAD, DataError, LeaseKeeper
from rove.shard_service.options import Pace


@dataclass
class ScriptedClient:
    """Records requests; answers are put in `answers` by the test."""

    dataset: str = "d"
    job: str = "j1"
    answers: queue.Queue[Any] = field(default_factory=queue.Queue)
    requests: list[tuple[int, tuple[int, ...], dict[str, Any]]] = field(default_factory=list)

    def request(self, count: int, held: tuple[int, ...], **first: Any) -> int:
        self.requests.append((count, held, first))
        return len(self.requests)

    def lease(self, request: int, *keys: int, exhausted: bool = False) -> None:
        self.answers.put(
            ev.ShardLeased(
                job="j1",
                id=f"a{request}",
                producer="m",
                ts=0.0,
                epoch=1,
                dataset="d",
                client="c",
                request=request,
                shards=tuple(ev.ShardRef(k) for k in keys),
                deadline=1e9,
                exhausted=exhausted,
            )
        )


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SPEC = ev.DatasetSpec(size=10_000, shard_size=100, lease_s=30.0)


def keeper(**kw: Any) -> tuple[LeaseKeeper, ScriptedClient, Clock]:
    client, clock = ScriptedClient(), Clock()
    return LeaseKeeper(client, SPEC, Pace(**kw), clock=clock), client, clock  # type: ignore[arg-type]


def test_the_first_request_asks_for_prefetch_shards_and_carries_the_restore_point() -> None:
    k, c, _ = keeper(prefetch=3)
    k.restore = ev.DataPosition(done=((0, 4),))
    k.top_up(0, [])
    ((count, held, first),) = c.requests
    assert count == 3 and held == ()
    assert first["restore"] == k.restore
    k.top_up(0, [])
    assert len(c.requests) == 1, "one request in flight at a time"
    c.lease(1, 5, 6, 7)
    assert [r.key for r in k.poll(wait=False)] == [5, 6, 7]
    k.top_up(2, [5, 6, 7])
    assert c.requests[-1][0] == 1 and "restore" not in c.requests[-1][2]


def test_it_keeps_cover_s_seconds_of_shards_ahead_at_the_measured_rate() -> None:
    k, _, clock = keeper(prefetch=2, cover_s=10.0)
    assert k.ahead() == 2
    k.measure(0)
    clock.now = 0.1
    k.measure(50)
    assert k.ahead() == 2, "too soon for a first estimate"
    clock.now = 0.25
    k.measure(75)  # 500 samples/s: 10 s is 5000 samples, 50 shards of 100
    assert k.ahead() == 50, "a first estimate early, so a fast consumer holds enough"
    clock.now = 0.75
    k.measure(1000)
    assert k.ahead() == 50, "then one estimate a second"
    clock.now = 1.25
    k.measure(100_000)
    assert k.ahead() == MAX_AHEAD, "capped, however fast it trains"


def test_held_leases_are_renewed_by_an_empty_request_every_third_of_the_lease() -> None:
    k, c, clock = keeper(prefetch=1)
    k.top_up(0, [])
    c.lease(1, 0)
    k.poll(wait=False)
    clock.now = 9.0
    k.top_up(1, [0])
    assert len(c.requests) == 1, "not yet: nothing missing, lease fresh"
    clock.now = 10.5
    k.top_up(1, [0])
    assert c.requests[-1][:2] == (0, (0,)), "an empty request renews shard 0"


def test_a_short_batch_asks_for_enough_samples() -> None:
    k, c, _ = keeper(prefetch=1)
    k.top_up(1, [], short_samples=350)
    assert c.requests[-1][0] == 4, "4 shards of 100 for 350 samples"


def test_exhausted_data_ends_the_wait_and_a_refusal_names_the_reason() -> None:
    k, c, _ = keeper()
    k.top_up(0, [])
    assert k.waiting
    c.lease(1, exhausted=True)
    assert k.poll(wait=True) == [] and not k.waiting
    c.answers.put(
        ev.DataRejected(
            job="j1",
            id="r",
            producer="m",
            ts=0.0,
            epoch=1,
            dataset="d",
            client="c",
            event_id="e",
            reason="count must be between 0 and 1024, not 5000",
        )
    )
    with pytest.raises(DataError, match="dataset d: count must be between"):
        k.poll(wait=False)


def test_data_errors_are_rove_errors_that_say_retrying_cannot_help() -> None:
    from rove.control.errors import PermanentError, RoveError

    assert issubclass(DataError, PermanentError) and issubclass(DataError, RoveError)


def test_a_stream_keeps_each_shards_range_sizes_ahead_by_them_and_waits_when_nothing_is_cut() -> (
    None
):
    client, clock = ScriptedClient(), Clock()
    spec = ev.DatasetSpec(size=0, shard_size=0, stream=True, lease_s=30.0)
    k = LeaseKeeper(client, spec, Pace(prefetch=2), clock=clock)  # type: ignore[arg-type]
    k.top_up(0, ())
    assert client.requests[-1][0] == 2
    client.answers.put(
        ev.ShardLeased(
            job="j1", id="a1", producer="m", ts=0.0, epoch=1, dataset="d", client="c",
            request=1, shards=(), deadline=1e9,
        )
    )  # fmt: skip
    assert k.poll(wait=False) == [] and k.waiting, "nothing cut yet: not exhausted"
    k.top_up(0, ())
    assert len(client.requests) == 1, "no request loop while the stream is empty"
    clock.now += 0.6
    k.top_up(0, ())
    assert len(client.requests) == 2
    ranges = (ev.StreamShard(0, 0, 40), ev.StreamShard(1, 7, 27))
    client.answers.put(
        ev.ShardLeased(
            job="j1", id="a2", producer="m", ts=0.0, epoch=1, dataset="d", client="c",
            request=2, shards=(ev.ShardRef(0), ev.ShardRef(1)), deadline=1e9, ranges=ranges,
        )
    )  # fmt: skip
    assert [r.key for r in k.poll(wait=False)] == [0, 1]
    assert k.ranges == {0: ranges[0], 1: ranges[1]}
    assert k.shard_size() == 30
    # shard 0 requeued and leased again: counted once, with its range
    client.answers.put(
        ev.ShardLeased(
            job="j1", id="a3", producer="m", ts=0.0, epoch=1, dataset="d", client="c",
            request=3, shards=(ev.ShardRef(0, 5),), deadline=1e9, ranges=(ranges[0],),
        )
    )  # fmt: skip
    assert [r.key for r in k.poll(wait=False)] == [0]
    assert k.shard_size() == 30


def test_a_wait_in_slices_warns_only_once_the_slices_add_up_to_the_answer_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's request waits in the master until shards are cut: its caller waits in
    short slices (idle ticks between them), and no slice alone is a missing master."""
    from rove.shard_service import keeper as keeper_module

    warned: list[dict[str, Any]] = []

    class Log:
        def warning(self, message: str, **kw: Any) -> None:
            warned.append(kw)

    monkeypatch.setattr(keeper_module, "log", Log())
    k, c, clock = keeper(answer_timeout_s=10.0)
    k.top_up(0, [])
    for _ in range(10):
        assert k.poll(wait=True, timeout=0.0) == []
        clock.now += 1.0
    assert not warned, "9 s of slices: not yet"
    assert k.poll(wait=True, timeout=0.0) == []
    assert [w["waited_s"] for w in warned] == [10.0]
    assert k.poll(wait=True, timeout=0.0) == [] and len(warned) == 1, "then once a period"
    c.lease(1, 5)
    assert [r.key for r in k.poll(wait=True, timeout=0.0)] == [5]
    k.top_up(0, [5])
    clock.now += 5.0
    assert k.poll(wait=True, timeout=0.0) == []
    clock.now += 6.0
    assert k.poll(wait=True, timeout=0.0) == []
    assert len(warned) == 1, "an answer starts the count again"


def test_the_first_request_names_the_step_the_checkpointer_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round named step 30, the ranks fell back to step 25: the dataset's restore
    says 25 (it said 30 beside a checkpoint restore of 25 in `rove status`)."""
    from rove.agent import progress
    from rove.shard_service.client import first_request

    position = ev.DataPosition(done=((0, 4),))
    monkeypatch.setenv("ROVE_RESTORE_STEP", "30")
    monkeypatch.setattr(progress, "_writer", None)
    monkeypatch.setattr(progress, "_checked", False)
    monkeypatch.delenv(progress.ENV, raising=False)
    assert first_request("d", position)["restore_step"] == 30, "no progress file: the named"
    path = tmp_path / "p"
    progress.create(path)
    monkeypatch.setenv(progress.ENV, str(path))
    monkeypatch.setattr(progress, "_checked", False)
    assert first_request("d", position)["restore_step"] == 30, "nothing loaded said yet"
    progress.restored(0.1, 25)
    assert first_request("d", position) == {"restore": position, "restore_step": 25}
