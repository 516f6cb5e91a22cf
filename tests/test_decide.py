"""Master decisions as a pure function of state, heartbeats and an injected clock."""

from __future__ import annotations

from rove.control.catalogue import events as ev
from rove.control.master import decide as master_decide
from rove.control.master.evolve import evolve
from rove.control.master.state import JobState, initial
from tests import factories

TIMEOUT = 10.0
ELECTED_AT = 100.0


def running(*events: ev.Event) -> JobState:
    state = initial("j1")
    base = [factories.elected("m1", 3, ts=ELECTED_AT), factories.configured(3, TIMEOUT)]
    for i, e in enumerate([*base, *events]):
        state = evolve(state, e, i + 1)
    return state


def decide(
    state: JobState, hb: dict[str, ev.Heartbeat], now: float, hearing_since: float = 0.0
) -> list[ev.Decision]:
    return master_decide.decide(state, hb, now, hearing_since=hearing_since).decisions


def lost_nodes(decisions: list[ev.Decision]) -> list[str]:
    return [d.node for d in decisions if isinstance(d, ev.NodeLost)]


def test_a_node_silent_past_the_timeout_is_lost() -> None:
    state = running(factories.joined("n1", ts=100.0))
    hb = {"n1": factories.heartbeat("n1", ts=105.0)}
    assert lost_nodes(decide(state, hb, now=105.0 + TIMEOUT - 0.1)) == []
    decisions = decide(state, hb, now=105.0 + TIMEOUT + 0.1)
    assert lost_nodes(decisions) == ["n1"]
    (d,) = decisions
    assert d.epoch == 3 and d.producer == "master:m1" and d.last_seen == 105.0


def test_a_new_leader_waits_one_timeout_before_declaring_anyone_lost() -> None:
    state = running(factories.joined("n1", ts=10.0))
    assert decide(state, {}, now=ELECTED_AT + TIMEOUT - 1) == []
    assert lost_nodes(decide(state, {}, now=ELECTED_AT + TIMEOUT + 1)) == ["n1"]


def test_a_leader_that_could_not_hear_waits_one_timeout_from_when_it_hears_again() -> None:
    """A leader cut off from NATS (its server restarted, or every server of a cluster)
    hears no heartbeat meanwhile, though the nodes train on: it counts their silence
    from its reconnection. (Before, it lost every node as it reconnected.)"""
    state = running(factories.joined("n1", ts=100.0))
    hb = {"n1": factories.heartbeat("n1", ts=105.0)}
    back = 105.0 + 3 * TIMEOUT  # the leader heard nothing from 105 until then
    assert decide(state, hb, now=back + TIMEOUT - 0.1, hearing_since=back) == []
    lost = decide(state, hb, now=back + TIMEOUT + 0.1, hearing_since=back)
    assert lost_nodes(lost) == ["n1"], "silent one full timeout after the leader heard again"
    assert lost[0].last_seen == 105.0


def test_a_heartbeat_from_an_old_incarnation_does_not_keep_a_node_alive() -> None:
    state = running(factories.joined("n1", inc="i2", ts=100.0))
    hb = {"n1": factories.heartbeat("n1", inc="i1", ts=1000.0)}
    assert lost_nodes(decide(state, hb, now=100.0 + TIMEOUT + 1)) == ["n1"]


def test_the_same_decision_gets_the_same_id_on_every_tick() -> None:
    state = running(factories.joined("n1", ts=100.0))
    a = decide(state, {}, now=200.0)
    b = decide(state, {}, now=201.0)
    assert [d.id for d in a] == [d.id for d in b]


def test_a_node_lost_again_after_it_joined_again_is_a_new_decision() -> None:
    """Regression (a CI run): a node declared lost under load joined again with the same
    incarnation; killed later, its second loss got the first one's id, the server
    dropped it as a duplicate, and the job never noticed the node was gone."""
    state = running(factories.joined("n1", ts=100.0))
    (first,) = decide(state, {}, now=100.0 + TIMEOUT + 1)
    state = evolve(state, first, 10)
    state = evolve(state, factories.joined("n1", ts=120.0, n=1), 11)  # "joining again"
    assert state.nodes["n1"].status.value == "active"
    (second,) = decide(state, {}, now=120.0 + TIMEOUT + 1)
    assert isinstance(second, ev.NodeLost)
    assert second.id != first.id
    assert evolve(state, second, 12).nodes["n1"].status.value == "lost"


def test_a_lost_node_is_not_decided_again_once_folded() -> None:
    state = running(factories.joined("n1", ts=100.0))
    (d,) = decide(state, {}, now=200.0)
    state = evolve(state, d, 99)
    assert decide(state, {}, now=300.0) == []


def test_nodes_that_left_are_never_lost() -> None:
    state = running(factories.joined("n1", ts=100.0), factories.left("n1"))
    assert decide(state, {}, now=1000.0) == []


def test_a_stop_request_ends_the_job_as_stopped() -> None:
    state = running(factories.joined("n1", ts=100.0), factories.stop())
    hb = {"n1": factories.heartbeat("n1", ts=150.0)}
    (d,) = decide(state, hb, now=151.0)
    assert isinstance(d, ev.JobEnded) and d.phase is ev.JobPhase.STOPPED
    assert d.reason == "enough"


def test_an_ended_job_decides_nothing() -> None:
    state = running(factories.joined("n1", ts=1.0), factories.ended(3))
    assert decide(state, {}, now=10_000.0) == []


def test_nothing_is_decided_before_the_job_is_configured() -> None:
    state = evolve(initial("j1"), factories.joined("n1", ts=1.0), 1)
    assert decide(state, {}, now=10_000.0) == []


def test_a_node_that_joins_an_ended_job_starts_its_next_run_from_scratch() -> None:
    from tests.sim import Sim

    s = Sim(ev.RdzvParams(min_nodes=1, max_nodes=1))
    s.join("n1")
    s.tick()
    s.apply(factories.succeeded("n1", 1))
    s.tick()
    assert s.state.phase is ev.JobPhase.FINISHED
    assert s.tick(60) == [], "an ended job decides nothing while no node joins it"
    s.apply(factories.left("n1"))  # what the first run's node said after its end
    s.join("n2", inc="i2")
    joined_at = s.state.nodes["n2"].joined_seq
    (started,) = s.tick()
    assert isinstance(started, ev.RunStarted) and (started.run, started.node) == (2, "n2")
    assert started.since == joined_at > s.state.ended_seq, "the run begins at n2's join"
    assert s.state.run == 2 and s.state.phase is ev.JobPhase.PENDING and not s.state.nodes
    assert (s.state.leader, s.state.epoch) == ("m1", 1), "the leadership goes on"
    assert s.state.counters.rounds == 1, "the counts go on"
    assert s.tick(5) == [], "nothing until the leader configured the run"
    s.apply(factories.configured(1))
    s.join("n2", inc="i2")  # its agent joins again, in the new run
    (first,) = s.tick()
    assert isinstance(first, ev.RoundCompleted) and first.round == 1
    assert first.id != s.rounds()[0].id, "run 2's round 1 is not run 1's (deduplication)"
    assert first.restore_step is None, "nothing of run 1 is restored"


def test_a_node_that_joins_an_ended_job_twice_starts_the_next_run_at_its_first_join() -> None:
    """An older agent joined again for an earlier run it saw started; folded before the
    leader's tick, its second join once began the run, leaving its first in the run
    before (`rove status --run N` listed the node)."""
    from tests.sim import Sim

    s = Sim(ev.RdzvParams(min_nodes=1, max_nodes=1))
    s.join("n1")
    s.tick()
    s.apply(factories.succeeded("n1", 1))
    s.tick()
    s.join("n2", inc="i2")
    first_join = s.state.nodes["n2"].joined_seq
    s.join("n2", inc="i2")
    assert s.state.applied_seq > first_join
    (started,) = s.tick()
    assert isinstance(started, ev.RunStarted) and started.since == first_join


def test_a_node_that_joined_before_the_job_ended_starts_no_run() -> None:
    from tests.sim import Sim

    s = Sim(ev.RdzvParams(min_nodes=1, max_nodes=2))
    s.join("n1")
    s.tick(10)
    s.join("n2", inc="i2")  # waits for the next round
    s.apply(factories.succeeded("n1", 1))
    s.tick()
    assert s.state.phase is ev.JobPhase.FINISHED
    assert s.tick(60) == [] and s.state.run == 1


def replaced(decisions: list[ev.Decision]) -> list[tuple[str, str, str]]:
    return [
        (d.node, d.incarnation, d.by_incarnation)
        for d in decisions
        if isinstance(d, ev.NodeReplaced)
    ]


def test_an_agent_whose_node_another_joined_as_is_told_once_and_the_newest_stays() -> None:
    """Two `rove run` under one node id (one machine, no --node-id) waited for each other
    without end, the master's table flipping between them. The newest agent takes the
    node's place and the older one is told so, once: it leaves."""
    state = running(
        factories.joined("n1", inc="i1", ts=100.0),
        factories.joined("n1", inc="i2", ts=101.0, n=1),
        factories.joined("n1", inc="i3", ts=102.0, n=2),  # a third, before any was told
    )
    hb = {"n1": factories.heartbeat("n1", inc="i3", ts=102.0)}
    told = decide(state, hb, now=103.0)
    assert replaced(told) == [("n1", "i1", "i3"), ("n1", "i2", "i3")]
    first = next(d for d in told if isinstance(d, ev.NodeReplaced))
    assert (first.by_host, first.by_pid) == ("host-n1", 1002)
    assert "need their own --node-id" in first.ending and "pid 1002 on host-n1" in first.ending
    assert [d.id for d in told] == [d.id for d in decide(state, hb, now=104.0)]
    for i, d in enumerate(told):
        state = evolve(state, d, 100 + i)
    assert replaced(decide(state, hb, now=105.0)) == []
    assert state.nodes["n1"].incarnation == "i3" and state.nodes["n1"].status.value == "active"


def test_an_agent_that_joins_again_as_itself_or_after_its_node_left_replaces_no_one() -> None:
    rejoined = running(factories.joined("n1", ts=100.0), factories.joined("n1", ts=101.0, n=1))
    after_leaving = running(
        factories.joined("n1", ts=100.0), factories.left("n1"), factories.joined("n1", inc="i2")
    )
    for state in (rejoined, after_leaving):
        hb = {"n1": factories.heartbeat("n1", inc=state.nodes["n1"].incarnation, ts=101.0)}
        assert replaced(decide(state, hb, now=102.0)) == []
