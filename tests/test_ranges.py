"""Key ranges (rove.control.domain.shards): how positions hold done shards without expanding them.
Each operation agrees with the same operation on plain sets of keys."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rove.control.catalogue import events as ev
from rove.control.domain import shards

keys = st.sets(st.integers(min_value=0, max_value=200), max_size=60)


@given(st.lists(keys, max_size=4))
def test_union_of_ranges_is_the_ranges_of_the_union(sets: list[set[int]]) -> None:
    every = set().union(*sets)
    assert shards.union(*(shards.to_ranges(s) for s in sets)) == shards.to_ranges(every)


@given(keys, st.integers(min_value=-5, max_value=205))
def test_contains_and_prefix_agree_with_the_set(done: set[int], key: int) -> None:
    ranges = shards.to_ranges(done)
    assert shards.contains(ranges, key) == (key in done)
    first_hole = next(k for k in range(len(done) + 1) if k not in done)
    assert shards.prefix(ranges) == first_hole
    assert shards.count(ranges) == len(done)


@given(keys, st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=200))
def test_clip_keeps_the_keys_in_the_window(done: set[int], lo: int, hi: int) -> None:
    clipped = shards.clip(shards.to_ranges(done), lo, hi)
    assert set(shards.from_ranges(clipped)) == {k for k in done if lo <= k < hi}


@given(
    st.lists(st.tuples(keys, st.dictionaries(st.integers(0, 200), st.integers(1, 9))), max_size=4)
)
def test_merging_ranks_positions_unites_done_and_keeps_the_furthest_partial(
    ranks: list[tuple[set[int], dict[int, int]]],
) -> None:
    positions = [
        ev.DataPosition(
            done=shards.to_ranges(done),
            partial=tuple(ev.ShardRef(k, o) for k, o in sorted(partial.items())),
        )
        for done, partial in ranks
    ]
    merged = shards.merge(positions)
    every = set().union(*(done for done, _ in ranks))
    assert merged.done == shards.to_ranges(every)
    furthest: dict[int, int] = {}
    for _, partial in ranks:
        for k, o in partial.items():
            furthest[k] = max(furthest.get(k, 0), o)
    assert {r.key: r.offset for r in merged.partial} == {
        k: o for k, o in furthest.items() if k not in every
    }


def test_a_stream_long_run_of_done_shards_stays_one_range() -> None:
    done = ((0, 9_999_999),)
    assert shards.union(done, ((10_000_000, 10_000_000),)) == ((0, 10_000_000),)
    assert shards.prefix(done) == 10_000_000 and shards.contains(done, 5_000_000)
