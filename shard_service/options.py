"""The keyword options every data client takes, declared once and resolved once.

`ShardSampler`, `ShardedIterable`, `ShardFeed` (TensorFlow) and `StreamIterable`
take the same keywords for how far ahead they lease and where they run; the
sharded ones also take how the dataset is cut. They are declared here as
`TypedDict`s, so type checkers and editors see each keyword and its type through
`**options: Unpack[...]`, and `resolve()` applies their defaults and checks:

| keyword | default | meaning |
| --- | --- | --- |
| `shard_size` | 256 | samples per shard (sharded clients) |
| `epochs` | 1 | passes over the dataset (sharded clients) |
| `seed` | 0 | the shuffle's seed, the same on every rank (sharded clients) |
| `shuffle` | True | visit the shards of each epoch in a shuffled order (sharded clients) |
| `prefetch` | 2 | shards held ahead of use, at least |
| `cover_s` | 10.0 | and enough shards to train this many seconds at the rate seen |
| `lease_s` | 600.0 | a lease not renewed in this time goes back to the queue |
| `answer_timeout_s` | 60.0 | no answer from the master in this time: a warning, and it waits on |
| `nats`, `job` | `ROVE_NATS_URL`, `ROVE_JOB` | where the master listens (`rove run`) |
| `node`, `rank`, `round` | `ROVE_NODE`, `RANK`, `ROVE_ROUND` | who this process is (`rove run`) |

An unknown keyword is a `TypeError` naming it and the ones accepted, as a
misspelt keyword argument would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from rove.control.catalogue import events as ev
from rove.shard_service.client import Placement, dataset_spec, placement

SHARD_SIZE = 256


class Placing(TypedDict, total=False):
    """Where a data client runs (default: what `rove run` put in the environment)."""

    nats: str | None
    job: str | None
    node: str | None
    rank: int | None
    round: int | None


class Leasing(Placing, total=False):
    """How far ahead a data client leases, and how long it waits (see the table above)."""

    prefetch: int
    cover_s: float
    lease_s: float
    answer_timeout_s: float


class Sharding(Leasing, total=False):
    """A sharded client's options: leasing, placement, and how the dataset is cut."""

    shard_size: int
    epochs: int
    seed: int
    shuffle: bool


@dataclass(frozen=True)
class Pace:
    """How far ahead a lease keeper leases, and how long it waits for an answer."""

    prefetch: int = 2
    cover_s: float = 10.0
    answer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be at least 1 shard, not {self.prefetch}")


DEFAULT_PACE = Pace()


@dataclass(frozen=True)
class Resolved:
    """A data client's options with their defaults: its dataset spec, place and pace."""

    spec: ev.DatasetSpec
    where: Placement
    pace: Pace


_PLACING = ("nats", "job", "node", "rank", "round")
_PACE = ("prefetch", "cover_s", "answer_timeout_s")
_SPEC = ("shard_size", "epochs", "seed", "shuffle", "lease_s")


def sharded(what: str, name: str, size: int, options: Mapping[str, Any]) -> Resolved:
    """The options of a client of the indexed dataset `name` of `size` samples.

    Raises:
        TypeError: an unknown keyword.
        ValueError: a bad value (the message names the dataset and the problem).
    """
    return _resolve(what, name, options, Sharding, size=size, shard_size=SHARD_SIZE)


def streamed(what: str, name: str, options: Mapping[str, Any]) -> Resolved:
    """The options of a client of the stream `name` (its shards are cut by a bridge)."""
    return _resolve(what, name, options, Leasing, size=0, shard_size=0, stream=True)


def _resolve(
    what: str, name: str, options: Mapping[str, Any], accepted: type, **fields: Any
) -> Resolved:
    known: frozenset[str] = accepted.__optional_keys__  # type: ignore[attr-defined]
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"the {what} got unknown keyword(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(known))}"
        )
    given = {k: v for k, v in options.items() if k in _SPEC}
    return Resolved(
        spec=dataset_spec(name, **(fields | given)),
        where=placement(what, **{k: options.get(k) for k in _PLACING}),
        pace=Pace(**{k: options[k] for k in _PACE if k in options}),
    )
