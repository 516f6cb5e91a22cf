"""The master commits a checkpoint step once every rank of the world persisted it."""

from __future__ import annotations

import time

import msgspec
import pytest

from rove.control.catalogue import events as ev
from rove.control.master.decide import decide
from tests import factories
from tests.sim import Sim


def sim() -> Sim:
    return Sim(ev.RdzvParams(min_nodes=2, max_nodes=2))


def running() -> Sim:
    """Nodes n1 (ranks 0-1) and n2 (ranks 2-3) in round 1."""
    s = sim()
    s.join("n1")
    s.join("n2")
    s.tick()
    return s


def commits(s: Sim) -> list[int]:
    return [d.step for d in s.decisions if isinstance(d, ev.CkptCommitted)]


def test_a_step_is_committed_only_when_every_rank_persisted_it() -> None:
    s = sim()
    s.apply(factories.persisted("n1", 10, (0, 1)))
    s.tick()
    assert commits(s) == []
    s.apply(factories.persisted("n2", 10, (2, 3)))
    s.tick()
    assert commits(s) == [10]
    assert s.state.ckpt.committed == 10 and 10 not in s.state.ckpt.persisted


def test_the_newest_complete_step_is_committed_and_never_an_older_one_after() -> None:
    s = sim()
    for step in (10, 20):
        s.apply(factories.persisted("n1", step, (0, 1)))
        s.apply(factories.persisted("n2", step, (2, 3)))
    s.tick()
    assert commits(s) == [20]
    s.apply(factories.persisted("n1", 15, (0, 1)))
    s.apply(factories.persisted("n2", 15, (2, 3)))
    s.tick()
    assert commits(s) == [20], "an older step never replaces a committed one"


def test_a_partially_persisted_step_is_never_committed() -> None:
    s = sim()
    s.apply(factories.persisted("n1", 30, (0, 1)))
    s.apply(factories.ckpt_failed("n2", 30))
    s.tick(100)
    assert commits(s) == []
    assert "disk is full" in s.state.ckpt.last_error


def test_in_memory_reports_keep_the_newest_step_per_node() -> None:
    s = sim()
    s.apply(factories.in_memory("n1", 7, (0, 1)))
    s.apply(factories.in_memory("n1", 5, (0, 1)))
    assert s.state.ckpt.memory["n1"] == (7, (0, 1))


def test_commit_decisions_have_stable_ids() -> None:
    s = sim()
    s.apply(factories.persisted("n1", 10, (0, 1)))
    s.apply(factories.persisted("n2", 10, (2, 3)))
    a = [d.id for d in decide(s.state, {}, 1.0).decisions if isinstance(d, ev.CkptCommitted)]
    b = [d.id for d in decide(s.state, {}, 2.0).decisions if isinstance(d, ev.CkptCommitted)]
    assert a == b and len(a) == 1


def step_5_committed_and_n1_at_6() -> Sim:
    """A running job of two nodes: step 5 persisted by both, step 6 in n1's memory only."""
    s = running()
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.persisted(node, 5, ranks))
        s.apply(factories.in_memory(node, 5, ranks))
    s.apply(factories.in_memory("n1", 6, (0, 1)))
    s.tick()
    return s


def test_status_says_when_nothing_was_ever_persisted() -> None:
    from rove.control.cli.status_cmd import render, status_view

    s = running()
    s.apply(factories.in_memory("n1", 7, (0, 1)))
    text = render(status_view(s.state, s.liveness, None, s.now))
    assert "nothing persisted yet" in text and "n1 step 7" in text
    s.apply(factories.persisted("n1", 7, (0, 1)))
    s.apply(factories.persisted("n2", 7, (2, 3)))
    s.tick()
    assert "committed step 7" in render(status_view(s.state, s.liveness, None, s.now))


def test_status_says_restarts_are_off_rather_than_0_of_0_used() -> None:
    from rove.control.cli.status_cmd import render, status_view

    view = status_view(running().state, {}, None, 0.0)
    assert "; 0 of 3 restarts used" in render(view)
    view["max_restarts"] = 0
    assert "; restarts off (--max-restarts 0)" in render(view), render(view)


def test_status_of_an_ended_job_says_what_was_durable_and_what_was_in_memory_only() -> None:
    """Once the job ended its shared memory is freed: no "yet", no "losing a node", and
    the steps newer than the committed one are said to have been in memory only."""
    from rove.control.cli.status_cmd import render, status_view

    s = running()
    s.apply(factories.in_memory("n1", 7, (0, 1)))
    s.apply(factories.in_memory("n2", 7, (2, 3)))
    s.apply(factories.succeeded("n1", 1))
    s.apply(factories.succeeded("n2", 1))
    s.tick()
    assert s.state.phase is ev.JobPhase.FINISHED
    s.apply(msgspec.structs.replace(factories.left("n1"), reason="job j1 finished: x"))
    text = render(status_view(s.state, s.liveness, None, s.now))
    assert (
        "checkpoints: none persisted; the newest was in memory only: n1 step 7, n2 step 7" in text
    )
    assert "yet" not in text and "losing a node" not in text, text
    assert "ended after round 1; no restart" in text, text
    assert "* n1 left as the job ended" in text, text

    s = step_5_committed_and_n1_at_6()
    s.apply(factories.succeeded("n1", 1))
    s.apply(factories.succeeded("n2", 1))
    s.tick()
    text = render(status_view(s.state, s.liveness, None, s.now))
    assert "checkpoints: committed step 5; newer steps were in memory only: n1 step 6" in text


def test_status_of_a_cut_off_job_says_until_when_a_rerun_restores_its_steps_from_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job whose `rove run` was killed left its newest steps in its nodes' shared
    memory, which the next agent there reclaims once the grace after the run's last
    touch has passed: the status says which steps, and until when."""
    from rove.control.cli.status_cmd import render, status_view

    monkeypatch.setenv("ROVE_SHM_GRACE_S", "600")
    s = step_5_committed_and_n1_at_6()
    view = status_view(s.state, s.liveness, None, s.now)
    view["cut_off"] = {"last_heard": 1_000_000.0}
    text = render(view)
    until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_000_600.0))
    assert (
        "checkpoints: committed step 5; in its nodes' shared memory: n1 step 6, kept for a "
        f"rerun to restore until about {until} (ROVE_SHM_GRACE_S)"
    ) in text, text
    assert "losing a node" not in text and "yet" not in text, text


def rounds(s: Sim) -> list[ev.RoundCompleted]:
    return [d for d in s.decisions if isinstance(d, ev.RoundCompleted)]


def test_a_restart_restores_the_newest_step_every_rank_holds_in_memory() -> None:
    s = running()
    assert rounds(s)[0].restore_step is None, "a fresh job starts from nothing"
    s.apply(factories.in_memory("n1", 12, (0, 1)))
    s.apply(factories.in_memory("n2", 11, (2, 3)))  # n2 lags one save behind
    s.apply(factories.exited("n1", 1))
    s.tick()
    last = rounds(s)[-1]
    assert (last.restore_step, last.restore_source) == (11, "memory")


def test_a_restart_of_several_nodes_waits_for_each_ones_last_word_on_what_it_holds() -> None:
    """Seen in benchmarks/recovery.py (2 nodes x 2, a flash save every step): rank 1 on n1
    was killed at step 45; n2 held 44 and 45, but its newest report said 43, so the round
    restored 43, which no slot held any more; every rank failed to restore and the job
    started over. n2's workers end too (their peer is gone), and the end it reports comes
    after its newest report: the restart waits for it."""
    s = running()
    s.apply(factories.in_memory("n1", 45, (0, 1)))
    s.apply(factories.in_memory("n2", 43, (2, 3)))  # its report of 45 is still on its way
    s.apply(factories.exited("n1", 1, rank=1, ts=s.now))
    assert not [d for d in s.tick(0.1) if isinstance(d, ev.RoundCompleted)]
    assert s.waiting is not None and "waiting for n2 to report" in s.waiting.reason
    s.apply(factories.in_memory("n2", 45, (2, 3)))
    s.apply(factories.exited("n2", 1, rank=2, kind=ev.FailureKind.COMMUNICATION, ts=s.now))
    s.tick()
    last = rounds(s)[-1]
    assert (last.round, last.restore_step, last.restore_source) == (2, 45, "memory")
    assert "rank 1 on node n1" in last.reason, "the first failure is the cause"


def test_a_member_that_says_nothing_holds_a_restart_back_for_a_bounded_time() -> None:
    from rove.control.master.rendezvous import SETTLE_S

    s = running()
    s.apply(factories.in_memory("n1", 45, (0, 1)))
    s.apply(factories.in_memory("n2", 44, (2, 3)))
    s.apply(factories.exited("n1", 1, rank=1, ts=s.now))
    s.beat("n1")
    s.beat("n2")
    assert not [d for d in s.tick(SETTLE_S - 0.5) if isinstance(d, ev.RoundCompleted)]
    s.beat("n1")
    s.beat("n2")
    s.tick(0.6)
    assert (rounds(s)[-1].round, rounds(s)[-1].restore_step) == (2, 44)


def test_without_memory_for_every_rank_the_committed_step_is_restored() -> None:
    s = running()
    s.apply(factories.persisted("n1", 10, (0, 1)))
    s.apply(factories.persisted("n2", 10, (2, 3)))
    s.tick()
    s.apply(factories.in_memory("n1", 12, (0, 1)))  # n2 holds nothing in memory
    s.apply(factories.exited("n1", 1))
    s.tick()
    last = rounds(s)[-1]
    assert (last.restore_step, last.restore_source) == (10, "storage")


def test_a_new_job_goes_on_from_the_oldest_step_its_nodes_found_on_storage() -> None:
    """An earlier run of the job left steps committed: the first round restores the
    oldest one the members found, rather than starting afresh (which drops them)."""
    s = sim()
    s.apply(factories.found("n1", 40))
    s.apply(factories.found("n2", 30))
    s.join("n1")
    s.join("n2")
    s.tick()
    assert (rounds(s)[-1].restore_step, rounds(s)[-1].restore_source) == (30, "storage")


def test_a_member_that_found_nothing_on_storage_means_a_fresh_start() -> None:
    s = sim()
    s.apply(factories.found("n1", 40))
    s.join("n1")
    s.join("n2")
    s.tick()
    assert (rounds(s)[-1].restore_step, rounds(s)[-1].restore_source) == (
        None,
        ev.RestoreSource.NONE,
    )


def test_once_the_job_commits_its_own_step_a_step_found_is_no_longer_used() -> None:
    s = sim()
    for node in ("n1", "n2"):
        s.apply(factories.found(node, 40))
        s.join(node)
    s.tick()
    s.apply(factories.persisted("n1", 45, (0, 1)))
    s.apply(factories.persisted("n2", 45, (2, 3)))
    s.tick()
    assert commits(s) == [45]
    s.apply(factories.exited("n1", 1))
    s.tick()
    assert (rounds(s)[-1].restore_step, rounds(s)[-1].restore_source) == (45, "storage")


def test_memory_older_than_the_committed_step_is_not_used() -> None:
    s = running()
    s.apply(factories.in_memory("n1", 5, (0, 1)))
    s.apply(factories.in_memory("n2", 5, (2, 3)))
    s.apply(factories.persisted("n1", 10, (0, 1)))
    s.apply(factories.persisted("n2", 10, (2, 3)))
    s.tick()
    s.apply(factories.exited("n1", 1))
    s.tick()
    assert rounds(s)[-1].restore_source == "storage"


def test_a_restore_starts_a_new_lineage_and_never_commits_a_mix_of_two() -> None:
    """Step 94 persisted by n2 in round 1, then round 2 restores step 93: the new lineage
    saves its own step 94. n1's step 94 of round 2 with n2's of round 1 is no step."""
    s = running()
    s.apply(factories.in_memory("n1", 93, (0, 1), rnd=1))
    s.apply(factories.in_memory("n2", 93, (2, 3), rnd=1))
    s.apply(factories.persisted("n2", 94, (2, 3), rnd=1))
    s.apply(factories.exited("n1", 1))
    s.tick()
    assert (rounds(s)[-1].round, rounds(s)[-1].restore_step) == (2, 93)
    assert 94 not in s.state.ckpt.persisted, "the abandoned lineage's step 94 is forgotten"
    s.apply(factories.persisted("n2", 94, (2, 3), rnd=1))  # a late report of it: ignored
    s.apply(factories.persisted("n1", 94, (0, 1), rnd=2))
    s.tick()
    assert commits(s) == [], "ranks 2 and 3 of step 94 belong to the abandoned lineage"
    s.apply(factories.persisted("n2", 94, (2, 3), rnd=2))
    s.tick()
    assert commits(s) == [94]


def test_a_fresh_restart_forgets_every_step_of_the_old_lineage() -> None:
    s = running()
    s.apply(factories.persisted("n1", 5, (0, 1), rnd=1))
    s.apply(factories.exited("n1", 1))
    s.tick()
    assert rounds(s)[-1].restore_step is None
    assert len(s.state.ckpt.persisted) == 0 and s.state.ckpt.cuts[-1] == (2, -1)


def test_no_commit_is_decided_with_a_round_and_a_stale_one_is_not_folded() -> None:
    s = running()
    s.apply(factories.in_memory("n1", 103, (0, 1), rnd=1))
    s.apply(factories.in_memory("n2", 103, (2, 3), rnd=1))
    s.apply(factories.persisted("n1", 105, (0, 1), rnd=1))
    s.apply(factories.persisted("n2", 105, (2, 3), rnd=1))
    s.apply(factories.exited("n1", 1))  # the failure and the complete step 105 in one tick
    decided = decide(s.state, s.liveness, s.now).decisions
    assert any(isinstance(d, ev.RoundCompleted) and d.restore_step == 103 for d in decided)
    assert not any(isinstance(d, ev.CkptCommitted) for d in decided), "not with the round"
    s.tick()
    assert commits(s) == [] and s.state.ckpt.committed is None
    # a commit of 105 decided before the round (a slower master's tick) comes late
    late = ev.CkptCommitted(
        **ev.decision_envelope("j1", 1, "m1", 0.0, "ckpt_committed", 105),
        step=105,
        world_size=4,
        round=1,
    )
    s.apply(late)
    assert s.state.ckpt.committed is None, "step 105 belongs to the abandoned lineage"


def test_ranks_that_fell_back_to_an_older_step_start_the_lineage_there() -> None:
    """Round 2 names committed step 30 from storage; a rank's file of it is corrupted and
    every rank restores step 25 instead, discarding the newer steps. Their first report
    says so: the master's restore, cut and committed step go back to 25, so the new
    lineage's step 27 is committed (it was ignored as older than 30), and a late report
    of the old lineage's step 28 is not mixed into the new one's."""
    s = running()
    for step in (25, 30):
        s.apply(factories.persisted("n1", step, (0, 1), rnd=1))
        s.apply(factories.persisted("n2", step, (2, 3), rnd=1))
        s.tick()
    s.apply(factories.in_memory("n1", 30, (0, 1), rnd=1))
    s.apply(factories.persisted("n1", 33, (0, 1), rnd=1))
    assert commits(s) == [25, 30]
    s.apply(factories.exited("n2", 1))
    s.tick()
    assert (rounds(s)[-1].round, rounds(s)[-1].restore_step) == (2, 30)
    s.apply(factories.progressed("n1", 2, 26, 200.0, restored=30))  # the named one: no news
    assert s.state.ckpt.restored == (30, "storage", 0) and s.state.ckpt.committed == 30
    s.apply(factories.progressed("n2", 1, 26, 200.0, restored=20))  # an older round's: stale
    assert s.state.ckpt.restored == (30, "storage", 0)
    s.apply(factories.progressed("n1", 2, 26, 201.0, restored=25))
    c = s.state.ckpt
    assert c.restored == (25, "storage", 0), "rove status names the step the ranks loaded"
    assert c.committed == 25 and c.cuts[-1] == (2, 25)
    assert "n1" not in c.memory, "the ranks discarded their slot of step 30"
    s.tick()
    again = [d for d in s.decisions if isinstance(d, ev.CkptCommitted)][-1]
    assert (again.step, again.round, again.world_size) == (25, 2, 4), (
        "step 25 is committed again, so that agents record it on storage (which names 30)"
    )
    assert len({d.id for d in s.decisions if isinstance(d, ev.CkptCommitted)}) == 3
    assert s.state.ckpt.recommit is None and s.state.ckpt.committed == 25
    s.tick()
    assert commits(s) == [25, 30, 25], "committed again once"
    s.apply(factories.persisted("n1", 28, (0, 1), rnd=1))  # the old lineage's, late
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.persisted(node, 27, ranks, rnd=2))
        s.apply(factories.in_memory(node, 27, ranks, rnd=2))
    s.apply(factories.persisted("n2", 28, (2, 3), rnd=2))
    s.tick()
    assert commits(s) == [25, 30, 25, 27], "the new lineage's steps below 30 are committed"
    assert s.state.ckpt.memory["n1"][0] == 27
    s.tick()
    assert commits(s) == [25, 30, 25, 27], "ranks 0-1 of step 28 belong to the abandoned lineage"


def test_a_fall_back_from_memory_to_a_newer_step_than_the_committed_one_commits_it() -> None:
    """Round 2 names step 30 from memory; the ranks cannot read it and load step 25 from
    storage, which was persisted but not yet committed (20 was): 25 is committed."""
    s = running()
    s.apply(factories.persisted("n1", 20, (0, 1), rnd=1))
    s.apply(factories.persisted("n2", 20, (2, 3), rnd=1))
    s.tick()
    s.apply(factories.persisted("n1", 25, (0, 1), rnd=1))  # (n2's is on its way)
    s.apply(factories.in_memory("n1", 30, (0, 1), rnd=1))
    s.apply(factories.in_memory("n2", 30, (2, 3), rnd=1))
    s.apply(factories.exited("n2", 1))
    s.tick()
    assert (rounds(s)[-1].restore_step, rounds(s)[-1].restore_source) == (30, "memory")
    s.apply(factories.persisted("n2", 25, (2, 3), rnd=1))
    assert commits(s) == [20]
    s.apply(factories.progressed("n1", 2, 26, 200.0, restored=25))
    s.tick()
    assert commits(s) == [20, 25] and s.state.ckpt.committed == 25
    assert s.state.ckpt.recommit is None and 25 not in s.state.ckpt.persisted


def ended(s: Sim) -> list[ev.JobEnded]:
    return [d for d in s.decisions if isinstance(d, ev.JobEnded)]


def test_a_finishing_job_commits_its_last_step_before_it_ends_and_names_it() -> None:
    s = running()
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.in_memory(node, 40, ranks))
        s.apply(factories.persisted(node, 40, ranks))
        s.apply(factories.succeeded(node, 1))
    decided = decide(s.state, s.liveness, s.now).decisions
    kinds = [type(d) for d in decided]
    assert kinds.index(ev.CkptCommitted) < kinds.index(ev.JobEnded), "committed first"
    s.tick()
    assert s.state.ckpt.committed == 40 and s.state.phase is ev.JobPhase.FINISHED
    assert "its last checkpoint, step 40, is committed to storage" in ended(s)[0].reason


def test_a_job_that_ends_says_which_step_is_durable_when_the_last_is_not() -> None:
    s = running()
    s.apply(factories.persisted("n1", 30, (0, 1)))
    s.apply(factories.persisted("n2", 30, (2, 3)))
    s.tick()
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.in_memory(node, 40, ranks))
    s.apply(factories.persisted("n1", 40, (0, 1)))
    s.apply(factories.ckpt_failed("n2", 40))
    s.apply(factories.succeeded("n1", 1))
    s.apply(factories.succeeded("n2", 1))
    s.tick()
    reason = ended(s)[0].reason
    assert "the newest durable checkpoint is step 30, not step 40" in reason
    assert "disk is full" in reason


def test_a_job_with_memory_checkpoints_only_says_none_is_durable() -> None:
    s = running()
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.in_memory(node, 40, ranks))
        s.apply(factories.succeeded(node, 1))
    s.tick()
    reason = ended(s)[0].reason
    assert "step 40) was kept in memory only: no step is durable" in reason


def test_a_job_whose_every_persist_failed_says_why_none_is_durable() -> None:
    """Not "give --checkpoint-dir": it was given, and storage refused every step."""
    s = running()
    for node, ranks in (("n1", (0, 1)), ("n2", (2, 3))):
        s.apply(factories.in_memory(node, 40, ranks))
    s.apply(factories.ckpt_failed("n2", 40))
    for node in ("n1", "n2"):
        s.apply(factories.succeeded(node, 1))
    s.tick()
    reason = ended(s)[0].reason
    assert "step 40) was kept in memory only: no step reached storage" in reason
    assert "step 40 on n2: " in reason and "disk is full" in reason
    assert "give --checkpoint-dir" not in reason


def test_a_job_without_flash_checkpoints_ends_with_its_plain_reason() -> None:
    s = running()
    s.apply(factories.succeeded("n1", 1))
    s.apply(factories.succeeded("n2", 1))
    s.tick()
    assert ended(s)[0].reason == "all 2 nodes finished their workers"
