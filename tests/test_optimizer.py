"""The resource optimiser, with an injected clock: plans as a managed job lives.

`Managed` plays the scaler and the agents around the pure master: it folds
each plan, reports it applied (or failed), and lets launched nodes join and
heartbeat with a speed the test chooses.
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from rove.control.catalogue import events as ev
from rove.control.master import optimizer
from rove.control.master.scaling import SlotPhase
from tests import factories
from tests.sim import Sim

GIB = ev.GIB
POLICY = ev.ScalePolicy(settle_s=10.0, plan_interval_s=2.0, pending_timeout_s=60.0)


def workload(lo: int = 2, hi: int = 2, memory: int = 2 * GIB, **policy: object) -> ev.Workload:
    return ev.Workload(
        argv=("train.py",),
        cwd="/tmp",
        min_nodes=lo,
        max_nodes=hi,
        nproc_per_node=1,
        resources=ev.Resources(cpu=1, memory_bytes=memory),
        policy=ev.msgspec.structs.replace(POLICY, **policy) if policy else POLICY,
    )


class Managed(Sim):
    def __init__(self, w: ev.Workload, *, auto_apply: bool = True, auto_join: bool = True) -> None:
        super().__init__(ev.RdzvParams(min_nodes=w.min_nodes, max_nodes=w.max_nodes, last_call_s=1))
        self.auto_apply = auto_apply
        self.auto_join = auto_join
        self.speed: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.apply(
            ev.JobSubmitted(**ev.envelope(factories.JOB, "cli", self.now, "submit"), workload=w)
        )

    def plans(self) -> list[ev.ScalePlan]:
        return [d for d in self.decisions if isinstance(d, ev.ScalePlan)]

    def step(self, seconds: float = 0.0) -> list[ev.Decision]:
        """Tick; apply each new plan as a scaler would, and let its nodes join."""
        out = []
        self.now += seconds
        self.heartbeats()  # live nodes beat all along
        for _ in range(6):
            ds = self.tick()
            out.extend(ds)
            plans = [d for d in ds if isinstance(d, ev.ScalePlan)]
            if not plans:
                break
            for plan in plans:
                if self.auto_apply:
                    self.applied(plan)
                if self.auto_join:
                    for launch in plan.launch:
                        self.join(launch.node, nproc=1)
                for node in plan.remove:
                    if node in self.state.nodes:
                        inc = self.state.nodes[node].incarnation
                        self.apply(factories.left(node, inc=inc, ts=self.now))
        self.heartbeats()
        return out

    def applied(self, plan: ev.ScalePlan) -> None:
        self.apply(
            ev.PlanApplied(
                **ev.envelope(factories.JOB, "scaler", self.now, "applied", plan.plan),
                plan=plan.plan,
                scaler="s1",
                backend="sim",
                created=tuple(n.node for n in plan.launch),
                removed=plan.remove,
            )
        )

    def failed(self, plan: ev.ScalePlan, error: str = "quota exceeded") -> None:
        self.apply(
            ev.PlanFailed(
                **ev.envelope(factories.JOB, "scaler", self.now, "failed", plan.plan),
                plan=plan.plan,
                scaler="s1",
                backend="sim",
                error=error,
            )
        )

    def heartbeats(self) -> None:
        """Every active node beats at `now`, in the current round, at its speed."""
        r = self.state.rdzv
        for node in self.state.nodes.values():
            if node.status.value != "active":
                continue
            seq = self.liveness[node.node].seq + 1 if node.node in self.liveness else 1
            self.liveness[node.node] = ev.Heartbeat(
                **ev.node_envelope(factories.JOB, node.node, node.incarnation, self.now, "hb", seq),
                seq=seq,
                round=r.round if r.member(node.node) else 0,
                ranks=(
                    ev.RankStat(
                        rank=0,
                        local_rank=0,
                        pid=1,
                        samples_per_s=self.speed.get(node.node, 100.0),
                        busy_s=self.busy.get(node.node),
                    ),
                ),
            )

    def lose(self, node: str) -> ev.NodeLost:
        """The master declares `node` lost now."""
        inc = self.state.nodes[node].incarnation
        event = ev.NodeLost(
            **ev.decision_envelope(factories.JOB, 1, "m1", self.now, "node_lost", node, inc),
            node=node,
            incarnation=inc,
            last_seen=self.now - 10,
            timeout_s=10.0,
        )
        self.apply(event)
        return event

    def live(self) -> list[str]:
        return [s.node for s in self.state.scale.live()]


def test_a_submitted_job_gets_its_minimum_nodes_in_one_plan_and_forms_a_round() -> None:
    m = Managed(workload(2, 2))
    m.step()
    [plan] = m.plans()
    assert plan.rule is ev.ScaleRule.INITIAL
    assert [n.node for n in plan.launch] == ["n0-a0", "n1-a0"]
    assert all(n.resources.memory_bytes == 2 * GIB for n in plan.launch)
    m.step(2.0)
    assert m.members() == ["n0-a0", "n1-a0"]
    assert m.step(30.0) == [] or not m.plans()[1:]  # at the target: nothing more to plan


def test_a_lost_node_is_replaced_once_by_the_next_attempt_of_its_slot() -> None:
    m = Managed(workload(2, 2))
    m.step()
    m.step(2.0)
    loss = m.lose("n1-a0")
    m.step(5.0)
    plans = m.plans()
    assert [p.rule for p in plans] == [ev.ScaleRule.INITIAL, ev.ScaleRule.REPLACE]
    assert [n.node for n in plans[1].launch] == ["n1-a1"]
    assert plans[1].launch[0].replaces == "n1-a0"
    assert plans[1].cause == loss.id
    for _ in range(5):
        m.step(5.0)
    assert len(m.plans()) == 2  # no second plan for the same loss
    assert m.members() == ["n0-a0", "n1-a1"]


def test_an_oom_relaunches_the_node_with_twice_the_memory_without_spending_a_restart() -> None:
    m = Managed(workload(1, 1, memory=2 * GIB))
    m.step()
    m.step(2.0)
    rnd = m.state.rdzv.round
    m.apply(
        factories.exited(
            "n0-a0", rnd, kind=ev.FailureKind.OOM, reason="MemoryError", ts=m.now, inc="i1"
        )
    )
    m.step(3.0)
    oom = m.plans()[-1]
    assert oom.rule is ev.ScaleRule.OOM
    assert oom.remove == ("n0-a0",)
    assert oom.launch[0].node == "n0-a1"
    assert oom.launch[0].resources.memory_bytes == 4 * GIB
    m.step(2.0)
    assert m.members() == ["n0-a1"]
    assert m.state.rdzv.restarts == 0
    assert not m.state.phase.terminal


def test_oom_memory_grows_by_at_most_the_step_cap_and_the_job_fails_at_the_total_cap() -> None:
    m = Managed(
        workload(1, 1, memory=6 * GIB, oom_max_step_bytes=4 * GIB, max_memory_bytes=12 * GIB)
    )
    m.step()
    m.step(2.0)
    sizes = []
    for _ in range(3):
        node = m.members()[0]
        inc = m.state.nodes[node].incarnation
        m.apply(
            factories.exited(
                node, m.state.rdzv.round, kind=ev.FailureKind.OOM, reason="oom", inc=inc, ts=m.now
            )
        )
        m.step(3.0)
        m.step(3.0)
        sizes.append(
            m.plans()[-1].launch[0].resources.memory_bytes // GIB if m.plans()[-1].launch else None
        )
    assert sizes[:2] == [10, 12]  # +4 (step cap), then the 12 GiB total cap
    assert m.state.phase is ev.JobPhase.FAILED
    assert "ran out of memory with 12 GiB" in m.state.end_reason


def test_without_a_memory_limit_an_oom_is_left_to_the_rendezvous() -> None:
    m = Managed(workload(1, 1, memory=0))
    m.step()
    m.step(2.0)
    m.apply(factories.exited("n0-a0", m.state.rdzv.round, kind=ev.FailureKind.OOM, ts=m.now))
    m.step(3.0)
    assert len(m.plans()) == 1


def test_a_failed_plan_backs_off_and_enough_failures_in_a_row_fail_the_job() -> None:
    m = Managed(workload(1, 1, max_failed_plans=3), auto_apply=False, auto_join=False)
    gaps = []
    last = None
    for _ in range(40):
        m.step(1.0)
        plans = m.plans()
        if plans and plans[-1].plan != (last.plan if last else None):
            if last is not None:
                gaps.append(plans[-1].ts - last.ts)
            last = plans[-1]
            m.failed(last)
        if m.state.phase.terminal:
            break
    assert gaps == [4.0, 8.0]  # plan_interval_s x 2 per failure in a row
    assert m.state.phase is ev.JobPhase.FAILED
    assert "3 scale plans in a row failed" in m.state.end_reason
    assert "quota exceeded" in m.state.end_reason


def test_a_node_that_never_joins_is_retried_smaller_then_the_job_goes_on_with_fewer() -> None:
    m = Managed(workload(1, 2, memory=4 * GIB))
    m.step()
    m.step(2.0)
    m.auto_join = False
    m.step(11.0)  # grows: n1-a0 is launched, and never joins
    assert m.plans()[-1].rule is ev.ScaleRule.GROW
    m.step(61.0)
    pending = [p for p in m.plans() if p.rule is ev.ScaleRule.PENDING]
    assert pending and pending[0].remove == ("n1-a0",)  # above the minimum: fewer nodes
    assert pending[0].target == 1

    m2 = Managed(workload(1, 1, memory=4 * GIB), auto_join=False)
    m2.step()
    m2.step(61.0)
    [retry] = [p for p in m2.plans() if p.rule is ev.ScaleRule.PENDING]
    assert retry.launch[0].node == "n0-a1"
    assert retry.launch[0].resources.memory_bytes == 2 * GIB


def test_the_job_grows_while_the_new_node_pays_and_shrinks_back_when_it_does_not() -> None:
    m = Managed(workload(1, 4))
    m.step()
    m.step(2.0)
    m.speed = {"n0-a0": 100.0}
    m.step(11.0)  # settled: grow to 2
    assert m.plans()[-1].rule is ev.ScaleRule.GROW
    assert m.plans()[-1].speed == 100.0
    m.step(2.0)
    assert len(m.members()) == 2
    m.speed = {"n0-a0": 90.0, "n1-a0": 90.0}  # 180: the second node brought 0.8 of a node
    m.step(11.0)
    assert m.plans()[-1].rule is ev.ScaleRule.GROW
    m.step(2.0)
    assert len(m.members()) == 3
    m.speed = {"n0-a0": 62.0, "n1-a0": 62.0, "n2-a0": 62.0}  # 186: +6, 0.07 of a node
    m.step(11.0)
    shrink = m.plans()[-1]
    assert shrink.rule is ev.ScaleRule.SHRINK
    assert shrink.remove == ("n2-a0",) and shrink.target == 2
    m.step(2.0)
    for _ in range(10):
        m.step(11.0)
    assert len(m.members()) == 2  # never grows to 3 again
    assert m.plans()[-1].rule is ev.ScaleRule.SHRINK


def test_a_new_node_not_measured_yet_is_waited_for_not_taken_for_a_slow_one() -> None:
    """A node that joined late (slow start-up) reports 0 samples/s until two of its
    heartbeats saw it step: the job waits for its speed instead of shrinking."""
    m = Managed(workload(1, 4))
    m.step()
    m.step(2.0)
    m.speed = {"n0-a0": 100.0}
    m.step(11.0)
    m.step(2.0)
    assert len(m.members()) == 2
    m.speed = {"n0-a0": 100.0, "n1-a0": 0.0}  # settled, but n1 is not measured yet
    m.step(11.0)
    assert m.plans()[-1].rule is ev.ScaleRule.GROW and len(m.plans()) == 2, "no verdict yet"
    m.speed = {"n0-a0": 100.0, "n1-a0": 100.0}
    m.step(1.0)
    assert [p.rule for p in m.plans()][-1] is ev.ScaleRule.GROW and len(m.plans()) == 3


def test_growth_stops_at_max_nodes() -> None:
    m = Managed(workload(1, 2))
    m.step()
    for _ in range(10):
        m.step(11.0)
        m.speed = {n: 100.0 for n in m.members()}
    assert len(m.members()) == 2
    assert [p.rule for p in m.plans()] == [ev.ScaleRule.INITIAL, ev.ScaleRule.GROW]


def test_a_straggler_is_replaced_by_a_new_attempt_of_its_slot() -> None:
    m = Managed(workload(3, 3))
    m.step()
    m.step(2.0)
    m.busy = {"n0-a0": 0.1, "n1-a0": 0.11, "n2-a0": 0.35}
    m.step(11.0)
    plan = m.plans()[-1]
    assert plan.rule is ev.ScaleRule.STRAGGLER
    assert plan.remove == ("n2-a0",) and plan.launch[0].node == "n2-a1"
    assert "3.3x" in plan.reason


def test_the_plan_budget_stops_planning_and_says_why() -> None:
    m = Managed(workload(1, 1, max_plans=2))
    m.step()
    m.step(2.0)
    for _ in range(3):
        node = m.members()[0] if m.members() else m.live()[0]
        m.lose(node)
        m.step(5.0)
        m.step(5.0)
    assert len(m.plans()) == 2
    assert m.scale_waiting is not None and "budget of 2 plans" in m.scale_waiting.reason


def test_leaving_names_the_nodes_a_plan_stops() -> None:
    m = Managed(workload(1, 1))
    m.step()
    m.step(2.0)
    m.apply(factories.exited("n0-a0", m.state.rdzv.round, kind=ev.FailureKind.OOM, ts=m.now))
    assert optimizer.leaving(m.state.scale) == {"n0-a0"}


# --------------------------------------------------------------------------- properties

ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["lose", "oom", "fail_next", "wait", "slow", "fast", "stall"]),
        st.integers(0, 5),
        st.floats(0.5, 40.0),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lo=st.integers(1, 3), extra=st.integers(0, 2), actions=ACTIONS)
def test_plans_stay_in_bounds_one_per_cause_within_budget(
    lo: int, extra: int, actions: list[tuple[str, int, float]]
) -> None:
    hi = lo + extra
    m = Managed(workload(lo, hi, max_plans=12, max_failed_plans=4))
    fail_next = False
    for action, pick, dt in actions:
        if m.state.phase.terminal:
            break
        live = [n for n in m.state.nodes.values() if n.status.value == "active"]
        target = live[pick % len(live)] if live else None
        if action == "lose" and target is not None:
            m.lose(target.node)
        elif action == "oom" and target is not None and m.state.rdzv.member(target.node):
            m.apply(
                factories.exited(
                    target.node,
                    m.state.rdzv.round,
                    kind=ev.FailureKind.OOM,
                    inc=target.incarnation,
                    ts=m.now,
                )
            )
        elif action == "fail_next":
            fail_next = True
        elif action == "slow":
            m.speed = {n.node: 10.0 for n in live}
        elif action == "fast":
            m.speed = {n.node: 100.0 * (i + 1) for i, n in enumerate(live)}
        m.auto_apply = not fail_next
        m.auto_join = action != "stall"
        before = len(m.plans())
        m.step(dt)
        if fail_next and len(m.plans()) > before:
            for plan in m.plans()[before:]:
                m.failed(plan)
            fail_next = False
        s = m.state.scale
        assert lo <= s.target <= hi
        assert len(s.live()) <= hi
        assert len(m.state.rdzv.members) <= hi
    plans = m.plans()
    assert len(plans) <= 12
    causes = [p.cause for p in plans]
    assert len(causes) == len(set(causes)), "two plans for one cause"
    launched = [n.node for p in plans for n in p.launch]
    assert len(launched) == len(set(launched)), "a node name launched twice"
    for a, b in itertools.pairwise(plans):
        assert b.ts - a.ts >= POLICY.plan_interval_s - 1e-9
    for slot in m.state.scale.slots.values():
        assert slot.phase in SlotPhase


def test_a_node_the_scaler_saw_die_is_lost_and_replaced_at_once() -> None:
    m = Managed(workload(2, 2))
    m.step()
    m.step(2.0)
    m.apply(factories.gone("n0-a0", ts=m.now))
    assert m.state.nodes["n0-a0"].status.value == "lost"
    assert "gone: process exited" in m.state.nodes["n0-a0"].reason
    m.step(0.5)
    assert m.plans()[-1].launch[0].node == "n0-a1"
    m.step(0.5)
    assert set(m.members()) == {"n0-a1", "n1-a0"}


def test_a_node_whose_rove_run_refused_to_start_fails_the_job_at_once_saying_why() -> None:
    """Exit code 2 is `rove run` refusing its arguments or configuration (another job
    writes the checkpoint location): each attempt would be refused alike, so the slot is
    not launched again 5 times (max_attempts) with the refusal lost on the way."""
    m = Managed(workload(2, 2))
    m.step()
    m.step(2.0)
    said = "rove run: --checkpoint-dir /ck is being written by another job, a"
    m.apply(factories.gone("n1-a0", ts=m.now, exit_code=2, reason=f"pod failed ({said})"))
    for _ in range(5):
        m.step(5.0)
    assert [p.rule for p in m.plans()] == [ev.ScaleRule.INITIAL]  # not launched again
    assert m.state.phase is ev.JobPhase.FAILED
    assert "node n1-a0 refused to start" in m.state.end_reason
    assert said in m.state.end_reason


def test_a_node_the_backend_cannot_place_is_retried_smaller_without_waiting_the_timeout() -> None:
    m = Managed(workload(1, 1, memory=4 * GIB), auto_join=False)
    m.step()
    m.step(2.0)  # launched, not joined, well inside the 60 s pending timeout
    assert not [p for p in m.plans() if p.rule is ev.ScaleRule.PENDING]
    said = "unschedulable for 3s: 0/4 nodes are available: 4 Insufficient memory."
    pending = ev.NodePending(
        **ev.envelope(factories.JOB, "scaler:s1", m.now, "node_pending", "n0-a0"),
        node="n0-a0",
        scaler="s1",
        reason=said,
    )
    m.apply(pending)
    m.apply(pending)  # told twice: one plan
    m.step(2.5)
    [retry] = [p for p in m.plans() if p.rule is ev.ScaleRule.PENDING]
    assert retry.launch[0].node == "n0-a1"
    assert retry.launch[0].resources.memory_bytes == 2 * GIB
    assert "Insufficient memory" in retry.reason
    # a late word about the old attempt changes nothing
    m.apply(pending)
    m.step(2.5)
    assert len([p for p in m.plans() if p.rule is ev.ScaleRule.PENDING]) == 1


def _resize(m: Managed, lo: int, hi: int) -> ev.ScaleRequested:
    event = ev.ScaleRequested(
        **ev.envelope(factories.JOB, "operator", m.now, "scale", lo, hi), min_nodes=lo, max_nodes=hi
    )
    m.apply(event)
    return event


def test_an_operator_raises_the_minimum_and_nodes_are_started_up_to_it() -> None:
    m = Managed(workload(1, 1))
    m.step()
    m.step(2.0)
    assert m.members() == ["n0-a0"]
    _resize(m, 3, 4)
    for _ in range(6):
        m.step(3.0)
    assert m.state.scale.target == 3
    assert m.state.rdzv.params is not None and m.state.rdzv.params.max_nodes == 4
    assert sorted(m.live()) == ["n0-a0", "n1-a0", "n2-a0"]
    assert m.members() == ["n0-a0", "n1-a0", "n2-a0"]  # one round of the three


def test_an_operator_lowers_the_maximum_and_the_newest_nodes_are_stopped_once() -> None:
    m = Managed(workload(3, 3))
    m.step()
    m.step(2.0)
    assert len(m.members()) == 3
    request = _resize(m, 1, 2)
    for _ in range(6):
        m.step(3.0)
    resize = [p for p in m.plans() if p.rule is ev.ScaleRule.RESIZE]
    assert len(resize) == 1, "one plan for one request"
    assert resize[0].remove == ("n2-a0",) and resize[0].target == 2
    assert resize[0].cause == f"resize:{request.id}:2"
    assert m.live() == ["n0-a0", "n1-a0"] and m.members() == ["n0-a0", "n1-a0"]


def test_bounds_that_make_no_sense_change_nothing_and_bounds_before_any_node_hold() -> None:
    m = Managed(workload(2, 2))
    before = m.state
    _resize(m, 3, 1)
    assert m.state.scale == before.scale and m.state.rdzv.params == before.rdzv.params
    from rove.control.master import rdzv_state

    early = rdzv_state.on_scale_requested(rdzv_state.RdzvState(), _resize(m, 2, 5))
    joined = rdzv_state.on_rdzv_joined(early, factories.rdzv("n1"))
    assert joined.params is not None and (joined.params.min_nodes, joined.params.max_nodes) == (
        2,
        5,
    )


def tf_workload(lo: int, hi: int) -> ev.Workload:
    ps = ev.PsNodes(
        count=1,
        resources=ev.Resources(cpu=4, memory_bytes=16 * GIB),
        argv=("--tf-ps", "--tf-role", "ps", "--nproc-per-node", "1", "coordinator.py"),
    )
    return ev.msgspec.structs.replace(workload(lo, hi), ps=ps)


def test_a_tensorflow_jobs_parameter_servers_get_nodes_of_their_own_size_kept_on_relaunch() -> None:
    w = tf_workload(3, 3)
    m = Managed(w)
    m.step()
    [initial] = m.plans()
    assert [(n.node, n.role, n.resources.memory_bytes) for n in initial.launch] == [
        ("n0-a0", "ps", 16 * GIB),
        ("n1-a0", "", 2 * GIB),
        ("n2-a0", "", 2 * GIB),
    ]
    assert "1 of them for the parameter servers (4 CPU, 16 GiB each)" in initial.reason
    assert ev.node_argv(w, initial.launch[0]) == w.ps.argv  # type: ignore[union-attr]
    assert ev.node_argv(w, initial.launch[1]) == w.argv
    m.step(2.0)
    m.lose("n0-a0")
    m.step(5.0)
    replace = m.plans()[-1]
    assert [(n.node, n.role, n.resources.memory_bytes) for n in replace.launch] == [
        ("n0-a1", "ps", 16 * GIB)
    ]


def test_a_resize_or_a_node_that_never_joins_never_drops_a_parameter_server() -> None:
    m = Managed(tf_workload(3, 4))
    m.step()
    m.step(2.0)
    _resize(m, 2, 2)
    for _ in range(4):
        m.step(3.0)
    [resize] = [p for p in m.plans() if p.rule is ev.ScaleRule.RESIZE]
    assert resize.remove == ("n2-a0",), "the newest worker's node, not the parameter server's"
    assert "n0-a0" in m.live()
    # a parameter server's node that never joins is retried, not given up
    late = Managed(tf_workload(3, 3), auto_join=False)
    _resize(late, 2, 3)  # (a worker's node that never joined could now be given up)
    late.step()
    late.join("n1-a0", nproc=1)
    late.join("n2-a0", nproc=1)
    late.step(61.0)
    pending = [p for p in late.plans() if p.rule is ev.ScaleRule.PENDING]
    assert [(p.remove, [(n.node, n.role) for n in p.launch]) for p in pending] == [
        (("n0-a0",), [("n0-a1", "ps")])
    ]
