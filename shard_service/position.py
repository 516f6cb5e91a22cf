"""A data position as it is saved in a checkpoint, and read back (no torch).

Every data source of rove (torch samplers and datasets, the TensorFlow shard
feed, streams) saves the same dictionary beside the model: the dataset's name
and parameters, and its position (done shard ranges, partly trained shards).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rove.control.catalogue import events as ev
from rove.control.domain import shards, words

STATE_VERSION = 1


def saved_position(name: str, spec: ev.DatasetSpec, position: ev.DataPosition) -> dict[str, Any]:
    """What a checkpoint holds of a dataset's position (plain, JSON-ready values)."""
    return {
        "version": STATE_VERSION,
        "dataset": name,
        "spec": msgspec.to_builtins(spec),
        "position": msgspec.to_builtins(position),
    }


def read_position(state: dict[str, Any], name: str, spec: ev.DatasetSpec) -> ev.DataPosition:
    """The position saved by `saved_position`, for the same dataset and shards only.

    Raises:
        ValueError: it is another dataset's, was saved with other shards (another size,
            shard size, seed or shuffle), or stands past the epochs `spec` has.
    """
    if state.get("dataset") != name:
        raise ValueError(
            f"this data position is for dataset {state.get('dataset')!r}, not {name!r}"
        )
    saved = msgspec.convert(state["spec"], ev.DatasetSpec)
    differ = shards.order_differs(saved, spec)  # (the number of epochs may change)
    if differ:
        raise ValueError(
            f"the data position of {name} was saved with {_fields(saved, differ)}, but the "
            f"data source now has {_fields(spec, differ)}: a position carries over only to "
            "the same shards (size, shard_size, seed, shuffle; the epochs may change). "
            "Keep them as they were to resume, or train other data under another dataset "
            "name, or another job name to start afresh"
        )
    position = msgspec.convert(state["position"], ev.DataPosition)
    top = max(
        [*(last for _, last in position.done), *(r.key for r in position.partial)], default=-1
    )
    if not spec.stream and top >= shards.total(spec):
        reached = shards.epoch_of(spec, top) + 1
        raise ValueError(
            f"the data position of {name} stands in epoch {reached}, past the "
            f"{words.counted(spec.epochs, 'epoch')} the data source now has: give it at "
            f"least {reached} epochs to resume there, or another job name to start afresh"
        )
    return position


def _fields(spec: ev.DatasetSpec, names: list[str]) -> str:
    return " ".join(f"{n}={getattr(spec, n)}" for n in names)
