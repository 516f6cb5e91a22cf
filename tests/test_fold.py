"""Folding events into job state: properties that hold for any event sequence."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rove.control.catalogue import events as ev
from rove.control.master.evolve import evolve
from rove.control.master.state import (
    JobState,
    NodeStatus,
    decode_state,
    encode_state,
    initial,
)
from tests import factories

nodes = st.sampled_from(["n1", "n2", "n3"])
incs = st.sampled_from(["i1", "i2"])
epochs = st.integers(min_value=1, max_value=4)

any_event = st.one_of(
    st.builds(
        lambda n, i, t: factories.joined(n, inc=i, ts=t),
        nodes,
        incs,
        st.floats(min_value=0, max_value=1e6),
    ),
    st.builds(lambda n, i: factories.left(n, inc=i), nodes, incs),
    st.builds(lambda n, e, i: factories.lost(n, e, inc=i), nodes, epochs, incs),
    st.builds(lambda m, e: factories.elected(m, e), st.sampled_from(["m1", "m2"]), epochs),
    st.builds(lambda e, t: factories.configured(e, t), epochs, st.floats(1, 100)),
    st.just(factories.stop()),
    st.builds(lambda e, p: factories.ended(e, p), epochs, st.sampled_from(list(ev.JobPhase))),
    st.builds(lambda s, e: factories.rejected(s, e), st.integers(1, 1000), epochs),
    st.builds(lambda n: factories.heartbeat(n), nodes),
    st.builds(lambda n, i, t: factories.rdzv(n, inc=i, ts=t), nodes, incs, st.floats(0, 1e4)),
    st.builds(
        lambda n, r, k: factories.exited(n, r, kind=k),
        nodes,
        st.integers(0, 4),
        st.sampled_from(list(ev.FailureKind)),
    ),
    st.builds(lambda n, r: factories.succeeded(n, r), nodes, st.integers(0, 4)),
    st.builds(
        lambda r, e, ns: factories.round_completed(r, e, *ns),
        st.integers(1, 5),
        epochs,
        st.lists(nodes, min_size=1, max_size=3, unique=True),
    ),
    st.builds(lambda n, e: factories.excluded(n, e), nodes, epochs),
    st.builds(
        lambda n, r, ok: factories.check_reported(n, r, ok=ok),
        nodes,
        st.integers(0, 1),
        st.booleans(),
    ),
    st.builds(
        lambda r, e: factories.check_assigned(r, e, ("n1", "n2"), ("n3",)),
        st.integers(0, 1),
        epochs,
    ),
    st.builds(lambda e: factories.check_completed(e), epochs),
    st.builds(
        lambda n, s, r: factories.in_memory(n, s, r),
        nodes,
        st.integers(0, 9),
        st.sampled_from([(0, 1), (2, 3)]),
    ),
    st.builds(
        lambda n, s, r: factories.persisted(n, s, r),
        nodes,
        st.integers(0, 9),
        st.sampled_from([(0, 1), (2, 3)]),
    ),
    st.builds(lambda n, s: factories.ckpt_failed(n, s), nodes, st.integers(0, 9)),
    st.builds(lambda s, e: factories.committed(s, e), st.integers(0, 9), epochs),
)


def fold(state: JobState, events: list[ev.Event], first_seq: int = 1) -> JobState:
    for i, e in enumerate(events):
        state = evolve(state, e, first_seq + i)
    return state


@settings(max_examples=300, deadline=None)
@given(st.lists(any_event, max_size=60), st.data())
def test_snapshot_of_a_prefix_then_the_rest_equals_folding_everything(
    events: list[ev.Event], data: st.DataObject
) -> None:
    cut = data.draw(st.integers(0, len(events)))
    whole = fold(initial("j1"), events)
    snapshot = decode_state(encode_state(fold(initial("j1"), events[:cut])))
    resumed = fold(snapshot, events[cut:], first_seq=cut + 1)
    assert resumed == whole
    assert resumed.applied_seq == len(events)


@settings(max_examples=300, deadline=None)
@given(st.lists(any_event, max_size=60))
def test_evolve_never_raises_and_counts_every_event(events: list[ev.Event]) -> None:
    state = fold(initial("j1"), events)
    assert state.counters.events == len(events)


@settings(max_examples=200, deadline=None)
@given(st.lists(any_event, max_size=40))
def test_replaying_a_decision_twice_changes_nothing_more(events: list[ev.Event]) -> None:
    state = fold(initial("j1"), events)
    decision = factories.lost("n1", 4)
    once = evolve(state, decision, 1000)
    twice = evolve(once, decision, 1001)
    assert twice.nodes == once.nodes
    assert twice.counters.nodes_lost == once.counters.nodes_lost


@settings(max_examples=200, deadline=None)
@given(st.lists(any_event, max_size=40))
def test_a_terminal_phase_never_changes(events: list[ev.Event]) -> None:
    state = fold(initial("j1"), [*events, factories.elected("m9", 9), factories.ended(9)])
    assert state.phase.terminal
    after = fold(state, [factories.ended(9, ev.JobPhase.FAILED), factories.joined("n1")], 500)
    assert after.phase == state.phase


def test_decisions_of_a_deposed_epoch_are_ignored() -> None:
    state = fold(initial("j1"), [factories.joined("n1"), factories.elected("m2", 5)])
    stale = evolve(state, factories.lost("n1", 4), 3)
    assert stale.nodes["n1"].status is NodeStatus.ACTIVE
    assert stale.counters.stale_decisions == 1


def test_a_node_lost_then_rejoining_is_active_with_its_new_incarnation() -> None:
    state = fold(
        initial("j1"),
        [
            factories.elected("m1", 1),
            factories.joined("n1"),
            factories.lost("n1", 1),
            factories.joined("n1", inc="i2"),
        ],
    )
    assert state.nodes["n1"].status is NodeStatus.ACTIVE
    assert state.nodes["n1"].incarnation == "i2"
    assert state.counters.nodes_lost == 1


def test_a_late_lost_decision_about_an_old_incarnation_does_not_touch_the_new_one() -> None:
    state = fold(
        initial("j1"),
        [
            factories.elected("m1", 1),
            factories.joined("n1"),
            factories.joined("n1", inc="i2"),
            factories.lost("n1", 1, inc="i1"),
        ],
    )
    assert state.nodes["n1"].status is NodeStatus.ACTIVE


def test_the_first_node_moves_the_job_to_running() -> None:
    state = fold(initial("j1"), [factories.joined("n1")])
    assert state.phase is ev.JobPhase.RUNNING


def test_election_records_the_leader_epoch_and_fence_sequence() -> None:
    state = fold(initial("j1"), [factories.joined("n1"), factories.elected("m7", 12)])
    assert (state.leader, state.epoch, state.elected_seq) == ("m7", 12, 2)


@settings(max_examples=300, deadline=None)
@given(st.lists(any_event, max_size=60))
def test_the_indexed_state_answers_as_a_naive_scan_would(events: list[ev.Event]) -> None:
    """The rendezvous looks members up by index and counts finished nodes; checkpoints
    count persisted ranks: each answer equals the naive one over the same state."""
    from rove.control.master.checkpoints import to_commit

    state = initial(factories.JOB)
    for seq, e in enumerate(events, 1):
        state = evolve(state, e, seq)
        r, c = state.rdzv, state.ckpt
        for node in ("n1", "n2", "n3", "n4"):
            assert r.member(node) == next((m for m in r.members if m.node == node), None)
        members = {m.node for m in r.members}
        assert set(r.succeeded) <= members and set(r.failed_nodes) <= members
        finished = r.active and bool(members) and set(r.succeeded) >= members
        assert finished == (r.active and bool(members) and len(r.succeeded) >= len(members))
        complete = [
            (step, world)
            for step, (world, ranks) in c.persisted.items()
            if set(ranks) >= set(range(world)) and (c.committed is None or step > c.committed)
        ]
        assert to_commit(c) == (max(complete) if complete else None)
