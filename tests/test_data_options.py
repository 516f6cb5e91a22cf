"""The keyword options every data client shares: one declaration, one resolution."""

from __future__ import annotations

import pytest
from torch.utils.data import Dataset

from rove.control.catalogue import events as ev
from rove.shard_service.iterable import ShardedIterable
from rove.shard_service.options import Pace, sharded, streamed
from rove.shard_service.sampler import ShardSampler
from rove.shard_service.stream import StreamIterable
from rove.shard_service.tf import ShardFeed

WHERE = {"nats": "nats://x:1", "job": "j"}


class Ten(Dataset[int]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i


def test_the_defaults_are_the_documented_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROVE_NODE", "n3")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("ROVE_ROUND", "7")
    o = sharded("shard sampler", "ds", 1000, WHERE)
    assert o.spec == ev.DatasetSpec(size=1000, shard_size=256)
    assert (o.spec.epochs, o.spec.seed, o.spec.shuffle, o.spec.lease_s) == (1, 0, True, 600.0)
    assert o.pace == Pace(prefetch=2, cover_s=10.0, answer_timeout_s=60.0)
    assert (o.where.url, o.where.job, o.where.node, o.where.rank, o.where.round) == (
        "nats://x:1",
        "j",
        "n3",
        5,
        7,
    )
    s = streamed("stream", "clicks", {**WHERE, "lease_s": 30.0, "prefetch": 4})
    assert s.spec == ev.DatasetSpec(size=0, shard_size=0, stream=True, lease_s=30.0)
    assert s.pace.prefetch == 4


def test_every_client_takes_the_same_options_into_its_spec_and_pace() -> None:
    opts = dict(WHERE, shard_size=4, epochs=3, seed=9, shuffle=False, lease_s=5.0, prefetch=3)
    clients = [
        ShardSampler("ds", 10, batch_size=2, **opts),  # type: ignore[arg-type]
        ShardedIterable("ds", Ten(), **opts),  # type: ignore[arg-type]
        ShardFeed("ds", size=10, **opts),  # type: ignore[arg-type]
    ]
    want = ev.DatasetSpec(size=10, shard_size=4, epochs=3, seed=9, shuffle=False, lease_s=5.0)
    for c in clients:
        assert c.spec == want, type(c).__name__
        assert c.pace == Pace(prefetch=3), type(c).__name__
    stream = StreamIterable("clicks", bootstrap="b:1", topic="t", prefetch=3, **WHERE)
    assert stream.pace == Pace(prefetch=3) and stream.spec.stream


def test_a_misspelt_or_foreign_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"shard sampler got unknown keyword\(s\) shard_sise"):
        ShardSampler("ds", 10, batch_size=2, shard_sise=4, **WHERE)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"unknown keyword\(s\) epochs, shard_size.*takes"):
        StreamIterable("s", bootstrap="b:1", topic="t", shard_size=4, epochs=2, **WHERE)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="shard feed got unknown"):
        ShardFeed("ds", size=10, lease=5, **WHERE)  # type: ignore[call-arg]


def test_bad_values_are_value_errors() -> None:
    with pytest.raises(ValueError, match="prefetch must be at least 1 shard, not 0"):
        ShardedIterable("ds", Ten(), prefetch=0, **WHERE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dataset ds: shard_size must be at least 1"):
        ShardFeed("ds", size=10, shard_size=0, **WHERE)  # type: ignore[arg-type]
