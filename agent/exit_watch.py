"""The agent's watch on workers that do not end: a job must never hang silently after
training.

Every duty tick the agent hands it what each worker has done (`rove.agent.stuck`);
a worker quiet for the timeout while it or another rank of its round on this node
has returned from its script, or quiet that long at all, is examined: its stacks
(`rove.agent.stacks`) are written under the agent's state dir and printed into the
job's log, and one line says where it is stuck. The verdict goes to the agent's
actor, which acts on it (`Verdict.done`: end the worker and count its work as done;
otherwise a hang, reported as a failure):

* its script had returned: it is stuck on its way out, its work is done;
* its stacks show torch's gloo teardown deadlock while a peer has returned: the
  round's training is over (its peers returned), torch hangs tearing down;
* quiet after a peer returned, anywhere else: a hang (the master restarts the round
  or fails the job);
* torch's teardown deadlock with no peer returned (a script that creates and destroys
  process groups while it trains): a hang too;
* quiet with no peer returned and no deadlock in its stacks: left alone (a collective
  waiting for a slow peer looks the same), looked at again a timeout later.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import structlog

from rove.agent import stacks, stuck
from rove.agent.runtime import WorkerRuntime

log = structlog.get_logger("rove.agent")


@dataclass(frozen=True)
class Verdict:
    """A worker found stuck, and what to do with it."""

    round: int
    local_rank: int
    quiet_s: float
    #: local ranks whose scripts have returned (this one included, if it has)
    returned: tuple[int, ...]
    where: str
    stacks_path: Path
    #: its work is done: end it and count the round as succeeded
    done: bool

    def describe(self, rank: int, first_rank: int) -> str:
        """One line on where rank `rank` is stuck and why that is not waiting."""
        where = self.where or "with no sign of life"
        if self.local_rank in self.returned:
            why = "after its script returned"
        elif self.returned:
            peers = ", ".join(str(first_rank + lr) for lr in self.returned)
            why = f"after rank{'s' if len(self.returned) > 1 else ''} {peers} returned"
        else:
            why = "while training"
        return (
            f"worker rank {rank} is stuck {where}: {self.quiet_s:.0f}s without CPU, I/O or "
            f"a step, {why}"
        )


class ExitWatch:
    def __init__(self, runtime: WorkerRuntime, stacks_dir: Path, timeout_s: float) -> None:
        self.runtime = runtime
        self.stacks_dir = stacks_dir
        self.timeout_s = timeout_s
        self.round = 0
        self._quiet = stuck.Quiet(timeout_s)

    def new_round(self, round_: int) -> None:
        self.round = round_
        self._quiet = stuck.Quiet(self.timeout_s)

    def tick(self, now: float) -> tuple[list[stuck.Suspect], bool]:
        """(workers to examine now, whether any worker's script has returned)."""
        activity = self.runtime.activity()
        returned = any(a.returned_at > 0 for a in activity.values())
        return self._quiet.observe(activity, now), returned

    async def examine(self, suspect: stuck.Suspect) -> Verdict | None:
        """The verdict on a suspect (its stacks taken off the event loop), or None
        when it is to be left alone."""
        rnd = self.round
        pid = self.runtime.pids().get(suspect.local_rank)
        if pid is None:
            return None
        text = await asyncio.to_thread(stacks.dump, pid)
        where = stacks.diagnose(text)
        deadlock = where == stacks.TEARDOWN_DEADLOCK
        if not (suspect.after_return or deadlock):
            return None
        self.stacks_dir.mkdir(parents=True, exist_ok=True)
        path = self.stacks_dir / f"round{rnd}-local{suspect.local_rank}-pid{pid}.txt"
        path.write_text(text + "\n")
        # in the job's log, not on the console (a line there says where it is stuck
        # and names the file)
        log.info(
            f"stacks of worker pid {pid} (local rank {suspect.local_rank}):\n{text}",
            round=rnd,
            path=str(path),
        )
        itself = suspect.local_rank in suspect.returned
        return Verdict(
            round=rnd,
            local_rank=suspect.local_rank,
            quiet_s=suspect.quiet_s,
            returned=suspect.returned,
            where=where,
            stacks_path=path,
            done=itself or (deadlock and suspect.after_return),
        )
