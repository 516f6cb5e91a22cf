"""What one data client holds, has handed out and has trained (pure: no torch, no bus).

Samples move through three stages:

* *held*: in a shard leased to this client;
* *taken*: handed to the data loader (which may prefetch several batches);
* *trained*: the training loop received the batch (`delivered()`).

Only trained samples count. A shard is done when all its samples are
trained; its acknowledgement goes to the master then. `position()` is what a
checkpoint saves: the shards done in this lineage and, for shards partly
trained, how far. Batches are delivered in the order they were taken (the
torch DataLoader keeps order), so each delivery retires the oldest batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rove.control.catalogue import events as ev
from rove.control.domain import shards


@dataclass
class Held:
    ref: ev.ShardRef
    indices: list[int]  # from ref.offset on
    taken: int = 0
    trained: int = 0


@dataclass
class Tracker:
    spec: ev.DatasetSpec
    base: shards.Ranges = ()  # done in the restored lineage
    base_partial: dict[int, int] = field(default_factory=dict)  # partly trained in it
    done: set[int] = field(default_factory=set)  # done by this client since
    held: dict[int, Held] = field(default_factory=dict)  # in lease order
    inflight: deque[list[tuple[int, int]]] = field(default_factory=deque)

    def add(self, refs: tuple[ev.ShardRef, ...]) -> None:
        for ref in refs:
            if ref.key not in self.held:
                self.held[ref.key] = Held(ref, shards.indices(self.spec, ref))

    def untaken(self) -> int:
        """Samples held but not yet handed out."""
        return sum(len(h.indices) - h.taken for h in self.held.values())

    def untaken_shards(self) -> int:
        return sum(1 for h in self.held.values() if h.taken < len(h.indices))

    def take(self, n: int) -> list[int]:
        """Up to `n` next sample indices; remembered as one batch (see `inflight`)."""
        out: list[int] = []
        composition: list[tuple[int, int]] = []
        for key, h in self.held.items():
            k = min(n - len(out), len(h.indices) - h.taken)
            if k <= 0:
                if len(out) == n:
                    break
                continue
            out += h.indices[h.taken : h.taken + k]
            h.taken += k
            composition.append((key, k))
        if composition:
            self.inflight.append(composition)
        return out

    def delivered(self) -> list[ev.ShardRef]:
        """The oldest taken batch reached the training loop: the shards it completed."""
        if not self.inflight:
            return []
        finished = []
        for key, k in self.inflight.popleft():
            h = self.held[key]
            h.trained += k
            if h.trained == len(h.indices):
                finished.append(h.ref)
                del self.held[key]
                self.done.add(key)
        return finished

    def untrain(self) -> None:
        """Forget batches taken but never delivered (the loader was dropped)."""
        self.inflight.clear()
        for h in self.held.values():
            h.taken = h.trained

    def position(self) -> ev.DataPosition:
        """Where this client's lineage stands. Partly trained shards of the restored
        position that no rank holds again yet keep their offset (merging the ranks'
        positions takes the furthest offset, and done wins)."""
        partial = {k: o for k, o in self.base_partial.items() if k not in self.done}
        for key, h in self.held.items():
            if h.ref.offset + h.trained > 0:
                partial[key] = max(partial.get(key, 0), h.ref.offset + h.trained)
        return ev.DataPosition(
            done=shards.union(self.base, shards.to_ranges(self.done)),
            partial=tuple(ev.ShardRef(k, o) for k, o in sorted(partial.items())),
        )

    def restore(self, position: ev.DataPosition) -> None:
        self.base = shards.union(position.done)
        self.base_partial = {r.key: r.offset for r in position.partial}
        self.done = set()
        self.held = {}
        self.inflight.clear()
