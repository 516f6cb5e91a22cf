"""Faults injected on purpose (`--inject-fault`): the plan as data, fired once each; and
what the console says once training resumes after one (`rove.agent.resumption`)."""

from __future__ import annotations

import signal

import pytest

from rove.agent.faults import Fault, FaultPlan, parse


def test_a_fault_reads_as_signal_rank_and_step() -> None:
    assert parse("kill:1@300") == Fault(rank=1, step=300, signal=signal.SIGKILL)
    assert parse("2@5") == Fault(rank=2, step=5, signal=signal.SIGKILL), "kill by default"
    assert parse("TERM:0@7").signal is signal.SIGTERM
    assert str(parse("segv:3@9")) == "SIGSEGV to rank 3 at step 9"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("kill:1", "RANK@STEP"),
        ("1@x", "RANK@STEP"),
        ("-1@3", "RANK@STEP"),
        ("hup:1@3", "the signal is one of kill, term, int, segv, abrt"),
    ],
)
def test_a_malformed_fault_is_refused_saying_what_to_write(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse(text)


def test_a_fault_fires_once_when_its_rank_reaches_its_step_on_the_node_that_runs_it() -> None:
    plan = FaultPlan([parse("kill:1@10"), parse("term:3@4")])
    assert plan.due({0: 50, 1: 9}) == [], "rank 1 is not there yet; rank 3 runs elsewhere"
    assert plan.due({0: 51, 1: 10}) == [parse("kill:1@10")]
    assert plan.due({0: 60, 1: 12}) == [], "a restarted round trains step 10 again: no repeat"
    assert plan.due({2: 1, 3: 4}) == [parse("term:3@4")]
    assert plan.pending == []


def test_training_again_is_said_once_every_local_rank_trained_after_an_interruption() -> None:
    from msgspec.structs import replace

    from rove.agent.progress import Progress
    from rove.agent.resumption import Resumption
    from rove.control.catalogue import events as ev
    from tests import factories

    now = [100.0]
    said: list[str] = []
    resumption = Resumption(lambda text, **_: said.append(text), lambda: now[0])
    first = factories.round_completed(1, 1, "n1")
    resumption.round_started(first)
    assert not resumption.waiting, "a job's first round is no resumption"
    resumption.interrupted()  # a worker failed at t=100
    now[0] = 101.0
    resumption.interrupted()  # the new round stops the rest: the first moment counts
    again = replace(
        factories.round_completed(2, 1, "n1"),
        cause=ev.RoundCause.RESTART,
        restore_step=150,
        restore_source=ev.RestoreSource.MEMORY,
    )
    resumption.round_started(again)
    now[0] = 100.75
    resumption.progress({0: Progress(151, 1, 1, first_step=151), 1: Progress(0, 0, 0)})
    assert said == [], "rank 1 has not trained yet"
    resumption.progress(
        {0: Progress(152, 1, 1, first_step=151), 1: Progress(151, 1, 1, first_step=151)}
    )
    assert said == [
        "round 2: training again 0.8s after the interruption, at step 151 "
        "(restored step 150 from memory)"
    ]
    resumption.progress({0: Progress(153, 1, 1, first_step=151)})
    assert len(said) == 1, "once"


def test_a_round_that_never_trained_hands_the_resumption_to_the_next_one() -> None:
    """A re-formed round whose workers never stepped (the node was lost again while they
    started), then a scale-up round that trains: the sentence names the round that
    trains, and counts from the first interruption. (The nemesis saw `round 3:
    training again` from a node that trained in round 6.)"""
    from msgspec.structs import replace

    from rove.agent.progress import Progress
    from rove.agent.resumption import Resumption
    from rove.control.catalogue import events as ev
    from tests import factories

    now = [100.0]
    said: list[str] = []
    resumption = Resumption(lambda text, **_: said.append(text), lambda: now[0])
    resumption.round_started(factories.round_completed(1, 1, "n1"))
    resumption.interrupted()
    reformed = replace(factories.round_completed(3, 1, "n1"), cause=ev.RoundCause.RESTART)
    resumption.round_started(reformed)
    now[0] = 110.0
    resumption.interrupted()  # its workers are stopped before they report a step
    grown = replace(
        factories.round_completed(4, 1, "n1"),
        cause=ev.RoundCause.SCALE_UP,
        restore_step=95,
        restore_source=ev.RestoreSource.STORAGE,
    )
    resumption.round_started(grown)
    now[0] = 120.0
    resumption.progress({0: Progress(96, 1, 1, first_step=96)})
    assert said == [
        "round 4: training again 20.0s after the interruption, at step 96 "
        "(restored step 95 from storage)"
    ]


def test_a_round_whose_ranks_fell_back_to_an_older_step_does_not_claim_the_named_one() -> None:
    """The round named step 30 from storage, a rank's file of it failed its checksum and
    every rank went back to step 25 (their first step is 26): the sentence does not say
    step 30 was restored. (The nemesis printed "at step 26 (restored step 30 from
    storage)" beside the workers' "restored an older step ... step=25 wanted=30".)"""
    from msgspec.structs import replace

    from rove.agent.progress import Progress
    from rove.agent.resumption import Resumption
    from rove.control.catalogue import events as ev
    from tests import factories

    def restarted(rnd: int) -> ev.RoundCompleted:
        """Round `rnd`, after a failure, naming step 30 from storage."""
        return replace(
            factories.round_completed(rnd, 1, "n1"),
            cause=ev.RoundCause.RESTART,
            restore_step=30,
            restore_source=ev.RestoreSource.STORAGE,
        )

    said: list[str] = []
    resumption = Resumption(lambda text, **_: said.append(text), lambda: 100.0)
    resumption.round_started(factories.round_completed(1, 1, "n1"))
    resumption.interrupted()
    resumption.round_started(restarted(2))
    resumption.progress({0: Progress(26, 1, 1, first_step=26)})
    assert said == [
        "round 2: training again 0.0s after the interruption, at step 26 (step 30 from "
        "storage could not be read: the ranks went back to an older step)"
    ]
    # a checkpointer that says the step it restored: the sentence names it
    resumption.interrupted()
    resumption.round_started(restarted(3))
    resumption.progress({0: Progress(26, 1, 1, first_step=21, restored_step=20)})
    assert said[-1] == (
        "round 3: training again 0.0s after the interruption, at step 26 (step 30 from "
        "storage could not be read: the ranks restored step 20 from storage)"
    )
