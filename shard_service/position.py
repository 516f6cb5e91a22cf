"""A data position as it is saved in a checkpoint, and read back (no torch).

Every data source of rove (torch samplers and datasets, the TensorFlow shard
feed, streams) saves the same dictionary beside the model: the dataset's name
and parameters, and its position (done shard ranges, partly trained shards).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rove.control.catalogue import events as ev

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
    """The position saved by `saved_position`, for the same dataset and parameters only.

    Raises:
        ValueError: it is another dataset's, or was saved with other parameters.
    """
    if state.get("dataset") != name:
        raise ValueError(
            f"this data position is for dataset {state.get('dataset')!r}, not {name!r}"
        )
    saved = msgspec.convert(state["spec"], ev.DatasetSpec)
    if saved != spec:
        raise ValueError(
            f"the data position of {name} was saved with {saved}, but the data source has "
            f"{spec}: positions only carry over to the same dataset parameters"
        )
    return msgspec.convert(state["position"], ev.DataPosition)
