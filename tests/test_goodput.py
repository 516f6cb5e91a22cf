"""Goodput from the event log (`rove.control.domain.goodput`): scripted jobs with known times."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rove.control.catalogue import events as ev
from rove.control.domain import goodput as gp
from rove.control.domain.goodput import Bucket as B
from tests import factories as f


def at(e: Any, ts: float) -> Any:
    return msgspec.structs.replace(e, ts=ts)


def rnd(n: int, ts: float, restore: int | None = None, epoch: int = 1) -> ev.RoundCompleted:
    return at(msgspec.structs.replace(f.round_completed(n, epoch, "n1"), restore_step=restore), ts)


def one_failure() -> list[ev.Event]:
    """A job of 101 s: round 1 trains steps 1-100, a worker is killed, round 2 restores
    step 80 (so steps 81-100 of round 1 were wasted) and trains to step 200."""
    return [
        at(f.configured(1), 0.0),
        f.rdzv("n1", ts=2.0),
        rnd(1, 5.0),
        at(f.started("n1", 1, (0,)), 6.0),
        f.progressed("n1", 1, 50, 30.0, first=(1, 10.0)),
        f.progressed("n1", 1, 100, 50.0, first=(1, 10.0)),
        f.exited("n1", 1, ts=52.0),
        rnd(2, 55.0, restore=80),
        at(f.started("n1", 2, (0,)), 56.0),
        f.progressed("n1", 2, 200, 100.0, first=(81, 60.0), restore_s=2.0, ckpt_s=4.0),
        at(f.ended(1, ev.JobPhase.FINISHED), 101.0),
    ]


def test_each_second_of_a_job_with_one_failure_is_in_its_bucket() -> None:
    r = gp.report(gp.of_events(one_failure()), now=500.0)
    s = r.seconds
    assert (r.start, r.end, r.total_s) == (0.0, 101.0, 101.0)
    # round 1 reached step 80 at 42 s (between its reports of step 50 at 30 s and 100 at 50 s)
    assert s[B.PRODUCTIVE] == pytest.approx((42 - 10) + (100 - 60) * 0.9)
    assert s[B.WASTED] == pytest.approx(50 - 42)
    assert s[B.CHECKPOINT] == pytest.approx(4.0)
    assert s[B.RESTORE] == pytest.approx(2.0)
    assert s[B.START_UP] == pytest.approx(2 + (6 - 5) + (10 - 6) + (56 - 55) + (58 - 56))
    assert s[B.RENDEZVOUS] == pytest.approx((5 - 2) + (55 - 52))
    assert s[B.DISRUPTION] == pytest.approx(52 - 50)
    assert s[B.OTHER] == pytest.approx(101 - 100)
    assert sum(s.values()) == pytest.approx(r.total_s)
    assert r.goodput == pytest.approx(68 / 101)
    assert [x.what for x in r.failures] == ["worker_exited"]
    assert r.rounds == 2 and r.ended == "finished"


def test_steps_the_ranks_fell_back_past_are_wasted_too() -> None:
    """Round 2 names step 80, which cannot be read: its ranks restore step 70 and say so
    (first step 71). Round 1's steps 71-100 are wasted, not 81-100, and the round counts
    as restored from storage."""
    events = [
        msgspec.structs.replace(e, restored_step=70, first_step=71)
        if isinstance(e, ev.TrainingProgress) and e.round == 2
        else e
        for e in one_failure()
    ]
    ledger = gp.of_events(events)
    r = gp.report(ledger, now=500.0)
    # round 1 reached step 70 at 38 s (step 50 at 30 s, step 100 at 50 s)
    assert r.seconds[B.WASTED] == pytest.approx(50 - 38)
    assert sum(r.seconds.values()) == pytest.approx(r.total_s)
    assert (ledger.rounds[2].restore_step, ledger.rounds[2].restore_source) == (70, "storage")


def test_an_event_that_says_it_happened_long_before_the_job_does_not_stretch_it() -> None:
    """A forged event (or a clock far off) dated 1970 in the middle of the stream once
    made a finished job's goodput 0.0% of 57 years; one a little early (a node's fact
    stored late) still moves the start."""
    forged = at(f.joined("intruder"), -1_795_000_000.0)
    events = one_failure()
    r = gp.report(gp.of_events([*events[:4], forged, *events[4:]]), now=500.0)
    assert (r.start, r.end, r.total_s) == (0.0, 101.0, 101.0)
    assert r.goodput == pytest.approx(68 / 101)
    early = gp.report(
        gp.of_events([*events[:4], at(f.joined("n2"), -30.0), *events[4:]]), now=500.0
    )
    assert early.start == -30.0


def test_a_window_counts_only_its_own_seconds() -> None:
    r = gp.report(gp.of_events(one_failure()), now=500.0, since=40.0, until=60.0)
    s = r.seconds
    assert r.total_s == 20.0
    assert s[B.PRODUCTIVE] == pytest.approx(2.0)
    assert s[B.WASTED] == pytest.approx(8.0)
    assert s[B.DISRUPTION] + s[B.RENDEZVOUS] + s[B.START_UP] + s[B.RESTORE] == pytest.approx(10.0)
    assert r.rounds == 1 and len(r.failures) == 1


def test_a_running_job_is_measured_up_to_now() -> None:
    events = one_failure()[:-1]
    r = gp.report(gp.of_events(events), now=120.0)
    assert r.end == 120.0 and r.ended == ""
    assert r.seconds[B.OTHER] == pytest.approx(20.0)  # no step since 100 s (so far)


def test_a_fresh_restart_wastes_everything_before_it() -> None:
    events = [
        e if not isinstance(e, ev.RoundCompleted) or e.round == 1 else rnd(2, 55.0)
        for e in one_failure()
    ]
    events = [
        f.progressed("n1", 2, 120, 100.0, first=(1, 60.0))
        if isinstance(e, ev.TrainingProgress) and e.round == 2
        else e
        for e in events
    ]
    r = gp.report(gp.of_events(events), now=500.0)
    assert r.seconds[B.WASTED] == pytest.approx(50 - 10)
    assert r.seconds[B.PRODUCTIVE] == pytest.approx(100 - 60)


def test_the_lineage_skips_a_round_whose_steps_were_all_rolled_back() -> None:
    """Round 3 restores step 40, reached in round 1: round 2 (steps 81-95) was all waste."""
    events = [
        *one_failure()[:-2],
        f.progressed("n1", 2, 95, 70.0, first=(81, 60.0)),
        f.exited("n1", 2, ts=71.0),
        rnd(3, 72.0, restore=40),
        at(f.started("n1", 3, (0,)), 73.0),
        f.progressed("n1", 3, 60, 80.0, first=(41, 74.0)),
        at(f.ended(1, ev.JobPhase.FINISHED), 81.0),
    ]
    ledger = gp.of_events(events)
    assert ledger.survivors() == {3: 60, 2: None, 1: 40}
    s = gp.report(ledger, now=500.0).seconds
    t40 = 10 + (40 - 1) * 20 / 49  # step 40 between step 1 at 10 s and step 50 at 30 s
    assert s[B.PRODUCTIVE] == pytest.approx((t40 - 10) + (80 - 74))
    assert s[B.WASTED] == pytest.approx((50 - t40) + (70 - 60))


def test_a_deposed_masters_round_is_not_counted() -> None:
    events = [*one_failure()]
    events.insert(1, at(f.elected("m2", 2), 1.0))
    events = [
        msgspec.structs.replace(e, epoch=2) if isinstance(e, ev.Decision) and e.ts > 1.0 else e
        for e in events
    ]
    events.insert(8, rnd(9, 53.0, epoch=1))  # a decision of the epoch before
    assert set(gp.of_events(events).rounds) == {1, 2}


def test_waiting_for_a_pending_node_and_a_crash_on_start() -> None:
    pending = ev.NodePending(
        **ev.envelope(f.JOB, "scaler", 1.0, "pending"), node="n1", scaler="s1", reason="no room"
    )
    events = [
        at(f.configured(1), 0.0),
        pending,
        f.rdzv("n1", ts=2.0),
        rnd(1, 5.0),
        at(f.started("n1", 1, (0,)), 6.0),
        f.exited("n1", 1, ts=9.0, kind=ev.FailureKind.USER_ERROR, reason="ImportError"),
        at(f.ended(1, ev.JobPhase.FAILED), 10.0),
    ]
    s = gp.report(gp.of_events(events), now=500.0).seconds
    assert s[B.PENDING] == pytest.approx(2.0)
    assert s[B.START_UP] == pytest.approx((6 - 5) + (9 - 6))
    assert s[B.RENDEZVOUS] == pytest.approx((5 - 2) + (10 - 9))
    assert s[B.PRODUCTIVE] == 0.0


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.1, 20),  # round decision → workers started
            st.floats(0.0, 30),  # → first step
            st.integers(1, 50),  # steps
            st.floats(0.0, 40),  # → last step
            st.floats(0.0, 5),  # → failure
            st.one_of(st.none(), st.integers(0, 300)),  # restore step
            st.floats(0.0, 10),  # checkpoint blocking
        ),
        min_size=1,
        max_size=6,
    ),
    st.floats(0, 300),
    st.floats(0, 300),
)
def test_buckets_always_add_up_to_the_window(rounds: list[Any], a: float, b: float) -> None:
    t = 0.0
    step = 0
    events: list[ev.Event] = [at(f.configured(1), t)]
    for i, (to_start, to_first, steps, to_last, to_fail, restore, ckpt) in enumerate(rounds, 1):
        t += 1.0
        events.append(rnd(i, t, restore=restore))
        t += to_start
        events.append(at(f.started("n1", i, (0,)), t))
        first = (step + 1, t + to_first)
        t += to_first + to_last
        step += steps
        events.append(f.progressed("n1", i, step, t, first=first, ckpt_s=ckpt))
        t += to_fail
        events.append(f.exited("n1", i, ts=t))
    ledger = gp.of_events(events)
    since, until = min(a, b), max(a, b)
    r = gp.report(ledger, now=t + 1, since=since, until=until)
    assert sum(r.seconds.values()) == pytest.approx(r.total_s, abs=1e-6)
    assert all(v >= -1e-9 for v in r.seconds.values())
    assert 0.0 <= r.goodput <= 1.0 + 1e-9
    whole = gp.report(ledger, now=t + 1)
    assert whole.total_s == pytest.approx(t + 1)
    assert not math.isnan(whole.goodput)


def test_a_job_whose_workers_reported_no_step_has_no_goodput_to_say() -> None:
    from rove.control.cli import goodput_cmd

    events = [e for e in one_failure() if not isinstance(e, ev.TrainingProgress)]
    ledger = gp.of_events(events)
    assert not ledger.steps_reported and gp.of_events(one_failure()).steps_reported
    r = gp.report(ledger, now=500.0)
    text = goodput_cmd.render(r, known=ledger.steps_reported)
    assert gp.NOT_KNOWN in text and "goodput 0.0%" not in text
    assert "101.0 s, 2 rounds, 1 failure\n" in text  # (was "1 failures")
    data = goodput_cmd.as_json(r, known=False)
    assert data["goodput"] is None and data["steps_reported"] is False
    assert goodput_cmd.as_json(r)["goodput"] == pytest.approx(r.goodput, abs=1e-4)


def test_the_table_and_the_picture_show_local_times_with_their_offset(zone_ahead: str) -> None:
    """As `rove events` does: a failure's time in the table is the one `rove events` showed
    for it (the job's start and end carry the offset)."""
    from rove.control.cli import goodput_cmd

    text = goodput_cmd.render(gp.report(gp.of_events(one_failure()), now=500.0))
    assert "1970-01-01T05:30:00+05:30 to 1970-01-01T05:31:41+05:30" in text, text
    [failure] = [line for line in text.splitlines() if "worker_exited" in line]
    assert failure.startswith("  05:30:52  worker_exited"), failure
    # the picture too (it said UTC: a failure at 05:30:52 here was drawn at 00:00:52)
    from rove.control.domain.goodput_svg import render as render_svg

    picture = render_svg(gp.report(gp.of_events(one_failure()), now=500.0))
    assert "1970-01-01T05:30:00+05:30 to 1970-01-01T05:31:41+05:30</text>" in picture
    assert "worker_exited on " in picture and " at 1970-01-01T05:30:52+05:30: " in picture, picture


def many_nodes(nodes: int, seconds: float) -> list[ev.Event]:
    """A job of `nodes` nodes each reporting every 5 s (a few ms apart) for `seconds`,
    at 2 steps a second: one worker killed halfway, the second round restoring a step
    from 100 s before the failure."""
    half = seconds / 2
    out: list[ev.Event] = [at(f.configured(1), 0.0), rnd(1, 1.0)]
    out += [at(f.started(f"n{i}", 1, (i,)), 2.0) for i in range(nodes)]
    for t in range(5, int(half), 5):
        out += [f.progressed(f"n{i}", 1, 2 * t, t + i / 1000, first=(1, 3.0)) for i in range(nodes)]
    restored = int(2 * (half - 100))
    out += [f.exited("n0", 1, ts=half + 1), rnd(2, half + 3, restore=restored)]
    out += [at(f.started(f"n{i}", 2, (i,)), half + 4) for i in range(nodes)]
    for t in range(int(half) + 10, int(seconds), 5):
        step = restored + 2 * (t - int(half) - 5)
        out += [
            f.progressed(f"n{i}", 2, step, t + i / 1000, first=(restored + 1, half + 6))
            for i in range(nodes)
        ]
    return [*out, at(f.ended(1, ev.JobPhase.FINISHED), seconds + 1)]


def test_a_round_keeps_points_apart_not_one_per_report_and_says_the_same() -> None:
    """200 nodes reporting for an hour: the rounds keep about one point per report
    burst, not one per node's report, and every bucket comes out as with every point."""
    events = many_nodes(200, 3600)
    every = gp.Ledger(point_gap_s=0.0, max_points=0)
    for e in events:
        every.add(e)
    thin = gp.of_events(events)
    assert sum(len(r.points) for r in every.rounds.values()) > 100_000
    assert sum(len(r.points) for r in thin.rounds.values()) < 2 * 3600 / 5 + 10
    full, kept = gp.report(every, 9999.0), gp.report(thin, 9999.0)
    for bucket in gp.Bucket:
        assert kept.seconds[bucket] == pytest.approx(full.seconds[bucket], abs=0.05)
    # round 1's last report (step 3590 at 1795 s) is 95 s past the step restored (3400)
    assert kept.seconds[B.WASTED] == pytest.approx(95.2, abs=0.5)
    # the newest report is a point: the round's last step is placed at its own time
    assert thin.rounds[2].points[-1] == every.rounds[2].points[-1]


def test_a_long_round_keeps_at_most_max_points_its_first_and_newest_among_them() -> None:
    r = gp.Ledger(max_points=64)
    r.add(at(f.configured(1), 0.0))
    r.add(rnd(1, 1.0))
    for t in range(2, 2000):
        r.add(f.progressed("n1", 1, t, float(t), first=(1, 2.0)))
    points = r.rounds[1].points
    assert len(points) <= 64
    assert points[0] == (1, 2.0) and points[-1] == (1999, 1999.0)
    assert r.rounds[1].gap_s >= 16  # doubled each time the bound was passed
    assert [p[1] for p in points] == sorted(p[1] for p in points)
    # interpolating between the points left still places a step at its time
    assert r.rounds[1].time_of(1000) == pytest.approx(1000.0)


def test_a_report_arriving_late_is_kept_only_if_it_says_something_new() -> None:
    r = gp.of_events([at(f.configured(1), 0.0), rnd(1, 1.0)])
    for e in (
        f.progressed("n1", 1, 10, 10.0, first=(1, 2.0)),
        f.progressed("n1", 1, 20, 20.0, first=(1, 2.0)),
        f.progressed("n2", 1, 19, 19.5, first=(1, 2.0)),  # late, within the gap: nothing new
        f.progressed("n2", 1, 15, 15.0, first=(1, 2.0)),  # late, 5 s before: a point of its own
    ):
        r.add(e)
    assert r.rounds[1].points == [(1, 2.0), (10, 10.0), (20, 20.0), (15, 15.0)]
    assert r.rounds[1].time_of(15) == 15.0


def test_only_the_asks_for_the_first_round_are_kept_and_the_report_is_the_same() -> None:
    """Every node asks for every round; only the first round's asks end the job's
    start-up, so later ones are not kept (they grew with nodes times rounds)."""
    events = one_failure()
    later = [f.rdzv(f"n{i}", ts=53.0) for i in range(1000)]
    cut = next(i for i, e in enumerate(events) if isinstance(e, ev.RoundCompleted) and e.round == 2)
    with_asks = gp.of_events([*events[:cut], *later, *events[cut:]])
    assert with_asks.rdzv_asks == [2.0]
    want = gp.report(gp.of_events(events), now=500.0)
    assert gp.report(with_asks, now=500.0).seconds == want.seconds


def many_rounds(nodes: int, rounds: int, span: float = 100.0) -> list[ev.Event]:
    """`nodes` nodes at 2 steps a second through `rounds` rounds of `span` s, each ended
    by a killed worker and the next restoring the step of 20 s before it; the nodes
    send their last report of a round after the next round formed (as agents do when
    their workers are stopped), and in an order that makes a different node the slowest
    each round."""
    out: list[ev.Event] = [at(f.configured(1), 0.0)]
    restored: int | None = None
    last: list[ev.Event] = []
    for r in range(1, rounds + 1):
        start = (r - 1) * span + 1.0
        out += [rnd(r, start, restore=restored), *last]
        out += [at(f.started(f"n{i}", r, (i,)), start + 1) for i in range(nodes)]
        first = ((restored or 0) + 1, start + 2)
        for t in range(5, int(span) - 5, 5):
            out += [
                f.progressed(f"n{i}", r, first[0] + 2 * t - (i + r) % nodes, start + t, first=first)
                for i in range(nodes)
            ]
        top = first[0] + 2 * (int(span) - 5)
        out.append(f.exited("n0", r, ts=start + span - 3))
        last = [
            f.progressed(f"n{i}", r, top - (i + r) % nodes, start + span - 4, first=first)
            for i in range(nodes)
        ]
        restored = top - nodes - 40
    return [*out, *last, at(f.ended(1, ev.JobPhase.FINISHED), rounds * span + 2)]


def test_a_job_of_many_rounds_keeps_each_nodes_report_only_in_its_newest_rounds() -> None:
    """Rounds older than the newest two are closed: their nodes' reports folded into one,
    their points thinned; the report says the same as with every round open (the code
    before), and the ledger a snapshot carries is a fraction of its size."""
    events = many_rounds(nodes=40, rounds=30)
    before = gp.Ledger(open_rounds=0)
    for e in events:
        before.add(e)
    now = gp.of_events(events)
    assert all(len(r.latest) == 40 for r in before.rounds.values())
    assert [n for n, r in now.rounds.items() if r.latest] == [29, 30]
    assert all(r.closed and r.folded is not None for n, r in now.rounds.items() if n < 29)
    # the last reports, sent after the next round formed, still counted per node: the
    # round's step is its slowest node's last one (190 past its first step, less 39)
    for n in (1, 15, 28):
        p = now.rounds[n].progress()
        assert p == before.rounds[n].progress()
        assert p is not None and p.step == (now.rounds[n].restore_step or 0) + 1 + 190 - 39
    want, got = gp.report(before, 9e9), gp.report(now, 9e9)
    for bucket in gp.Bucket:
        assert got.seconds[bucket] == pytest.approx(want.seconds[bucket], abs=1e-6)
    assert got.goodput == pytest.approx(want.goodput)
    assert len(gp.encode(now)) < len(gp.encode(before)) / 3


def test_a_closed_round_keeps_few_points_and_still_places_its_steps_in_time() -> None:
    r = gp.Ledger(max_points=0, closed_points=16)
    r.add(at(f.configured(1), 0.0))
    r.add(rnd(1, 1.0))
    for t in range(2, 2000):
        r.add(f.progressed("n1", 1, t, float(t), first=(1, 2.0)))
    r.add(rnd(2, 2001.0, restore=1500))
    assert len(r.rounds[1].points) > 1000  # still open: the round before the newest
    r.add(rnd(3, 2002.0, restore=1500))
    points = r.rounds[1].points
    assert len(points) <= 16 and points[-1] == (1999, 1999.0)
    assert r.rounds[1].time_of(1500) == pytest.approx(1500.0)


def test_a_report_reaching_a_closed_round_is_folded_in_not_kept_per_node() -> None:
    """A node cut off from the bus sends its facts rounds later: the closed round's
    figures take what it says (its durations, its time) without keeping it apart."""
    events = many_rounds(nodes=3, rounds=4)
    ledger = gp.of_events(events[:-1])
    closed = ledger.rounds[1]
    assert closed.closed and closed.latest == {} and closed.folded is not None
    was = closed.progress()
    ledger.add(f.progressed("n9", 1, was.step + 500, was.at + 1, first=(1, 3.0), ckpt_s=7.0))
    assert closed.latest == {}
    now = closed.progress()
    assert (now.step, now.at, now.ckpt_block_s) == (was.step, was.at + 1, 7.0)
    # a node that was slower than the rest lowers the round's step
    ledger.add(f.progressed("n9", 1, was.step - 50, was.at + 2, first=(1, 3.0)))
    assert closed.progress().step == was.step - 50


def test_a_ledger_written_before_rounds_closed_is_read_and_closes_them_from_then_on() -> None:
    """A master's snapshot from before: no `closed`, `folded`, `open_rounds` or
    `closed_points`; its older rounds all close as the next round forms."""
    events = many_rounds(nodes=5, rounds=6)
    old = gp.Ledger(open_rounds=0)
    for e in events[: len(events) // 2]:
        old.add(e)
    raw = msgspec.msgpack.decode(gp.encode(old))
    del raw["open_rounds"], raw["closed_points"]
    for r in raw["rounds"].values():
        del r["folded"]
    read = gp.decode(msgspec.msgpack.encode(raw))
    assert read.open_rounds == gp.OPEN_ROUNDS and all(
        r.folded is None for r in read.rounds.values()
    )
    for e in events[len(events) // 2 :]:
        read.add(e)
    whole = gp.Ledger(open_rounds=0)
    for e in events:
        whole.add(e)
    assert gp.report(read, 9e9).seconds == pytest.approx(gp.report(whole, 9e9).seconds)
