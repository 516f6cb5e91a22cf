"""A data position saved with a checkpoint, read back by a data source (pure)."""

from __future__ import annotations

import pytest

from rove.control.catalogue import events as ev
from rove.control.domain import shards
from rove.shard_service.position import read_position, saved_position

SPEC = ev.DatasetSpec(size=640, shard_size=32, epochs=2, seed=3)  # 20 shards an epoch


def position_in(epoch: int) -> ev.DataPosition:
    """Every shard done up to the middle of `epoch` (1-based), one partly trained."""
    half = (epoch - 1) * 20 + 10
    return ev.DataPosition(done=((0, half - 1),), partial=(ev.ShardRef(half, 7),))


def test_a_position_carries_over_to_more_epochs_and_the_earlier_epochs_keep_their_order() -> None:
    """A job resumed with more steps asks for more epochs: it goes on where it stood.
    The epochs before do not change their shards' order, so what was done stays done."""
    pos = position_in(2)
    longer = ev.DatasetSpec(size=640, shard_size=32, epochs=5, seed=3, lease_s=30.0)
    assert read_position(saved_position("ds", SPEC, pos), "ds", longer) == pos
    assert [shards.shard_id(SPEC, k) for k in range(40)] == [
        shards.shard_id(longer, k) for k in range(40)
    ]
    shorter = ev.DatasetSpec(size=640, shard_size=32, epochs=1, seed=3)
    assert read_position(saved_position("ds", SPEC, position_in(1)), "ds", shorter) == (
        position_in(1)
    )


def test_a_position_past_the_epochs_now_asked_for_is_a_clear_error() -> None:
    shorter = ev.DatasetSpec(size=640, shard_size=32, epochs=1, seed=3)
    with pytest.raises(
        ValueError,
        match=r"of ds stands in epoch 2, past the 1 epoch the data source now has: "
        r"give it at least 2 epochs",
    ):
        read_position(saved_position("ds", SPEC, position_in(2)), "ds", shorter)


@pytest.mark.parametrize(
    ("other", "said"),
    [
        (ev.DatasetSpec(size=641, shard_size=32, epochs=2, seed=3), "size=640.*now has size=641"),
        (ev.DatasetSpec(size=640, shard_size=16, epochs=4, seed=3), "shard_size=32.*shard_size=16"),
        (ev.DatasetSpec(size=640, shard_size=32, epochs=2, seed=4), "seed=3.*now has seed=4"),
        (
            ev.DatasetSpec(size=640, shard_size=32, epochs=2, seed=3, shuffle=False),
            "shuffle=True.*shuffle=False",
        ),
    ],
)
def test_a_position_of_other_shards_is_refused_naming_what_differs_and_what_to_do(
    other: ev.DatasetSpec, said: str
) -> None:
    with pytest.raises(ValueError, match=said) as raised:
        read_position(saved_position("ds", SPEC, position_in(1)), "ds", other)
    text = str(raised.value)
    assert "epochs=" not in text, "only what differs is named"
    assert "another dataset name" in text and "another job name" in text


def test_another_datasets_position_is_refused() -> None:
    with pytest.raises(ValueError, match="for dataset 'ds', not 'other'"):
        read_position(saved_position("ds", SPEC, position_in(1)), "other", SPEC)
