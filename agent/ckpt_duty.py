"""The agent's checkpoint duty: report steps in memory, persist them, commit them.

Workers save flash checkpoints to shared memory the agent owns (`Saver` reads
the slot headers: no IPC with the workers). Every tick the duty reports a new
step that every local rank holds (`ckpt_in_memory`) and, with a checkpoint
directory, persists every `persist_every`-th one off the event loop
(`ckpt_persisted`, or `ckpt_failed` with the reason: training goes on). Before
a failure or a signal is acted on (`breakpoint`) it reports the newest step
and, with `--save-at-breakpoint`, persists it first. The node of group rank 0
records a commit when the master decides `ckpt_committed`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import time
from collections.abc import Callable

import nats.errors
import structlog

from rove.agent.ckpt_mark import LocationMark
from rove.agent.facts import NodeFacts
from rove.agent.fence import StorageFence
from rove.agent.saver import Saver
from rove.checkpoint.engine import CheckpointError
from rove.checkpoint.storage import SlotOverwritten
from rove.control.bus import records
from rove.control.bus.client import Bus
from rove.control.catalogue import events as ev
from rove.control.catalogue import subjects
from rove.control.errors import RoveError
from rove.control.process import metrics

log = structlog.get_logger("rove.agent")

#: How long the agent reads its storage's committed step as it starts before it joins
#: without it (an object store away: its persists will say so in turn).
FOUND_READ_S = 15.0

#: Steps overwritten in a row while they were persisted before it is said on the console:
#: one now and then is the workers saving faster than storage takes it (a newer step is
#: persisted next); many in a row mean nothing reaches storage.
OVERWRITTEN_SAY = 5
#: A persist failing the same way again is said on the console at most this often.
FAILING_SAY_S = 300.0


def run_name(configured: ev.JobConfigured) -> str:
    """Which run of the job `configured` started: it names the run's shared memory."""
    return hashlib.blake2b(f"{configured.id}:{configured.ts}".encode(), digest_size=4).hexdigest()


async def current_run(bus: Bus, job: str) -> str | None:
    """The run of `job` going on now, from its stored events (None: none is, it ended)."""
    configured = subjects.master(job, "job_configured")
    seq, data = await bus.last_message(subjects.EVENTS_STREAM, configured)
    if not seq:
        return None
    ended, _ = await bus.last_message(subjects.EVENTS_STREAM, subjects.master(job, "job_ended"))
    item = records.read(subjects.EVENTS_STREAM, seq, configured, data)
    if ended > seq or not isinstance(item, records.Recorded):
        return None
    event = item.event
    return run_name(event) if isinstance(event, ev.JobConfigured) else None


async def run_under_way(bus: Bus, job: str) -> bool:
    """Whether a run of `job` is going on and has formed a round (a node joining it finds
    the run's own progress committed; a run only configured, as a standalone job's
    master does as it starts, has made none)."""
    configured, _ = await bus.last_message(
        subjects.EVENTS_STREAM, subjects.master(job, "job_configured")
    )
    ended, _ = await bus.last_message(subjects.EVENTS_STREAM, subjects.master(job, "job_ended"))
    rounds, _ = await bus.last_message(
        subjects.EVENTS_STREAM, subjects.master(job, "round_completed")
    )
    return bool(configured) and ended < configured < rounds


def persist_stride(advanced: int, every: int, most: int = 1 << 12) -> int:
    """How many of the `every`-step points apart a node persists while its storage is
    slower than the saves (it persists from copies): the smallest power of two whose
    spacing is at least 1.5 times the steps its last persist lasted (`advanced`).

    Nodes measure their own persists, so they may choose different strides; powers of
    two nest (every 16th point is an 8th point too), so a node persisting every 8th
    point also persists the 16th ones of a slower node, and those steps are on every
    rank and can be committed. Without it each node persisted the newest step due when
    it was free again, and two nodes uploading to S3 never persisted the same step."""
    stride = 1
    while stride < most and 2 * stride * every < 3 * advanced:
        stride *= 2
    return stride


class CheckpointDuty:
    def __init__(
        self,
        facts: NodeFacts,
        checkpoint_dir: str | None,
        *,
        keep: int = 3,
        persist_every: int = 1,
        save_at_breakpoint: bool = False,
    ) -> None:
        self.facts = facts
        self.saver = Saver(facts.job, checkpoint_dir, keep=keep)
        self.persist_every = persist_every
        self.save_at_breakpoint = save_at_breakpoint
        self.log = log.bind(job=facts.job, node=facts.node)
        self._persisting: asyncio.Task[None] | None = None
        self._world_size = 0
        self._group_rank: int | None = None
        self._round = 0
        self._kept = -1  # the step the current round's lineage started from
        self._overwritten = 0  # persists in a row whose step a newer save overwrote
        #: the newest step a persist was started for, whatever came of it: the cadence
        #: counts from it, so that a node whose persist failed (a full disk) persists the
        #: same steps as its peers next, and those steps can be committed
        self._attempted = -1
        self._failed = 0  # persists in a row that failed (not overwritten)
        self._failure_said = ("", 0.0)  # the last failure said on the console: its shape, when
        self._base = -1  # steps persisted are this plus multiples of persist_every (0: -1)
        #: persist every `_stride`-th of those (`persist_stride`: storage slower than saves)
        self._stride = 1
        #: told each new step every local rank holds (the peer replicas' sender)
        self.on_in_memory: Callable[[int], None] = lambda _step: None
        #: persisting only while the master cannot have gone on without this node
        self.fence = StorageFence()
        self._fenced = False  # the fence was found closed (said once, and when it opens)
        self._found: tuple[int, str] | None = None  # the committed step found, and where
        self._said_spill = False  # the ranks' slots spilled to disk: said once
        #: the location marked as this job's while it runs (`rove.checkpoint.writers`)
        self.mark = (
            None
            if self.saver.storage is None
            else LocationMark(self.saver.storage, facts.job, facts.node, self.log)
        )

    async def announce_found(self, bus: Bus) -> None:
        """Before the node first joins: say the step committed in this node's storage
        (`ckpt_found`), so that the job goes on from it rather than starting afresh
        (which would drop it as an abandoned lineage). Said as what it is: an earlier
        run's, the run going on's (it was said to be an earlier run's to a node that
        joined a job under way), or another job's (a warning: two jobs given one folder
        remove each other's steps)."""
        storage = self.saver.storage
        if storage is None:
            return
        self.keep_mark()
        try:
            found = await asyncio.wait_for(asyncio.to_thread(storage.tracker), FOUND_READ_S)
        except (TimeoutError, CheckpointError) as exc:
            reason = str(exc) or f"no answer in {FOUND_READ_S:.0f} s"
            self.log.warning(
                f"could not read the committed step in {storage.location}: {reason}; "
                "the job starts without it"
            )
            return
        if found is None:
            return
        step = found.step
        if found.job is not None and found.job != self.facts.job:
            # (fine-tuning from another job's checkpoint; or two jobs given one folder)
            self.log.warning(
                f"found step {step} committed in {storage.location} by another job, "
                f"{found.job}: this job goes on from it, and its own steps take the place "
                f"of {found.job}'s there (give it a --checkpoint-dir of its own to keep them)"
            )
        else:
            self.log.info(
                f"found step {step} committed in {storage.location} {await self._by(bus)}",
                say=True,
            )
        self._found = (step, storage.location)
        self.found_again()

    async def _by(self, bus: Bus) -> str:
        """Who committed the step this node found, of this job: the run going on (this
        node joins it, or runs again after its launcher died), or an earlier run."""
        try:
            under_way = await asyncio.wait_for(run_under_way(bus, self.facts.job), FOUND_READ_S)
        except (TimeoutError, RoveError, nats.errors.Error):
            under_way = False  # (said as before: the step is taken all the same)
        if under_way:
            return "by the run going on, which this node joins"
        return "by an earlier run of the job: it goes on from there"

    def found_again(self) -> None:
        """Say the step found committed (if any) again: the job's next run started as
        this node joined, and the master left what it heard before behind with the run
        that ended (without this a job stopped and run again under its name started
        afresh beside its committed step)."""
        if self._found is not None:
            step, location = self._found
            self.facts.emit(ev.CkptFound(**self.facts.envelope(), step=step, location=location))

    async def announce_memory(self, bus: Bus) -> None:
        """Before the node joins: the steps an earlier agent of this node left in the
        shared memory of the run going on (it was killed; this one took its place), each
        said as `ckpt_in_memory` with `recovered`, newest first. The master takes the
        newest it knew the node held, and the round restores it from memory rather than
        from storage, or afresh."""
        if not self.saver.any_left_in_memory():
            return  # (the common case: nothing to ask the bus about)
        try:
            run = await asyncio.wait_for(current_run(bus, self.facts.job), FOUND_READ_S)
        except (TimeoutError, RoveError, nats.errors.Error) as exc:
            self.log.info("could not tell which run goes on", error=str(exc) or type(exc).__name__)
            return
        if run is None:
            return
        steps, ranks = await asyncio.to_thread(self.saver.left_in_memory, run)
        if not steps:
            return
        self.log.info(
            f"found step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} of ranks "
            f"{list(ranks)} in this machine's shared memory, saved in the run going on (by "
            "an earlier agent of this node, or a node beside it): offered to the next "
            "round's restore",
            say=True,
        )
        for step in steps:
            self.facts.emit(
                ev.CkptInMemory(**self.facts.envelope(), step=step, ranks=ranks, recovered=True)
            )

    async def new_round(
        self,
        round_: int,
        restore_step: int | None,
        ranks: tuple[int, ...],
        world_size: int,
        group_rank: int,
        run: str,
    ) -> None:
        """Before the workers of a new round start: this node runs `ranks` of `world_size`
        in round `round_` of `run` of the job, which goes on from `restore_step`.

        The round starts a new lineage at `restore_step`: every newer step of the old
        one (in this node's memory, and on storage) is dropped first, so that no rank
        ever loads it once the new lineage saves steps of the same numbers. A persist
        of the old lineage still running is waited for, so none lands afterwards.
        """
        if self._persisting is not None:
            await asyncio.gather(self._persisting, return_exceptions=True)
        self.saver.ranks(ranks, run)
        dropped, removed = await asyncio.to_thread(self.saver.cut, restore_step)
        if dropped or removed:
            self.log.info(
                f"round {round_} goes on from step {restore_step}: dropped newer steps of "
                "the abandoned lineage",
                memory=dropped,
                storage=removed,
            )
        self._round = round_
        self._kept = -1 if restore_step is None else restore_step
        self._attempted = self._kept  # every node counts from the step the round restored
        self._base = self._kept
        self._world_size = world_size
        self._group_rank = group_rank

    def tick(self) -> None:
        """Report a new step in memory; start persisting one when one is due: the
        newest held of the steps every node persists (`Saver.aligned_step`: the round's
        restored step plus multiples of `persist_every`), so that all nodes persist the
        same steps whenever each looks."""
        self.saver.touch()
        self._report_in_memory()
        busy = self._persisting is not None and not self._persisting.done()
        if busy or self.saver.storage is None or not self._may_persist():
            return
        since = max(0, self.saver.persisted_step, self._attempted)
        every = self.persist_every * self._stride
        step = self.saver.aligned_step(every, max(0, self._base), since)
        if step is not None:
            self._persisting = asyncio.create_task(self._persist(step))

    async def breakpoint(self) -> None:
        """Before a failure or a signal is acted on: report, and persist if asked."""
        self._report_in_memory()
        if self._persisting is not None:
            await asyncio.gather(self._persisting, return_exceptions=True)
        step = self.saver.common_step()
        if (
            self.save_at_breakpoint
            and self.saver.storage is not None
            and step is not None
            and step > self.saver.persisted_step
            and self._may_persist()
        ):
            self.log.info(f"saving at breakpoint: persisting step {step} from memory")
            await self._persist(step)

    async def final(self) -> int | None:
        """The round's workers all finished: make their newest step durable before the
        node says so. Reports the newest step every local rank holds and, with a
        checkpoint directory, persists it whatever `persist_every` says (a persist still
        running is waited for first). The master commits it before it ends the job, and
        the job's shared memory is freed only once the job ended. Returns the step, or
        None when the workers saved nothing."""
        self._report_in_memory()
        if self._persisting is not None:
            await asyncio.gather(self._persisting, return_exceptions=True)
        step = self.saver.common_step()
        if (
            step is not None
            and self.saver.storage is not None
            and step > self.saver.persisted_step
            and self._may_persist()
        ):
            self.log.info(f"the workers finished: persisting their last step {step}")
            await self._persist(step)
        return step

    async def commit(self, step: int, round_: int) -> None:
        """The master committed `step` (of round `round_`'s lineage): the node of group
        rank 0 records it on storage, unless a newer round abandoned that step."""
        if self._group_rank != 0 or self.saver.storage is None:
            return
        if round_ < self._round and step > self._kept:
            self.log.info(f"not recording the commit of step {step}: its lineage was abandoned")
            return
        if round_ > self._round:
            # a round this node is not in (it was left out, cut off): that round's group
            # rank 0 records it. (The nemesis saw a node back from a partition record
            # commits of the round that went on without it, on the storage both share:
            # an older one after a newer would move the committed step back.)
            self.log.debug(f"not recording the commit of step {step}: round {round_} is not mine")
            return
        try:
            await asyncio.to_thread(self.saver.commit, step)
            self.log.debug(f"checkpoint step {step} committed")
        except CheckpointError as exc:
            self.log.warning(f"could not record the commit of step {step}: {exc}")

    def behind_fence(self) -> bool:
        """The workers finished while the fence is closed: their last step waits (said)."""
        if self.saver.storage is None or self.fence.closed() is None:
            return False
        self._may_persist()  # (says why, once)
        self.log.warning(
            "the workers finished while this node is out of touch: their last step is "
            "persisted, and the node says it is done, once it is back in touch"
        )
        return True

    def _may_persist(self) -> bool:
        """The fence is open (`rove.agent.fence`); said when it closes and opens again."""
        why = self.fence.closed()
        if why is not None:
            if not self._fenced:
                self.log.warning(
                    f"not persisting checkpoints: {why}; they stay in memory until it is "
                    "back in touch (a round without it may be saving the same steps)"
                )
                self._fenced = True
            return False
        if self._fenced:
            self.log.warning("back in touch with the master: persisting checkpoints again")
            self._fenced = False
        return True

    def keep_mark(self) -> None:
        """Refresh the location's mark as this job's when it is due."""
        if self.mark is not None:
            self.mark.tick()

    async def unmark(self) -> None:
        """The job ended here (or its node was stopped): the location is no longer marked."""
        if self.mark is not None:
            await self.mark.stop()

    def job_finished(self) -> None:
        """The job is done: free its shared memory."""
        self.saver.unlink()

    def _report_in_memory(self) -> int | None:
        step = self.saver.new_in_memory()
        if step is not None and not self._said_spill and (spilled := self.saver.spilled()):
            self._said_spill = True
            self.log.warning(spilled)
        if step is not None:
            self.facts.emit(
                ev.CkptInMemory(
                    **self.facts.envelope(),
                    step=step,
                    ranks=tuple(sorted(self.saver.engines)),
                    round=self._round,
                    spilled=self.saver.spilled_ranks(),
                )
            )
            self.on_in_memory(step)
        return step

    def _say_failed(self, step: int, exc: Exception) -> None:
        """A failed persist, on the console once per kind of failure, then again every
        `FAILING_SAY_S` while it lasts (a full disk fails every persist); always in the
        job's log, and as a `ckpt_failed` event."""
        self._failed += 1
        said = f"could not persist checkpoint step {step}: {exc}"
        shape, now = re.sub(r"\d+", "#", str(exc)), time.monotonic()
        last, at = self._failure_said
        if shape != last:
            self.log.warning(said)
        elif now - at >= FAILING_SAY_S:
            self.log.warning(f"still cannot persist checkpoints ({self._failed} in a row): {said}")
        else:
            self.log.info(said)
            return
        self._failure_said = (shape, now)

    def _failed_event(self, step: int, error: str) -> None:
        self.facts.emit(
            ev.CkptFailed(**self.facts.envelope(), step=step, error=error[: ev.REASON_CHARS])
        )

    async def _persist(self, step: int) -> None:
        round_ = self._round  # the lineage this step belongs to
        self._attempted = max(self._attempted, step)
        began = time.monotonic()
        copying = self.saver.copying
        try:
            done = await asyncio.to_thread(self.saver.persist, step)
        except CheckpointError as exc:
            superseded = isinstance(exc, SlotOverwritten)
            self._overwritten = self._overwritten + 1 if superseded else 0
            if not superseded:
                self._say_failed(step, exc)
            elif self.saver.copying and not copying:  # this overwrite switched it
                self.log.warning(
                    f"checkpoint step {step} was overwritten by a newer save while it was "
                    "persisted: storage is slower than the workers save; from now on each "
                    "step is copied out of shared memory first (one copy of this node's "
                    "state in the agent's memory) and persisted from the copy, at most "
                    "every so many steps that a persist fits between two"
                )
            elif self._overwritten == OVERWRITTEN_SAY:
                self.log.warning(
                    f"the last {OVERWRITTEN_SAY} checkpoint steps were overwritten by newer "
                    "saves while they were persisted: storage is slower than the workers "
                    "save; save less often (or to faster storage) for steps to reach it"
                )
            else:
                self.log.info(f"checkpoint step {step} not persisted: {exc}; a newer one will be")
            self._failed_event(step, str(exc))
            return
        except Exception as exc:  # not storage failing: a bug, said with its traceback
            # (this runs as a task of its own: raised, it would end unseen, and every
            # later persist with it); the next due step is tried, as after any failure
            self.log.error(f"internal error persisting checkpoint step {step}", exc_info=exc)
            self._failed += 1
            self._failed_event(step, f"internal error: {type(exc).__name__}: {exc}")
            return
        self._overwritten = 0
        if self._failed:
            self.log.warning(
                f"checkpoints persist again: step {step} reached storage, after "
                f"{self._failed} failed in a row"
            )
            self._failed, self._failure_said = 0, ("", 0.0)
        if self.saver.copying:
            lasted = self.saver.reported_step - step  # steps saved while it was persisted
            stride = persist_stride(lasted, self.persist_every)
            if stride != self._stride:
                self.log.info(
                    f"persisting every {stride * self.persist_every}th step: a persist lasts "
                    f"{lasted} steps here"
                )
                self._stride = stride
        metrics.CKPT_PERSIST.labels(self.facts.job).observe(time.monotonic() - began)
        self.facts.emit(
            ev.CkptPersisted(
                **self.facts.envelope(),
                step=step,
                ranks=done.ranks,
                world_size=self._world_size or len(done.ranks),
                location=done.location,
                round=round_,
            )
        )
