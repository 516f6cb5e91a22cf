"""The leader's deadline heap finds exactly the lost nodes a scan of every node finds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rove.control.catalogue import events as ev
from rove.control.master.decide import decide
from rove.control.master.silence import Heard, Silence, replaces
from tests import factories
from tests.sim import Sim

TIMEOUT = 10.0
NODES = [f"n{i}" for i in range(6)]

nodes = st.sampled_from(NODES)
steps = st.one_of(
    st.tuples(st.just("join"), nodes, st.sampled_from(["i1", "i2", "i3"])),
    st.tuples(st.just("beat"), nodes, st.sampled_from(["i1", "i2", "i3"])),
    st.tuples(st.just("leave"), nodes, st.just("")),
    st.tuples(st.just("wait"), st.sampled_from([0.5, 3.0, 9.9, 10.0, 10.1, 25.0]), st.just("")),
    st.tuples(st.just("tick"), st.just(""), st.just("")),
    st.tuples(st.just("skew"), nodes, st.sampled_from([-60.0, -5.0, 0.0, 5.0, 60.0])),
    st.tuples(st.just("take over"), st.just(""), st.just("")),
)


class Watched(Sim):
    """A simulated leader that keeps a `Silence` and hears its nodes as the runner and
    its replica do: each node stamps its events by its own clock (`skews`: seconds off
    the leader's), and the leader notes when it heard each (`heard`)."""

    def __init__(self) -> None:
        self.silence = Silence()
        super().__init__(ev.RdzvParams(min_nodes=1, max_nodes=6), node_timeout=TIMEOUT)
        self.silence.start(self.state, self.now)

    def apply(self, event: ev.Event) -> None:
        super().apply(event)
        if isinstance(event, ev.NodeJoined):
            self.heard[event.node] = Heard(event.incarnation, self.now)
            self.silence.joined(event, self.now)

    def beat(self, node: str, *, inc: str = "i1") -> bool:
        if not super().beat(node, inc=inc):
            return False
        self.heard[node] = Heard(inc, self.now)
        return True

    def take_over(self) -> None:
        """A new leader: it has heard nobody live yet (the nodes' stamps are all it has)."""
        self.heard = {}
        self.silence.start(self.state, self.now)

    def lost_both_ways(self) -> tuple[set[str], set[str]]:
        heard = self.heard
        suspects = self.silence.suspects(self.state, self.liveness, self.now, TIMEOUT, heard)
        by_heap = decide(
            self.state, self.liveness, self.now, suspects=suspects, heard=heard
        ).decisions
        by_scan = decide(self.state, self.liveness, self.now, heard=heard).decisions
        return _lost(by_heap), _lost(by_scan)


def _lost(decisions: list[ev.Decision]) -> set[str]:
    return {d.node for d in decisions if isinstance(d, ev.NodeLost)}


@settings(max_examples=300, deadline=None)
@given(st.lists(steps, max_size=60))
def test_the_heap_finds_the_nodes_a_scan_of_every_node_finds(history: list[tuple]) -> None:
    sim = Watched()
    for op, a, b in history:
        if op == "join":
            sim.join(a, inc=b)
        elif op == "beat" and a in sim.state.nodes:
            sim.beat(a, inc=b)  # sometimes a stale incarnation's: it must not count
        elif op == "leave" and a in sim.state.nodes:
            sim.apply(factories.left(a, inc=sim.state.nodes[a].incarnation, ts=sim.now))
        elif op == "wait":
            sim.now += a
        elif op == "skew":
            sim.skews[a] = b  # that node's clock is off by b from now on
        elif op == "take over":
            sim.take_over()
        heap, scan = sim.lost_both_ways()
        assert heap == scan
        if op == "tick":
            sim.tick()  # folds the losses (and rounds) back, as the stream would


def test_a_look_costs_what_is_silent() -> None:
    sim = Watched()
    for i in range(1000):
        sim.apply(factories.joined(f"n{i}", ts=sim.now))
    sim.now += 5
    assert sim.silence.suspects(sim.state, sim.liveness, sim.now, TIMEOUT) == []
    assert len(sim.silence._heap) == 1000  # nothing was popped: nothing is due
    sim.now += 6
    for i in range(990):
        sim.beat(f"n{i}")
    silent = sorted(sim.silence.suspects(sim.state, sim.liveness, sim.now, TIMEOUT))
    assert silent == sorted(f"n{i}" for i in range(990, 1000))
    # those heard from were pushed back with their heartbeat: they are not looked at
    # again before a node timeout has passed
    assert sorted(sim.silence.suspects(sim.state, sim.liveness, sim.now, TIMEOUT)) == silent
    assert sum(1 for ts, _ in sim.silence._heap if ts == sim.now) == 990


def test_a_node_that_left_is_forgotten_and_watched_again_when_it_joins_again() -> None:
    sim = Watched()
    sim.join("n1")
    sim.apply(factories.left("n1", ts=sim.now))
    sim.now += 11
    assert sim.silence.suspects(sim.state, sim.liveness, sim.now, TIMEOUT) == []
    assert len(sim.silence) == 0
    sim.join("n1", inc="i2")
    assert len(sim.silence) == 1
    sim.now += 11
    assert sim.silence.suspects(sim.state, sim.liveness, sim.now, TIMEOUT) == ["n1"]


def test_an_old_incarnation_still_beating_never_hides_the_current_ones_heartbeats() -> None:
    """The history hypothesis found: n1 joined again as i2 and beat; a process of its old
    incarnation i1 still beat after. Kept as the newest, i1's heartbeat would make i2
    silent since its join, and the scan would declare a beating node lost."""
    sim = Watched()
    sim.join("n1", inc="i2")
    sim.now += 10.1
    sim.beat("n1", inc="i2")
    sim.beat("n1", inc="i1")  # the old incarnation's, after the current one's
    assert sim.liveness["n1"].incarnation == "i2"
    assert sim.lost_both_ways() == (set(), set())
    # a new incarnation's heartbeat is taken once the state knows it joined
    early = factories.heartbeat("n1", inc="i3", seq=1, ts=sim.now)
    assert not replaces(sim.liveness["n1"], early, "i2")
    assert replaces(sim.liveness["n1"], early, "i3")
    assert replaces(sim.liveness["n1"], early, None), "a node the state does not know: by time"


@pytest.mark.parametrize("skew", [-60.0, 60.0])
def test_a_node_is_judged_by_when_the_leader_hears_it_not_by_its_own_clock(skew: float) -> None:
    """A node whose clock is a minute behind the master's stamps every heartbeat a
    minute old: judged by its stamps it was lost at every join (the job never formed).
    One a minute ahead stamps them in the future: judged by them, its death was seen a
    minute late."""
    sim = Watched()
    sim.skews["n1"] = skew
    sim.join("n1")
    sim.now += TIMEOUT - 1
    sim.beat("n1")
    sim.now += TIMEOUT - 1  # heard a timeout less a second ago, its stamps a minute off
    assert sim.lost_both_ways() == (set(), set())
    sim.now += 1.1  # silent for a node timeout by the leader's clock
    assert sim.lost_both_ways() == ({"n1"}, {"n1"})
    (lost,) = [d for d in sim.tick() if isinstance(d, ev.NodeLost)]
    assert lost.last_seen == sim.now - TIMEOUT - 0.1, "when it was heard, by the leader's clock"


def test_a_new_leader_that_has_heard_nobody_yet_judges_by_their_stamps() -> None:
    sim = Watched()
    sim.join("n1")
    sim.take_over()
    sim.now += TIMEOUT + 0.1
    assert sim.lost_both_ways() == ({"n1"}, {"n1"})
