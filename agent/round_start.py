"""What a node says when its round's workers start: the console line ("round 2:
started 2 workers as ranks 0-1 of 4 (restart 1/3 after ...); they restore step 150
from memory"), the TensorFlow tasks it hosts, and the `workers_started` fact."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rove.agent.facts import NodeFacts
from rove.agent.resumption import restoring
from rove.control.catalogue import events as ev
from rove.control.domain import tf_cluster, words


def announce(
    log: Any,
    facts: NodeFacts,
    r: ev.RoundCompleted,
    group_rank: int,
    member: ev.RoundMember,
    pids: Mapping[int, int],
) -> None:
    """Say that round `r`'s workers started here (`pids`: by local rank), as member
    `member` at `group_rank`."""
    ranks = tuple(member.first_rank + lr for lr in sorted(pids))
    if r.tasks:
        mine = [t for t in r.tasks if t.node == member.node]
        log.info(
            f"round {r.round}: TensorFlow tasks here: {tf_cluster.describe(mine)}",
            round=r.round,
            cluster=tf_cluster.cluster(r.tasks),
        )
    log.info(
        f"round {r.round}: started {words.counted(len(pids), 'worker')} as "
        f"{words.ranks(ranks)} of {r.world_size} ({r.reason}){restoring(r)}",
        say=True,
        round=r.round,
        group_rank=group_rank,
        restart_count=r.restart_count,
        master=f"{r.master_addr}:{r.master_port}",
        reason=r.reason,
    )
    facts.emit(
        ev.WorkersStarted(
            **facts.envelope(),
            round=r.round,
            ranks=ranks,
            pids=tuple(pids[lr] for lr in sorted(pids)),
        )
    )
