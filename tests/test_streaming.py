"""Stream shards (pure): how a bridge cuts a topic, and how the master folds the cuts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rove.control.catalogue import events as ev
from rove.control.domain.streaming import cut
from rove.control.master import streams
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


def test_a_partition_added_to_the_topic_is_cut_from_its_first_record() -> None:
    """The bridge reads the partition list on every poll: a partition that was not there
    before is cut from its low watermark, and the master folds its shards as any."""
    shards, _ = cut({}, [W(0, 0, 10)], shard_records=10, linger_s=0, waiting_since={}, now=0)
    s = streams.on_shards(streams.StreamState(), added(*shards))
    marks = [W(0, 0, 10), W(1, 0, 0), W(2, 0, 15)]  # two new partitions, one with records
    shards, _ = cut(
        dict(s.streams["clicks"].next), marks, shard_records=10, linger_s=0, waiting_since={}, now=1
    )
    assert shards == [ev.StreamShard(2, 0, 10), ev.StreamShard(2, 10, 15)]
    s = streams.on_shards(s, added(*shards, ts=2.0))
    table = s.streams["clicks"]
    assert table.next[2] == 15 and table.count == 3 and not table.gaps
    assert [table.shards[k] for k in range(3)] == [ev.StreamShard(0, 0, 10), *shards]


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
    # and `rove status` says it (its view of the gaps raised TypeError)
    from rove.control.cli.status_data import stream_line, stream_view

    view = stream_view(st_, now=10.0, committed=None)
    assert view["gaps"] == [[0, 100, 150]]
    assert "50 records lost to retention before a shard covered them" in stream_line(view)


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


def saved(
    step: int,
    done: tuple[tuple[int, int], ...],
    partial: tuple[tuple[int, int], ...] = (),
    *,
    ts: float = 20.0,
    newest: float = 17.5,
) -> ev.StreamCheckpointed:
    return ev.StreamCheckpointed(
        **ev.envelope(factories.JOB, "data:n0-r0-main", ts, "n0-r0-main", step),
        dataset="clicks",
        client="n0-r0-main",
        step=step,
        round=1,
        done=done,
        partial=partial,
        newest_ts=newest,
    )


def table() -> streams.StreamState:
    # keys: 0 = p0 0-10, 1 = p1 0-5, 2 = p0 10-20, 3 = p1 5-9
    return streams.on_shards(
        streams.StreamState(),
        ev.StreamShardsAdded(
            **ev.envelope(factories.JOB, "bridge:b1", 1.0, "stream", 0),
            dataset="clicks",
            topic="clicks",
            bridge="b1",
            shards=(
                ev.StreamShard(0, 0, 10),
                ev.StreamShard(1, 0, 5),
                ev.StreamShard(0, 10, 20),
                ev.StreamShard(1, 5, 9),
            ),
            watermarks=(W(0, 0, 20), W(1, 0, 9)),
        ),
    )


def test_a_saved_position_becomes_the_offset_vector_of_the_first_untrained_records() -> None:
    s = table()
    # p0: shard 0 done, shard 2 trained 4 records in -> 14; p1: shard 1 not done -> 0
    s = streams.on_checkpointed(s, saved(7, done=((0, 0),), partial=((2, 4),)))
    st_ = s.streams["clicks"]
    assert st_.saved[-1].offsets == ((0, 14), (1, 0))
    # everything done: each partition's vector is the end of its last shard
    s = streams.on_checkpointed(s, saved(9, done=((0, 3),)))
    assert s.streams["clicks"].saved[-1].offsets == ((0, 20), (1, 9))
    # a partition whose first shard is done and second untouched starts at the second
    s = streams.on_checkpointed(s, saved(11, done=((0, 1),)))
    assert s.streams["clicks"].saved[-1].offsets == ((0, 10), (1, 5))


def test_the_committed_step_names_its_vector_and_freshness_is_produce_to_save() -> None:
    s = streams.on_checkpointed(table(), saved(7, done=((0, 0),)))
    s = streams.on_checkpointed(s, saved(8, done=((0, 1),), ts=30.0, newest=29.0))
    st_ = s.streams["clicks"]
    vector = streams.committed(st_, 7)
    assert vector is not None and vector.offsets == ((0, 10), (1, 0))
    assert streams.committed(st_, None) is None and streams.committed(st_, 99) is None
    assert streams.freshness(st_) == 1.0
    # a position of a dataset nobody cut is ignored
    assert len(streams.on_checkpointed(streams.StreamState(), saved(1, done=())).streams) == 0


def test_records_retention_deleted_before_the_restore_point_trained_them_are_named() -> None:
    s = streams.on_checkpointed(table(), saved(7, done=((0, 0),)))  # p0 10, p1 0
    s = streams.on_shards(
        s,
        ev.StreamShardsAdded(
            **ev.envelope(factories.JOB, "bridge:b1", 2.0, "stream", 1),
            dataset="clicks",
            topic="clicks",
            bridge="b1",
            watermarks=(W(0, 8, 20), W(1, 3, 9)),  # p1's first 3 records are gone
        ),
    )
    st_ = s.streams["clicks"]
    assert streams.expired(st_, streams.committed(st_, 7)) == [streams.Gap(1, 0, 3)]
    assert streams.expired(st_, None) == []


def test_dead_letters_are_counted_and_the_newest_kept_for_status() -> None:
    s = table()
    for i in range(30):
        s = streams.on_undecodable(
            s,
            ev.RecordsUndecodable(
                **ev.envelope(factories.JOB, "data:n0-r0-w0", 3.0, "n0-r0-w0", i),
                dataset="clicks",
                client="n0-r0-w0",
                partition=1,
                offsets=(100 + 2 * i, 101 + 2 * i),
                count=2,
                error="ValueError('not JSON')",
            ),
        )
    st_ = s.streams["clicks"]
    assert st_.undecodable == 60, "the count is exact"
    assert len(st_.dead_letters) == streams.RECENT_DEAD, "the list is bounded"
    assert st_.dead_letters[-1] == streams.DeadLetter(1, 159, "ValueError('not JSON')")
    # a dead letter of a dataset nobody cut is ignored
    stray = ev.RecordsUndecodable(
        **ev.envelope(factories.JOB, "data:c", 3.0, "c", 1),
        dataset="other",
        client="c",
        partition=0,
        offsets=(1,),
        count=1,
    )
    assert streams.on_undecodable(streams.StreamState(), stray) == streams.StreamState()
    from rove.control.cli.status_data import stream_line, stream_view

    line = stream_line(stream_view(st_, now=10.0, committed=None))
    assert "60 undecodable records skipped (dead letters; newest" in line and "p1@159" in line
