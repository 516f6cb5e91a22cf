"""The pre-training network check, on a simulated cluster with an injected clock."""

from __future__ import annotations

from rove.control.catalogue import events as ev
from rove.control.master import netcheck
from tests import factories
from tests.sim import Sim


def params(**kw: object) -> ev.RdzvParams:
    base = {
        "min_nodes": 1,
        "max_nodes": 4,
        "last_call_s": 1.0,
        "network_check": True,
        "network_check_timeout_s": 30.0,
    }
    return ev.RdzvParams(**{**base, **kw})  # type: ignore[arg-type]


def assigned(decisions: list[ev.Decision]) -> ev.NetworkCheckAssigned:
    (a,) = [d for d in decisions if isinstance(d, ev.NetworkCheckAssigned)]
    return a


def report_all(sim: Sim, a: ev.NetworkCheckAssigned, times: dict[str, float | None]) -> None:
    for g in a.groups:
        for node in g.nodes:
            t = times[node]
            sim.apply(
                factories.check_reported(node, a.check_round, ok=t is not None, elapsed=t or 0.0)
            )


def start(sim: Sim, nodes: list[str]) -> ev.NetworkCheckAssigned:
    for n in nodes:
        sim.join(n)
    return assigned(sim.wait(1.5, *nodes))


def test_the_check_runs_before_the_first_round_in_pairs() -> None:
    sim = Sim(params())
    first = start(sim, ["n1", "n2", "n3", "n4"])
    assert [g.nodes for g in first.groups] == [("n1", "n2"), ("n3", "n4")]
    assert first.check_round == 0 and not sim.rounds()
    assert first.groups[0].master_addr == "10.0.0.1"


def test_an_odd_node_joins_the_last_group_and_a_single_node_checks_alone() -> None:
    sim = Sim(params())
    assert [g.nodes for g in start(sim, ["n1", "n2", "n3"]).groups] == [("n1", "n2", "n3")]
    solo = Sim(params())
    assert [g.nodes for g in start(solo, ["n1"]).groups] == [("n1",)]


def test_the_second_round_pairs_the_slowest_with_the_fastest() -> None:
    sim = Sim(params())
    first = start(sim, ["n1", "n2", "n3", "n4"])
    report_all(sim, first, {"n1": 1.0, "n2": 4.0, "n3": 2.0, "n4": 3.0})
    second = assigned(sim.wait(0.1, "n1", "n2", "n3", "n4"))
    assert second.check_round == 1
    assert [set(g.nodes) for g in second.groups] == [{"n2", "n1"}, {"n4", "n3"}]


def test_a_node_failing_both_rounds_is_faulty_and_excluded_and_the_rest_train() -> None:
    sim = Sim(params())
    nodes = ["n1", "n2", "n3", "n4"]
    first = start(sim, nodes)
    report_all(sim, first, {"n1": 1.0, "n2": None, "n3": 1.1, "n4": 1.2})
    second = assigned(sim.wait(0.1, *nodes))
    report_all(sim, second, {"n1": 1.0, "n2": None, "n3": 1.1, "n4": 1.3})
    decisions = sim.wait(0.1, *nodes)
    kinds = [ev.kind(d) for d in decisions]
    assert kinds == ["network_check_completed", "node_excluded", "round_completed"]
    done = decisions[0]
    assert isinstance(done, ev.NetworkCheckCompleted) and done.faulty == ("n2",)
    assert sim.members() == ["n1", "n3", "n4"]


def test_a_node_that_fails_only_once_is_not_faulty() -> None:
    sim = Sim(params())
    nodes = ["n1", "n2", "n3", "n4"]
    first = start(sim, nodes)
    report_all(sim, first, {"n1": None, "n2": None, "n3": 1.1, "n4": 1.2})  # a bad link
    second = assigned(sim.wait(0.1, *nodes))
    report_all(sim, second, {"n1": 1.0, "n2": 1.0, "n3": 1.1, "n4": 1.3})
    decisions = sim.wait(0.1, *nodes)
    assert [ev.kind(d) for d in decisions] == ["network_check_completed", "round_completed"]
    assert len(sim.members()) == 4


def test_a_straggler_is_excluded_only_with_exclude_straggler() -> None:
    times = {"n1": 1.0, "n2": 1.1, "n3": 1.2, "n4": 9.0}
    for exclude, expected in ((False, 4), (True, 3)):
        sim = Sim(params(exclude_stragglers=exclude))
        nodes = list(times)
        first = start(sim, nodes)
        report_all(sim, first, times)
        report_all(sim, assigned(sim.wait(0.1, *nodes)), times)
        decisions = sim.wait(0.1, *nodes)
        done = next(d for d in decisions if isinstance(d, ev.NetworkCheckCompleted))
        assert done.stragglers == ("n4",)
        assert len(sim.members()) == expected


def test_a_live_group_that_never_reports_fails_after_the_backstop_not_the_timeout() -> None:
    """A live agent always reports (its check bounds itself); start-up time is not the
    network's, so the master waits the start-up allowance as well before giving up."""
    sim = Sim(params(network_check_timeout_s=30.0))
    nodes = ["n1", "n2"]
    start(sim, nodes)
    backstop = netcheck.backstop_s(30.0)
    assert backstop >= 30.0 + netcheck.startup_s(30.0)
    assert sim.wait(backstop - 1, *nodes) == [], "a slow start is no failure"
    second = assigned(sim.wait(2, *nodes))
    assert second.check_round == 1
    assert sim.wait(backstop - 1, *nodes) == []
    decisions = sim.wait(2, *nodes)
    done = decisions[0]
    assert isinstance(done, ev.NetworkCheckCompleted)
    assert [r.failures for r in done.results] == [2, 2]
    assert done.faulty == (), "no node passed: none is told faulty (see below)"


def test_when_no_node_passes_a_round_none_is_excluded_and_the_job_trains() -> None:
    """Three nodes check as one group in both rounds: one broken node fails all three,
    and nothing tells it from its peers. Excluding all three left the job waiting for
    ever; now none is excluded, the round forms, and training says what fails."""
    sim = Sim(params(min_nodes=3, max_nodes=3))
    nodes = ["n1", "n2", "n3"]
    first = start(sim, nodes)
    assert [g.nodes for g in first.groups] == [("n1", "n2", "n3")]
    report_all(sim, first, dict.fromkeys(nodes))
    second = assigned(sim.wait(0.1, *nodes))
    assert len(second.groups) == 1
    report_all(sim, second, dict.fromkeys(nodes))
    decisions = sim.wait(0.1, *nodes)
    assert [ev.kind(d) for d in decisions] == ["network_check_completed", "round_completed"]
    assert sim.members() == nodes


def test_a_node_lost_during_a_check_round_counts_as_failed_at_once() -> None:
    sim = Sim(params(network_check_timeout_s=30.0), node_timeout=10.0)
    nodes = ["n1", "n2", "n3"]
    first = start(sim, nodes)
    for node in ("n1", "n2"):
        sim.apply(factories.check_reported(node, 0, ok=True, elapsed=0.5))
    assert sim.wait(5, *nodes) == [], "n3 may still report"
    decisions = sim.wait(11, "n1", "n2")  # n3's agent died: it is lost, not waited for
    assert any(isinstance(d, ev.NodeLost) and d.node == "n3" for d in decisions)
    decisions += sim.tick()
    second = assigned(decisions)
    assert second.check_round == 1 and "n3" not in {n for g in second.groups for n in g.nodes}
    assert sim.now - first.ts < netcheck.backstop_s(30.0)
