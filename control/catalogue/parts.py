"""Decisions that grow with the cluster travel in parts of bounded size (pure).

A round's members, or a network check's groups, grow with the number of nodes: a
round of 10,000 nodes with 30-character host names is about 1 MB, over NATS's
default `max_payload` of 1 MiB. So no such decision is published whole when it is
large. `split()` cuts its growing field (`SPLIT`) into `EventPart`s of at most
`PART_BYTES` of items each, published first, and then the decision itself with that
field empty and `parts` set: the header. `Joiner` puts them back together on the
reading side, where every reader sees the whole decision at the header's stream
sequence, as if it had travelled in one message.

Each part has a subject of its own index (`subjects.part`), so a reader that starts
from the newest message per subject (an agent joining a running job) still finds
every part of the newest whole, and drops parts of older ones. A header whose parts
were not all seen is not handed on (`Incomplete`): a reader that joined mid-round
waits for the next round, as it would for a round it was not in.

A part's id is the whole's id and its index, so a part sent again after a lost
acknowledgement is deduplicated like any event.
"""

from __future__ import annotations

import itertools
from typing import Any, Final

import msgspec

from rove.control.catalogue import events as ev

#: The field of each splittable decision that grows with the cluster.
SPLIT: Final[dict[type[ev.Event], str]] = {
    ev.RoundCompleted: "members",
    ev.NetworkCheckAssigned: "groups",
}
#: What a reader gives `Joiner.take` (a set lookup on the replay path).
JOINED: Final[frozenset[type[ev.Event]]] = frozenset({ev.EventPart, *SPLIT})
#: The most bytes of items one part carries (the whole message stays well under
#: 256 KiB, whatever the server's `max_payload`).
PART_BYTES: Final = 128 * 1024

_encoder = msgspec.msgpack.Encoder()
_item_types: dict[type[ev.Event], Any] = {
    cls: next(f.type for f in msgspec.structs.fields(cls) if f.name == name)
    for cls, name in SPLIT.items()
}


class Incomplete(Exception):
    """A header arrived without all of its parts (the reader joined mid-way)."""


def split(event: ev.Event, part_bytes: int = PART_BYTES) -> list[ev.Event]:
    """`event` as it is published: itself, or its parts and then its header."""
    name = SPLIT.get(type(event))
    if name is None:
        return [event]
    items: tuple[Any, ...] = getattr(event, name)
    sizes = [len(_encoder.encode(item)) for item in items]
    if sum(sizes) <= part_bytes:
        return [event]
    assert isinstance(event, ev.Decision)
    cuts = list(_cuts(sizes, part_bytes))
    parts: list[ev.Event] = [
        ev.EventPart(
            job=event.job,
            id=f"{event.id}.part{index}",
            producer=event.producer,
            ts=event.ts,
            epoch=event.epoch,
            whole=event.id,
            kind=ev.kind(event),
            index=index,
            items=msgspec.Raw(_encoder.encode(items[start:end])),
        )
        for index, (start, end) in enumerate(cuts)
    ]
    header = msgspec.structs.replace(event, **{name: ()}, parts=len(parts))
    return [*parts, header]


def _cuts(sizes: list[int], most: int) -> list[tuple[int, int]]:
    """[start, end) slices of consecutive items, each as many as fit in `most` bytes
    (at least one)."""
    cuts: list[tuple[int, int]] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > most:
            cuts.append((start, i))
            start, total = i, 0
        total += size
    cuts.append((start, len(sizes)))
    return cuts


class Joiner:
    """Puts split decisions back together, one reader's stream in order.

    It holds the parts of at most one whole per kind: a part of another whole drops
    those of the one before (never finished: its master was deposed mid-way, or the
    reader saw only the newest message of some part subjects)."""

    def __init__(self) -> None:
        self._pending: dict[str, tuple[str, dict[int, msgspec.Raw]]] = {}

    @property
    def pending(self) -> bool:
        """Parts are held whose header has not come yet."""
        return bool(self._pending)

    def take(self, event: ev.Event) -> ev.Event | None:
        """The event to hand on: `event` itself, the whole of a header, or None for a
        part (held until its header).

        Raises:
            Incomplete: a header whose parts were not all seen (the message says
                how many were).
        """
        if type(event) is ev.EventPart:
            whole, got = self._pending.get(event.kind, ("", {}))
            if whole != event.whole:
                got = {}
            got[event.index] = event.items
            self._pending[event.kind] = (event.whole, got)
            return None
        parts: int = getattr(event, "parts", 0)
        if not parts:
            return event
        kind = ev.kind(event)
        whole, got = self._pending.pop(kind, ("", {}))
        seen = len(got) if whole == event.id else 0
        if seen != parts or set(got) != set(range(parts)):
            raise Incomplete(f"{kind} {event.id}: {seen} of its {parts} parts were seen")
        cls = type(event)
        items = itertools.chain.from_iterable(
            msgspec.msgpack.decode(got[i], type=_item_types[cls]) for i in range(parts)
        )
        return msgspec.structs.replace(event, **{SPLIT[cls]: tuple(items)}, parts=0)
