"""Rendezvous rounds and the failure policy, on a simulated cluster with an injected clock."""

from __future__ import annotations

import pytest

from rove.control.catalogue import events as ev
from rove.control.master import rendezvous
from tests import factories
from tests.sim import Sim

FK = ev.FailureKind


def params(**kw: object) -> ev.RdzvParams:
    base = {
        "min_nodes": 2,
        "max_nodes": 2,
        "max_restarts": 3,
        "last_call_s": 5.0,
        "below_min_wait_s": 60.0,
    }
    return ev.RdzvParams(**{**base, **kw})  # type: ignore[arg-type]


def two_in_round_1(skews: dict[str, float] | None = None) -> Sim:
    """n1 and n2 training in round 1 (1-2 nodes, a 10 s node timeout); `skews`: how far
    ahead each node's clock is, measured by the leader."""
    sim = Sim(params(min_nodes=1, max_nodes=2), node_timeout=10)
    for node, ahead in (skews or {}).items():
        sim.skew(node, ahead)
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    return sim


def test_a_round_completes_as_soon_as_max_nodes_have_joined() -> None:
    sim = Sim(params())
    sim.join("n1")
    assert sim.wait(100, "n1") == []
    sim.join("n2")
    (rnd,) = sim.tick()
    assert isinstance(rnd, ev.RoundCompleted)
    assert [m.node for m in rnd.members] == ["n1", "n2"]
    assert [m.first_rank for m in rnd.members] == [0, 2] and rnd.world_size == 4
    assert rnd.master_addr == "10.0.0.1" and rnd.round == 1


def test_at_min_nodes_the_round_waits_for_the_last_call() -> None:
    sim = Sim(params(min_nodes=1, max_nodes=3))
    sim.join("n1")
    assert sim.tick(4.9) == []
    (rnd,) = sim.tick(0.2)
    assert [m.node for m in rnd.members] == ["n1"]  # type: ignore[attr-defined]


def test_the_last_call_begins_when_the_minimum_is_here_not_at_the_first_arrival() -> None:
    """As torch's `last_call_timeout`: a node that came long before the others does not
    cut the last call short, so a node a moment behind the minimum's is in the round
    (a network check of 3 of 4 nodes, the 4th arriving 0.3 s late, could not tell the
    broken node from its two peers and excluded all three)."""
    sim = Sim(params(min_nodes=2, max_nodes=3))
    sim.join("n1")
    assert sim.tick(20) == []  # alone for long: below the minimum
    sim.join("n2")
    assert sim.tick(1) == [], "the last call runs from n2's arrival"
    sim.join("n3")
    (rnd,) = sim.tick(0.1)
    assert [m.node for m in rnd.members] == ["n1", "n2", "n3"]  # type: ignore[attr-defined]
    late = Sim(params(min_nodes=2, max_nodes=3))
    late.join("n1")
    late.tick(20)
    late.join("n2")
    assert late.tick(4.9) == []
    (rnd,) = late.tick(0.2)
    assert [m.node for m in rnd.members] == ["n1", "n2"]  # type: ignore[attr-defined]


def test_world_size_is_a_multiple_of_the_node_unit() -> None:
    sim = Sim(params(min_nodes=2, max_nodes=4, node_unit=2))
    for n in ("n1", "n2", "n3"):
        sim.join(n)
    (rnd,) = sim.tick(6)
    assert [m.node for m in rnd.members] == ["n1", "n2"]  # type: ignore[attr-defined]
    assert "n3" in sim.state.rdzv.waiting


def test_a_late_node_joins_the_next_round_which_is_how_the_job_scales_up() -> None:
    sim = Sim(params(min_nodes=1, max_nodes=2))
    sim.join("n1")
    sim.tick(6)
    sim.join("n2")
    assert sim.tick(4) == []  # last call for the newcomer
    (rnd,) = sim.tick(2)
    assert [m.node for m in rnd.members] == ["n1", "n2"]  # type: ignore[attr-defined]
    assert rnd.restart_count == 0 and "scale up" in rnd.reason  # type: ignore[attr-defined]


def test_ranks_keep_a_stable_order_across_rounds() -> None:
    sim = Sim(params(min_nodes=1, max_nodes=3))
    sim.join("zz")
    sim.tick(6)
    sim.join("aa")
    sim.tick(6)
    assert sim.members() == ["zz", "aa"]


def test_a_lost_node_means_a_new_round_without_it_while_at_least_min_remain() -> None:
    sim = two_in_round_1()
    decisions = sim.wait(11, "n1")  # n2 silent past the timeout
    kinds = [ev.kind(d) for d in decisions]
    assert kinds == ["node_lost", "round_completed"]
    assert sim.members() == ["n1"] and sim.state.rdzv.restarts == 0


def test_below_min_nodes_the_job_waits_then_fails_with_a_reason() -> None:
    sim = Sim(params(min_nodes=2, max_nodes=2, below_min_wait_s=60), node_timeout=10)
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.wait(11, "n1")
    assert not sim.state.rdzv.active
    assert sim.wait(30, "n1") == []
    (ended,) = sim.wait(31, "n1")
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FAILED
    assert "fewer than the minimum 2" in ended.reason


def test_a_replacement_node_brings_a_waiting_job_back() -> None:
    sim = Sim(params(min_nodes=2, max_nodes=2), node_timeout=10)
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.wait(11, "n1")
    sim.join("n3")
    (rnd,) = sim.tick()
    assert [m.node for m in rnd.members] == ["n1", "n3"]  # type: ignore[attr-defined]


def test_a_worker_failure_restarts_the_same_members_in_a_new_round() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.exited("n2", 1, rank=3, kind=FK.KILLED))
    (rnd,) = sim.tick()
    assert isinstance(rnd, ev.RoundCompleted)
    assert rnd.round == 2 and rnd.restart_count == 1
    assert [m.node for m in rnd.members] == ["n1", "n2"]
    assert "rank 3 on node n2" in rnd.reason


def test_a_kill_reported_after_its_peers_broken_connection_is_the_rounds_cause() -> None:
    """Regression (CI): a SIGKILLed rank's gloo peer reported `communication` a few
    milliseconds before the kill's own report; the round restarted "after rank 2 on
    node n1: communication" and the restart metric's label said so."""
    sim = two_in_round_1()
    sim.apply(
        factories.exited(
            "n1", 1, rank=0, kind=FK.COMMUNICATION, reason="gloo: reset by peer", ts=sim.now
        )
    )
    sim.apply(factories.exited("n2", 1, rank=3, kind=FK.KILLED, ts=sim.now))
    sim.apply(factories.exited("n1", 1, rank=1, kind=FK.COMMUNICATION, ts=sim.now))
    failure = sim.state.rdzv.failure
    assert failure is not None
    assert (failure.node, failure.rank, failure.kind) == ("n2", 3, FK.KILLED)
    (rnd,) = sim.wait(1, "n1", "n2")
    assert isinstance(rnd, ev.RoundCompleted) and rnd.restart_count == 1
    assert "rank 3 on node n2" in rnd.reason and "killed" in rnd.reason


def test_the_first_of_two_real_failures_stays_the_rounds_cause() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.exited("n2", 1, rank=3, kind=FK.OOM, ts=sim.now))
    sim.apply(factories.exited("n1", 1, rank=0, kind=FK.KILLED, ts=sim.now))
    sim.apply(factories.exited("n1", 1, rank=1, kind=FK.COMMUNICATION, ts=sim.now))
    failure = sim.state.rdzv.failure
    assert failure is not None and (failure.node, failure.kind) == ("n2", FK.OOM)


@pytest.mark.parametrize("measured", [True, False])
def test_a_node_minutes_ahead_waits_the_last_call_not_its_skew(measured: bool) -> None:
    """Its join is stamped three minutes ahead: read on the leader's clock once its
    heartbeats tell how far off it is; a leader that has not measured it yet waits the
    skew out (the behaviour before)."""
    sim = Sim(params(min_nodes=1, max_nodes=2, last_call_s=5.0))
    sim.skew("n1", 180.0, measured=measured)
    sim.join("n1")
    assert sim.tick() == []
    waiting = sim.waiting
    assert waiting is not None and waiting.until is not None
    assert waiting.until == pytest.approx(sim.now + 5.0 + (0.0 if measured else 180.0))
    formed = sim.wait(5.5, "n1")
    assert [ev.kind(d) for d in formed] == (["round_completed"] if measured else [])


def test_nodes_ask_to_join_in_order_of_the_leaders_clock() -> None:
    """A node whose clock is behind stamps its join earlier than one that joined
    before it: on the leader's clock it is second, and waits for the next round."""
    sim = Sim(params(min_nodes=1, max_nodes=1, last_call_s=0.0), node_timeout=120)
    sim.skew("n2", -60.0)
    sim.join("n1")
    sim.now += 0.5
    sim.join("n2")
    sim.tick()
    assert sim.members() == ["n1"]


def test_a_communication_failure_stamped_ahead_is_settled_by_heartbeats_after_it() -> None:
    """The failing node's clock is a minute ahead: the others' heartbeats after the
    failure are after it on the leader's clock, though stamped a minute before it."""
    sim = two_in_round_1({"n1": 60.0})
    sim.apply(factories.exited("n1", 1, kind=FK.COMMUNICATION, ts=sim.stamp("n1")))
    assert sim.tick() == []
    (rnd,) = sim.wait(1, "n1", "n2")
    assert isinstance(rnd, ev.RoundCompleted) and rnd.restart_count == 1


def test_a_round_gets_a_fresh_store_port() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.liveness["n1"] = factories.heartbeat("n1", ts=sim.now)
    sim.liveness["n1"] = sim.liveness["n1"].__class__(
        **{
            **{f: getattr(sim.liveness["n1"], f) for f in sim.liveness["n1"].__struct_fields__},
            "ports": (30001, 30002),
        }
    )
    (first,) = sim.tick()
    sim.apply(factories.exited("n1", 1))
    (second,) = sim.tick()
    assert first.master_port == 30001  # type: ignore[attr-defined]
    assert second.master_port == 30002  # type: ignore[attr-defined]


@pytest.mark.parametrize("port_round_between", [False, True])
def test_a_repeated_user_code_error_fails_the_job_fast_naming_the_exception(
    port_round_between: bool,
) -> None:
    """Also when a round started again on a taken port (no restart) came in between."""
    sim = Sim(params(max_restarts=10))
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    boom = "ValueError: bad config in train.py line 3"
    sim.apply(factories.exited("n1", 1, kind=FK.USER_ERROR, reason=boom))
    sim.tick()
    rnd = 2
    if port_round_between:
        _port_taken(sim, rnd, sim.state.rdzv.master_port)
        sim.wait(1, "n1", "n2")
        rnd += 1
    sim.apply(factories.exited("n1", rnd, kind=FK.USER_ERROR, reason=boom))
    (ended,) = sim.tick()
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FAILED
    assert "repeated after a restart" in ended.reason and boom in ended.reason
    assert sim.state.rdzv.restarts == 1


def test_different_failures_are_retried_until_max_restarts() -> None:
    sim = Sim(params(max_restarts=2))
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    for rnd in (1, 2):
        sim.apply(factories.exited("n1", rnd, kind=FK.KILLED))
        (d,) = sim.tick()
        assert isinstance(d, ev.RoundCompleted)
    sim.apply(factories.exited("n2", 3, kind=FK.SEGFAULT, reason="SIGSEGV"))
    (ended,) = sim.tick()
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FAILED
    assert "all 2 restarts (--max-restarts) are used" in ended.reason
    assert "segfault" in ended.reason


@pytest.mark.parametrize(
    ("max_restarts", "said"),
    [
        (0, "worker failed and restarts are off (--max-restarts 0); "),
        (1, "worker failed and its one restart (--max-restarts 1) is used; "),
    ],
)
def test_a_failure_past_few_restarts_ends_the_job_saying_how_many(
    max_restarts: int, said: str
) -> None:
    """With restarts off the first failure ends the job; with one, the second does."""
    sim = Sim(params(max_restarts=max_restarts))
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    for rnd in range(1, max_restarts + 1):
        sim.apply(factories.exited("n1", rnd, kind=FK.KILLED))
        (d,) = sim.tick()
        assert isinstance(d, ev.RoundCompleted)
    sim.apply(factories.exited("n1", max_restarts + 1, kind=FK.KILLED))
    (ended,) = sim.tick()
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FAILED
    assert ended.reason.startswith(said)


def test_a_hardware_fault_excludes_the_node_and_the_rest_go_on() -> None:
    sim = Sim(params(min_nodes=1, max_nodes=2))
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.exited("n2", 1, kind=FK.HARDWARE, reason="Xid 79: GPU fell off the bus"))
    decisions = sim.tick()
    assert [ev.kind(d) for d in decisions] == ["node_excluded", "round_completed"]
    assert sim.members() == ["n1"]
    sim.apply(factories.rdzv("n2", ts=sim.now, n=5))
    assert "n2" not in sim.state.rdzv.waiting, "an excluded node does not come back"


def test_a_late_report_from_an_earlier_round_is_ignored() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.exited("n1", 1))
    sim.tick()
    sim.apply(factories.exited("n2", 1, rank=2))  # round 1 is over
    assert sim.tick() == []


def test_the_job_finishes_when_every_member_succeeded() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.succeeded("n1", 1))
    assert sim.tick() == []
    sim.apply(factories.succeeded("n2", 1))
    (ended,) = sim.tick()
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FINISHED


def test_reasons_count_one_node_in_the_singular() -> None:
    """What `rove run --standalone` prints as its round forms and as the job ends."""
    sim = Sim(params(min_nodes=1, max_nodes=1))
    sim.join("n1")
    (rnd,) = sim.tick()
    assert rnd.reason == "1 of 1 node joined"  # type: ignore[attr-defined]
    sim.apply(factories.succeeded("n1", 1))
    (ended,) = sim.tick()
    assert isinstance(ended, ev.JobEnded) and ended.reason == "the node finished its workers"
    two = Sim(params(min_nodes=1, max_nodes=3))
    two.join("n1")
    two.join("n2")
    (rnd,) = two.tick(6)
    assert rnd.reason == "2 of 1-3 nodes joined"  # type: ignore[attr-defined]


def test_an_agent_restart_breaks_the_round_and_it_is_re_formed() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.join("n2", inc="i2")  # the agent on n2 restarted: new incarnation
    rnd, told = sim.tick()
    assert [(m.node, m.incarnation) for m in rnd.members] == [("n1", "i1"), ("n2", "i2")]  # type: ignore[attr-defined]
    assert isinstance(told, ev.NodeReplaced) and (told.incarnation, told.by_incarnation) == (
        "i1",
        "i2",
    ), "the earlier agent, if it still runs, is told to leave"


def test_the_first_joiner_fixes_the_rendezvous_settings() -> None:
    sim = Sim(params(max_nodes=2))
    sim.join("n1")
    sim.apply(factories.rdzv("n2", ts=sim.now, params=params(max_nodes=7)))
    assert sim.state.rdzv.params is not None and sim.state.rdzv.params.max_nodes == 2


def test_a_communication_failure_waits_for_proof_that_every_member_is_alive() -> None:
    sim = two_in_round_1()
    sim.apply(
        factories.exited(
            "n1", 1, kind=FK.COMMUNICATION, reason="gloo: connection closed", ts=sim.now
        )
    )
    assert sim.tick() == [], "n2 might be dead: wait"
    (rnd,) = sim.wait(1, "n1", "n2")
    assert isinstance(rnd, ev.RoundCompleted) and rnd.restart_count == 1


def test_a_communication_failure_caused_by_a_dead_peer_costs_no_restart() -> None:
    sim = two_in_round_1()
    sim.apply(
        factories.exited(
            "n1", 1, kind=FK.COMMUNICATION, reason="gloo: connection closed", ts=sim.now
        )
    )
    decisions = sim.wait(11, "n1")  # n2 never heard from again
    assert [ev.kind(d) for d in decisions] == ["node_lost", "round_completed"]
    assert sim.members() == ["n1"] and sim.state.rdzv.restarts == 0


def test_with_no_restarts_allowed_a_dead_peers_communication_failure_still_waits() -> None:
    """Regression: with --max-restarts 0 the job failed on the survivor's broken
    connection before the dead peer could be declared lost (a loss costs no restart)."""
    sim = Sim(params(min_nodes=1, max_nodes=2, max_restarts=0), node_timeout=10)
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(
        factories.exited(
            "n1", 1, kind=FK.COMMUNICATION, reason="gloo: connection closed", ts=sim.now
        )
    )
    assert sim.tick(0.5) == [], "waits for n2 to prove alive or be lost"
    decisions = sim.wait(11, "n1")
    assert [ev.kind(d) for d in decisions] == ["node_lost", "round_completed"]
    assert not sim.state.phase.terminal


def test_a_node_started_again_under_a_finished_job_changes_no_round() -> None:
    from rove.control.cli.status_cmd import render, status_view

    sim = Sim(params(min_nodes=1, max_nodes=1))
    sim.join("n1")
    sim.tick(6)
    sim.apply(factories.succeeded("n1", 1))
    (end,) = sim.tick()
    assert isinstance(end, ev.JobEnded) and end.phase is ev.JobPhase.FINISHED
    before = sim.state.rdzv
    sim.join("n1", inc="i2")  # `rove run` again with the finished job's name
    sim.apply(factories.left("n1", inc="i2"))
    assert sim.tick(600) == []
    assert sim.state.rdzv == before, "the rendezvous of an ended job is frozen"
    text = render(status_view(sim.state, sim.liveness, None, sim.now))
    assert "job j1: finished" in text and "ended after round 1" in text
    assert "re-forming" not in text
    # read after the job, with no heartbeat kept: how many ranks it ran is not known
    # ("-", as its step, not 0)
    text = render(status_view(sim.state, {}, None, sim.now))
    header = next(line for line in text.splitlines() if line.startswith("NODE"))
    row = next(line for line in text.splitlines() if line.startswith("n1 "))
    at = header.index("RANKS")
    assert row[at : at + 5].strip() == "-", text


def test_status_shows_the_last_step_each_node_reported_after_the_job_ended() -> None:
    """Read after the job (no heartbeat kept, as `rove status` of a stored job), each
    node's STEP is the newest one its workers reported, not "-"; a report of another
    incarnation of the node (an agent run before) is not its step."""
    from rove.control.cli.status_cmd import render, status_view

    sim = Sim(params(min_nodes=2, max_nodes=2))
    sim.join("n1")
    sim.join("n2")
    sim.tick(6)
    sim.apply(factories.progressed("n1", 1, 40, sim.now))
    sim.apply(factories.progressed("n2", 1, 38, sim.now))
    sim.apply(factories.progressed("n1", 1, 150, sim.now + 5))
    sim.apply(factories.progressed("n2", 1, 7, sim.now + 5, inc="old"))
    sim.apply(factories.succeeded("n1", 1))
    sim.apply(factories.succeeded("n2", 1))
    (end,) = sim.tick()
    assert isinstance(end, ev.JobEnded) and end.phase is ev.JobPhase.FINISHED
    view = status_view(sim.state, {}, None, sim.now)
    assert {n["node"]: n["step"] for n in view["nodes"]} == {"n1": 150, "n2": 38}
    text = render(view)
    header = next(line for line in text.splitlines() if line.startswith("NODE"))
    at = header.index("STEP")
    steps = {
        line.split()[0]: line[at : at + 4].strip()
        for line in text.splitlines()
        if line.startswith(("n1 ", "n2 "))
    }
    assert steps == {"n1": "150", "n2": "38"}, text


def test_why_no_round_forms_is_said_and_shown_by_status() -> None:
    from rove.control.cli.status_cmd import render, status_view

    sim = Sim(params(min_nodes=2, max_nodes=3, last_call_s=5.0))
    sim.join("n1")
    sim.tick(1)
    assert sim.waiting is not None
    assert "waiting for nodes: 1 node here, 2 needed" in sim.waiting.reason
    text = render(status_view(sim.state, sim.liveness, None, sim.now))
    assert "not yet: waiting for nodes: 1 node here, 2 needed (--nnodes)" in text
    sim.join("n2")
    sim.tick(1)
    assert sim.waiting is not None and "last call for more nodes" in sim.waiting.reason
    text = render(status_view(sim.state, sim.liveness, None, sim.now))
    assert "2 nodes here of at most 3: last call for more nodes (in 4s)" in text
    (rnd,) = sim.tick(5)
    assert isinstance(rnd, ev.RoundCompleted) and rnd.cause is ev.RoundCause.FORMED
    assert sim.waiting is not None and sim.waiting.reason == "", "running: nothing to wait for"


def test_a_communication_failure_says_whose_heartbeat_it_waits_for() -> None:
    sim = Sim(params())
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    sim.apply(factories.exited("n1", 1, kind=FK.COMMUNICATION, ts=sim.now + 1))
    sim.now += 2
    sim.beat("n1")
    assert sim.tick() == []
    assert sim.waiting is not None
    assert "waiting for a heartbeat since from n2" in sim.waiting.reason


def test_rounds_say_their_cause() -> None:
    sim = Sim(params(min_nodes=1, max_nodes=2))
    sim.join("n1")
    sim.tick(6)
    sim.apply(factories.exited("n1", 1, kind=FK.KILLED))
    (restart,) = sim.tick()
    sim.join("n2")
    (scale,) = sim.tick(6)
    assert [r.cause for r in sim.rounds()] == [  # type: ignore[attr-defined]
        ev.RoundCause.FORMED,
        ev.RoundCause.RESTART,
        ev.RoundCause.SCALE_UP,
    ]
    assert restart.restart_count == 1 and scale.restart_count == 1  # type: ignore[attr-defined]


def _port_taken(sim: Sim, rnd: int, port: int) -> None:
    """Rank 0's store could not listen on `port` of n1: another process held it."""
    sim.apply(
        factories.exited(
            "n1",
            rnd,
            kind=FK.COMMUNICATION,
            reason="DistNetworkError: ... name: EADDRINUSE",
            ts=sim.now,
            port_taken=port,
        )
    )


def test_a_port_taken_from_rove_starts_the_round_again_without_spending_a_restart() -> None:
    """With restarts off (`--max-restarts 0`, torchrun's default) a port rove offered and
    another process took before the round could listen there ended the job; it is rove's
    pick that failed, not the workers. A few such rounds are free; then they count."""
    sim = Sim(params(min_nodes=1, max_nodes=2, max_restarts=0), node_timeout=10)
    sim.join("n1")
    sim.join("n2")
    sim.tick()
    for rnd in range(1, rendezvous.PORT_ROUNDS + 1):
        port = sim.state.rdzv.master_port
        _port_taken(sim, rnd, port)
        assert sim.tick() == [], "first a heartbeat from each member: fresh ports"
        (again,) = sim.wait(1, "n1", "n2")
        assert isinstance(again, ev.RoundCompleted), again
        assert again.cause is ev.RoundCause.REFORMED and again.restart_count == 0
        assert f"port {port} of node n1 was taken by another process" in again.reason, again.reason
        assert "no restart spent" in again.reason
        assert sim.state.rdzv.port_rounds == rnd
    _port_taken(sim, rendezvous.PORT_ROUNDS + 1, sim.state.rdzv.master_port)
    (ended,) = sim.wait(1, "n1", "n2")
    assert isinstance(ended, ev.JobEnded) and ended.phase is ev.JobPhase.FAILED
    assert "restarts are off (--max-restarts 0)" in ended.reason


def test_a_port_taken_is_the_rounds_cause_over_a_peers_broken_connection() -> None:
    """The peers of a rank that could not listen see a broken connection, possibly first."""
    sim = two_in_round_1()
    sim.apply(
        factories.exited(
            "n2", 1, rank=2, kind=FK.COMMUNICATION, reason="gloo: connection refused", ts=sim.now
        )
    )
    _port_taken(sim, 1, 24001)
    sim.apply(factories.exited("n1", 1, rank=1, kind=FK.KILLED, ts=sim.now))
    failure = sim.state.rdzv.failure
    assert failure is not None and (failure.node, failure.port_taken) == ("n1", 24001)
    (rnd,) = sim.wait(1, "n1", "n2")
    assert isinstance(rnd, ev.RoundCompleted) and rnd.restart_count == 0
