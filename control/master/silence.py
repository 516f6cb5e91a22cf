"""Which nodes have been silent for a node timeout, at the cost of those that were.

The rule is `last_heard`: a node was last heard from when it joined, or at its newest
heartbeat of the same incarnation (which one is newest: `replaces`). `decide` declares
an active node lost when that is older than the job's node timeout. Scanning every
node for it costs 0.1 s at 25,000 nodes; `Silence` finds the same nodes at the cost of
the ones that are silent.

It keeps a heap of (when last heard, node), one entry per node it watches, each a lower
bound of the truth. `suspects` pops the entries older than the timeout, reads the truth
for each (the folded state and the newest heartbeats), and pushes each back with it: a
node heard from since costs one push per node timeout, a silent one a push per look,
and a look with nothing silent costs nothing. Heartbeats never touch the heap (they
only replace the replica's newest heartbeat of their node). A node is watched from its
`node_joined` on, and forgotten when a look finds it no longer active.

Every active node has an entry no newer than its truth, so every node the scan would
find is popped and found (`tests/test_silence.py` checks this against the scan on
random histories).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from rove.control.catalogue import events as ev
from rove.control.master.state import JobState, NodeRecord, NodeStatus


def last_heard(node: NodeRecord, liveness: Mapping[str, ev.Heartbeat]) -> float:
    """When `node` was last heard from: its join, or its newest heartbeat of the same
    incarnation if later."""
    hb = liveness.get(node.node)
    if hb is not None and hb.incarnation == node.incarnation:
        return max(node.joined_ts, hb.ts)
    return node.joined_ts


def replaces(known: ev.Heartbeat | None, hb: ev.Heartbeat, current: str | None) -> bool:
    """Whether `hb` becomes its node's newest heartbeat in place of `known`; `current`:
    the node's incarnation in the folded state (None: the state has no such node).

    Within an incarnation the higher sequence wins; across incarnations the later time,
    except that another incarnation's never replaces one of `current`: an old
    incarnation still beating (a process that outlived its agent's restart) would
    otherwise hide the live one's heartbeats, and `last_heard` of the live one would
    fall back to its join, its node declared lost while it beats."""
    if known is None:
        return True
    if known.incarnation == hb.incarnation:
        return known.seq < hb.seq
    if current is not None and known.incarnation == current:
        return False
    return known.ts <= hb.ts


class Silence:
    """The active nodes of one job ordered by when they were last heard from (a leader's;
    `start` when it leads, `joined` for each `node_joined` it folds)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._watched: set[str] = set()

    def start(self, state: JobState) -> None:
        """Watch every active node of `state` (and forget any other)."""
        self._heap = [
            (n.joined_ts, n.node) for n in state.nodes.values() if n.status is NodeStatus.ACTIVE
        ]
        heapq.heapify(self._heap)
        self._watched = {node for _, node in self._heap}

    def stop(self) -> None:
        self._heap, self._watched = [], set()

    def joined(self, event: ev.NodeJoined) -> None:
        """Watch a node that joined (again); one watched already keeps its entry."""
        if event.node not in self._watched:
            self._watched.add(event.node)
            heapq.heappush(self._heap, (event.ts, event.node))

    def suspects(
        self, state: JobState, liveness: Mapping[str, ev.Heartbeat], now: float, timeout: float
    ) -> list[str]:
        """The active nodes not heard from for over `timeout` at `now` (compared as
        `decide` compares them, so that none it would find is missed)."""
        heap, silent, again = self._heap, [], []
        while heap and now - heap[0][0] > timeout:
            _, node = heapq.heappop(heap)
            record = state.nodes.get(node)
            if record is None or record.status is not NodeStatus.ACTIVE:
                self._watched.discard(node)
                continue
            heard = last_heard(record, liveness)
            again.append((heard, node))
            if now - heard > timeout:
                silent.append(node)
        for entry in again:
            heapq.heappush(heap, entry)
        return silent

    def __len__(self) -> int:
        return len(self._watched)
