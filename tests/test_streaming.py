"""Stream shards (pure): how a bridge cuts a topic, and how the master folds the cuts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rove.control import events as ev
from rove.control.master import streams
from rove.control.streaming import cut
from tests import factories

W = ev.Watermark


def added(*shards: ev.StreamShard, ts: float = 1.0, topic: str = "clicks") -> ev.StreamShardsAdded:
    return ev.StreamShardsAdded(
        **ev.envelope(
            factories.JOB, "bridge:b1", ts, "stream", *[(s.partition, s.start) for s in shards]
        ),
        dataset="clicks",
        topic=topic,
        bridge="b1",
        shards=shards,
    )


def test_full_shards_at_once_and_the_rest_after_it_lingered() -> None:
    shards, waiting = cut(
        {}, [W(0, 0, 250), W(1, 10, 10)], shard_records=100, linger_s=2, waiting_since={}, now=10
    )
    assert shards == [ev.StreamShard(0, 0, 100), ev.StreamShard(0, 100, 200)]
    assert waiting == {0: 10}
    shards, waiting = cut(
        {0: 200}, [W(0, 0, 260)], shard_records=100, linger_s=2, waiting_since=waiting, now=11
    )
    assert shards == [] and waiting == {0: 10}
    shards, waiting = cut(
        {0: 200}, [W(0, 0, 260)], shard_records=100, linger_s=2, waiting_since=waiting, now=12
    )
    assert shards == [ev.StreamShard(0, 200, 260)] and waiting == {}


def test_a_partition_behind_retention_resumes_at_its_low_watermark_and_the_gap_is_kept() -> None:
    shards, _ = cut(
        {0: 100}, [W(0, 150, 200)], shard_records=50, linger_s=0, waiting_since={}, now=0
    )
    assert shards == [ev.StreamShard(0, 150, 200)]
    s = streams.on_shards(streams.StreamState(), added(ev.StreamShard(0, 0, 100)))
    s = streams.on_shards(s, added(*shards, ts=2.0))
    st_ = s.streams["clicks"]
    assert st_.gaps == (streams.Gap(0, 100, 150),) and st_.gap_records == 50
    assert st_.next[0] == 200 and st_.count == 2


def test_a_repeat_from_a_restarted_bridge_is_ignored_and_keys_follow_fold_order() -> None:
    s = streams.on_shards(
        streams.StreamState(), added(ev.StreamShard(0, 0, 10), ev.StreamShard(1, 0, 5))
    )
    again = streams.on_shards(s, added(ev.StreamShard(0, 0, 10), ev.StreamShard(0, 10, 20), ts=2.0))
    st_ = again.streams["clicks"]
    assert dict(st_.shards) == {
        0: ev.StreamShard(0, 0, 10),
        1: ev.StreamShard(1, 0, 5),
        2: ev.StreamShard(0, 10, 20),
    }
    assert st_.records == 25 and not st_.gaps
    other = streams.on_shards(again, added(ev.StreamShard(0, 20, 30), topic="other"))
    assert other.streams["clicks"].count == 3 and other.streams["clicks"].conflicts == 1


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 2), st.integers(0, 40), st.floats(0, 3)),
        min_size=1,
        max_size=30,
    ),
    st.integers(1, 17),
)
def test_cutting_as_records_arrive_covers_every_offset_once_in_order(
    arrivals: list[tuple[int, int, float]], shard_records: int
) -> None:
    """Records arrive on 3 partitions at random; a bridge cuts after each arrival and the
    master folds the cuts. In the end (after lingering), every offset of every
    partition is in exactly one shard, and each partition's shards are in order."""
    high = {0: 0, 1: 0, 2: 0}
    state = streams.StreamState()
    waiting: dict[int, float] = {}
    now = 0.0
    for partition, n, dt in [*arrivals, (0, 0, 10.0)]:
        high[partition] += n
        now += dt
        stream = state.streams.get("clicks")
        nxt = dict(stream.next) if stream else {}
        marks = [W(p, 0, h) for p, h in high.items()]
        shards, waiting = cut(
            nxt, marks, shard_records=shard_records, linger_s=2, waiting_since=waiting, now=now
        )
        if shards:
            state = streams.on_shards(state, added(*shards, ts=now))
    if "clicks" not in state.streams:
        assert not any(high.values())
        return
    stream = state.streams["clicks"]
    for p, h in high.items():
        mine = [s for _, s in sorted(stream.shards.items()) if s.partition == p]
        covered = [o for s in mine for o in range(s.start, s.end)]
        assert covered == list(range(h)), (p, mine)
        assert all(s.records <= shard_records for s in mine)
    assert not stream.gaps
