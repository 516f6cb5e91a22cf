"""What a node cut off from the job writes to the storage it shares with the others:
the storage fence (`rove.agent.fence`: a node that may have been given up on persists
nothing until it is back in touch and has acted on what was decided), and the commits
it records."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path

from structlog.testing import capture_logs

from rove.agent.fence import StorageFence
from tests.test_saver import Steps, _duty


def test_the_fence_closes_half_a_node_timeout_after_the_last_heartbeat_that_reached_the_bus() -> (
    None
):
    now = [0.0]
    fence = StorageFence(node_timeout_s=30, clock=lambda: now[0])
    assert fence.closed() is None, "open as the agent starts: it joins a new round"
    now[0] = 14.0
    assert fence.closed() is None
    fence.heard()
    now[0] = 28.0
    assert fence.closed() is None, "14 s since the last heartbeat: within the lease"
    now[0] = 29.5
    why = fence.closed()
    assert why is not None and "has not reached the bus for 16s" in why
    fence.set_node_timeout(60)  # the job's own timeout, from its job_configured
    assert fence.closed() is None


def test_a_first_heartbeat_long_after_the_agent_was_made_opens_the_fence() -> None:
    now = [0.0]
    fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    now[0] = 30.0  # (an embedded server slow to start, a bus without quorum yet)
    fence.heard()
    assert fence.closed() is None and not fence.needs_catch_up


def test_back_in_touch_it_stays_closed_until_it_acted_on_the_newest_decision() -> None:
    now = [0.0]
    fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    fence.heard()
    fence.handled(40)
    now[0] = 20.0  # cut off for 20 s: the master may have gone on without it
    assert not fence.needs_catch_up, "nothing to ask while it is not heard"
    fence.heard()
    why = fence.closed()
    assert why is not None and "catching up" in why, "heard again, not yet caught up"
    assert fence.needs_catch_up
    fence.catch_up(57)  # decisions 41..57 were made while it was away
    assert not fence.needs_catch_up
    fence.handled(50)
    assert fence.closed() is not None, "a new round may be among 51..57"
    fence.handled(57)
    assert fence.closed() is None
    now[0] = 21.0
    fence.heard()
    assert fence.closed() is None, "a heartbeat within the lease opens nothing anew"


def test_a_fence_already_caught_up_opens_at_once() -> None:
    now = [0.0]
    fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    fence.heard()
    fence.handled(9)
    now[0] = 6.0
    fence.heard()
    fence.catch_up(9)  # nothing was decided while it was away
    assert fence.closed() is None


async def test_a_closed_fence_stops_persisting_memory_saves_go_on_and_persisting_resumes() -> None:
    """A node cut off past half the node timeout persists nothing (its steps would be an
    abandoned lineage's once the master goes on without it), says so once, and when it is
    back in touch and caught up persists the newest due step again."""
    now = [0.0]
    duty = _duty("na", Steps(set()))
    duty.fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    fence = duty.fence
    fence.heard()

    async def steps(first: int, last: int) -> None:
        for step in range(first, last + 1):
            duty.saver.newest = step
            duty.tick()
            if duty._persisting is not None:
                await duty._persisting

    with capture_logs() as logs:
        await steps(1, 10)
        now[0] = 6.0  # cut off since 0
        await steps(11, 20)
        fence.heard()  # back
        await steps(21, 24)
        fence.catch_up(3)
        fence.handled(3)
        await steps(25, 30)
    assert duty.saver.persisted == [5, 10, 25, 30]
    in_memory = [e.step for e in duty.facts.outbox.events if hasattr(e, "recovered")]
    assert in_memory == list(range(1, 31)), "every step is still reported in memory"
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 2, warned
    assert warned[0].startswith("not persisting checkpoints: this node has not reached the bus")
    assert warned[1] == "back in touch with the master: persisting checkpoints again"


async def test_the_workers_last_step_is_not_persisted_behind_a_closed_fence() -> None:
    now = [0.0]
    duty = _duty("na", Steps(set()))
    duty.fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    duty.saver.newest = 7
    now[0] = 6.0
    assert await duty.final() == 7
    assert duty.saver.persisted == []
    now[0] = 7.0
    duty.fence.heard()
    duty.fence.catch_up(0)
    assert await duty.final() == 7
    assert duty.saver.persisted == [7], "persisted once the fence is open"


async def test_a_commit_is_recorded_only_by_group_rank_0_of_the_round_it_belongs_to() -> None:
    """nb was group rank 0 of round 4 and was cut off; the job went on in round 5 without
    it (na is group rank 0 there). Back, nb hears round 5's commits: it records none of
    them (na does), or the committed step on the storage both share could move back."""
    recorded: list[int] = []
    duty = _duty("nb", Steps(set()))
    duty.saver.commit = recorded.append
    duty._group_rank, duty._round, duty._kept = 0, 4, 30
    await duty.commit(35, 4)
    await duty.commit(56, 5)  # round 5's, which nb is not in
    await duty.commit(61, 5)
    await duty.commit(45, 3)  # of the lineage round 4 abandoned (it went on from 30)
    assert recorded == [35]


async def test_a_decision_the_agent_cannot_read_counts_as_acted_on_in_its_turn(
    tmp_path: Path,
) -> None:
    """Back in touch, the node waits until it acted on the stream's newest decision. When
    that one is unreadable to it (garbage on the master's subject, a newer rove's kind),
    its turn in the actor still comes: the fence opens, after what was queued before it."""
    from rove.agent.agent import Agent
    from rove.agent.config import AgentConfig
    from rove.control.bus import records
    from rove.control.catalogue import events as ev
    from rove.control.catalogue import subjects
    from tests import factories

    cfg = AgentConfig(
        job="j", node="n", addr="127.0.0.1", nproc=1, params=ev.RdzvParams(),
        entrypoint="train.py", args=[], logs_specs=None, state_dir=tmp_path, max_restarts=0,
    )  # fmt: skip
    bus = types.SimpleNamespace(server=None, url="nats://127.0.0.1:4222")  # (only read)
    agent = Agent(bus, cfg)  # type: ignore[arg-type]  # (no bus is used here)
    now = [0.0]
    fence = agent.checkpoints.fence = StorageFence(node_timeout_s=10, clock=lambda: now[0])
    fence.heard()
    now[0] = 20.0
    fence.heard()
    fence.catch_up(7)
    subject = subjects.master("j", "master_elected")
    agent._on_decision(records.Recorded("S", 5, subject, factories.elected("m1", 2)))
    agent._on_rejected(records.Rejection("S", 7, subject, "not a rove event", b"\xc1"))
    actor = asyncio.create_task(agent._actor())
    try:
        while not agent._inbox.empty():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)
    finally:
        actor.cancel()
    assert agent.status.max_epoch == 2, "the decision before it was acted on"
    assert fence.closed() is None
