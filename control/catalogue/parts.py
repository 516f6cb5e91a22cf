"""Events that grow with the cluster travel in parts of bounded size (pure).

A round's members, a network check's groups, a scale plan's launches and removals
and the scaler's lists of nodes it created or removed grow with the number of
nodes: a round of 10,000 nodes with 30-character host names is about 1 MB, over
NATS's default `max_payload` of 1 MiB. So no such event is published whole when it
is large. `split()` cuts its growing fields (`SPLIT`) into `EventPart`s of at most
`PART_BYTES` of items each (a part carries items of one field), published first,
and then the event itself with those fields empty and `parts` set: the header.
`Joiner` puts them back together on the reading side, where every reader sees the
whole event at the header's stream sequence, as if it had travelled in one message.

Each part has a subject of its own index, under its producer's (`subjects.part`), so
a reader that starts from the newest message per subject (an agent joining a running
job) still finds every part of the newest whole, and drops parts of older ones. A
header whose parts were not all seen is not handed on (`Incomplete`): a reader that
joined mid-round waits for the next round, as it would for a round it was not in.

A part's id is the whole's id and its index, so a part sent again after a lost
acknowledgement is deduplicated like any event.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from rove.control.catalogue import events as ev

#: The fields of each splittable event that grow with the cluster.
SPLIT: Final[dict[type[ev.Event], tuple[str, ...]]] = {
    ev.RoundCompleted: ("members",),
    ev.NetworkCheckAssigned: ("groups",),
    ev.ScalePlan: ("launch", "remove"),
    ev.PlanApplied: ("created", "removed"),
    ev.PlanFailed: ("created", "removed"),
}
#: What a reader gives `Joiner.take` (a set lookup on the replay path).
JOINED: Final[frozenset[type[ev.Event]]] = frozenset({ev.EventPart, *SPLIT})
#: The most bytes of items one part carries (the whole message stays well under
#: 256 KiB, whatever the server's `max_payload`).
PART_BYTES: Final = 128 * 1024

_encoder = msgspec.msgpack.Encoder()
_item_types: dict[tuple[type[ev.Event], str], Any] = {
    (cls, f.name): f.type
    for cls, names in SPLIT.items()
    for f in msgspec.structs.fields(cls)
    if f.name in names
}


class Incomplete(Exception):
    """A header arrived without all of its parts (the reader joined mid-way)."""


def split(event: ev.Event, part_bytes: int = PART_BYTES) -> list[ev.Event]:
    """`event` as it is published: itself, or its parts and then its header."""
    names = SPLIT.get(type(event))
    if names is None:
        return [event]
    fields = {name: getattr(event, name) for name in names}
    sizes = {name: [len(_encoder.encode(item)) for item in items] for name, items in fields.items()}
    if sum(sum(each) for each in sizes.values()) <= part_bytes:
        return [event]
    cuts = [
        (name, start, end)
        for name in names
        if fields[name]
        for start, end in _cuts(sizes[name], part_bytes)
    ]
    parts: list[ev.Event] = [
        ev.EventPart(
            job=event.job,
            id=f"{event.id}.part{index}",
            producer=event.producer,
            ts=event.ts,
            epoch=event.epoch if isinstance(event, ev.Decision) else 0,
            whole=event.id,
            kind=ev.kind(event),
            index=index,
            items=msgspec.Raw(_encoder.encode(fields[name][start:end])),
            field="" if name == names[0] else name,
        )
        for index, (name, start, end) in enumerate(cuts)
    ]
    header = msgspec.structs.replace(event, **dict.fromkeys(names, ()), parts=len(parts))
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
        self._pending: dict[str, tuple[str, dict[int, ev.EventPart]]] = {}

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
            got[event.index] = event
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
        names = SPLIT[cls]
        items: dict[str, list[Any]] = {name: [] for name in names}
        for i in range(parts):
            part = got[i]
            name = part.field or names[0]
            if name not in items:
                raise Incomplete(f"{kind} {event.id}: part {i} is of an unknown field {name}")
            items[name].extend(msgspec.msgpack.decode(part.items, type=_item_types[cls, name]))
        return msgspec.structs.replace(
            event, **{name: tuple(each) for name, each in items.items()}, parts=0
        )
