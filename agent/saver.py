"""The agent's checkpoint saver: report steps in memory, persist them, commit them.

It watches the shared-memory slots of this node's ranks (no IPC with the
workers: the slot headers say which steps are complete). When every local rank
holds a new step it reports `ckpt_in_memory`; with a checkpoint directory it
then persists that step off the training path (thread) and reports
`ckpt_persisted`, or `ckpt_failed` with the reason. The node of group rank 0
writes the commit tracker when the master decides `ckpt_committed`.
"""

from __future__ import annotations

import glob
import shutil
from dataclasses import dataclass

import structlog

from rove.checkpoint import shm, shm_owner
from rove.checkpoint.engine import (
    SPILL_HINT,
    CheckpointError,
    FlashEngine,
    default_dir,
    namespace,
    spill_dir,
)
from rove.checkpoint.shm import mib
from rove.checkpoint.storage import Manifest, SlotOverwritten, copy_out
from rove.checkpoint.stores import open_storage
from rove.control.domain import words

log = structlog.get_logger("rove.saver")


@dataclass(frozen=True)
class Persisted:
    step: int
    ranks: tuple[int, ...]
    location: str


class Saver:
    def __init__(self, job: str, checkpoint_dir: str | None, *, keep: int = 3) -> None:
        """`checkpoint_dir`: a directory or an object store's URL (None: memory only)."""
        self.job = job
        self.name = job
        self.storage = open_storage(checkpoint_dir) if checkpoint_dir else None
        self.keep = keep
        self.engines: dict[int, FlashEngine] = {}
        self.reported_step = -1
        self.persisted_step = -1
        #: persist from a copy of each rank (set once a step was overwritten while it was
        #: persisted straight from shared memory: storage is slower than the saves)
        self.copying = False
        self._copies: dict[int, bytearray] = {}  # a rank's copy buffer, reused
        #: this agent holds its run's slots (`rove.checkpoint.shm_owner`)
        self._holder: shm_owner.Holder | None = None

    def ranks(self, ranks: tuple[int, ...], run: str = "") -> None:
        """The global ranks this node runs now (a new round may change them), in `run`
        of the job (see `rove.checkpoint.engine.namespace`)."""
        name = namespace(self.job, run)
        if name != self.name or self._holder is None:
            if name != self.name:
                self.engines = {}
                self.name = name
                self.forget_other_runs()
            self._hold()
        self.engines = {r: self.engines.get(r) or FlashEngine(name, r) for r in ranks}
        self._copies = {r: b for r, b in self._copies.items() if r in self.engines}

    def forget_other_runs(self) -> None:
        """Remove the slots an earlier, killed run of a job by this name left behind."""
        for path in default_dir().glob(f"rove-ckpt-{self.job}.*"):
            mine = path.name.startswith(f"rove-ckpt-{self.name}-")
            if not mine and path.name != shm_owner.lock_path(path.parent, self.name).name:
                log.info("removing shared memory of an earlier run of the job", path=str(path))
                shm.remove(path)

    def _hold(self) -> None:
        """Hold this run's slots, and reclaim the slots of dead runs of other jobs
        (`rove.checkpoint.shm_owner`). Never in the job's way: a failure is said."""
        if self._holder is not None:
            self._holder.release()
            self._holder = None
        directory = default_dir()
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._holder = shm_owner.Holder(directory, self.name)
            grace = shm_owner.grace_s()
            for run, freed in shm_owner.reclaim(directory, grace, frozenset({self.name})):
                if not freed:  # a lock file alone: the run saved nothing
                    log.debug("removed what a killed run left in shared memory", run=run)
                    continue
                log.info(
                    f"freed {mib(freed)} of shared memory a killed run left "
                    f"in {directory} ({run}: no agent held it for {grace:.0f} s, "
                    "ROVE_SHM_GRACE_S)",
                    say=True,
                )
            spill = spill_dir()
            freed = 0
            if spill is not None and spill.is_dir():
                freed = shm_owner.reclaim_spilled(spill, directory, grace)
            if freed:
                log.info(
                    f"freed {mib(freed)} of disk in {spill}: checkpoint slots that "
                    "spilled there, whose runs' shared memory is gone",
                    say=True,
                )
        except OSError as exc:
            log.warning(
                f"cannot look after the shared memory in {directory}: {exc}; dead runs' "
                "slots there are not reclaimed"
            )

    def touch(self) -> None:
        """This run is alive (its slots are kept a grace period after it dies)."""
        if self._holder is not None:
            try:
                self._holder.touch()
            except OSError:
                pass  # the next touch tries again; the lock still says it is held

    def cut(self, step: int | None) -> tuple[list[int], list[int]]:
        """The job goes on from `step` (None: from scratch) on a new lineage: drop every
        newer step, in this node's shared memory (every rank's slots of this run, not
        only the ranks it runs now) and on storage. Blocking: run it in a thread.

        Returns (steps dropped from memory, steps removed from storage).
        """
        keep = -1 if step is None else step
        dropped: set[int] = set()
        ranks = {rank for rank, _ in shm_owner.slot_files(default_dir(), self.name)}
        for rank in ranks | set(self.engines):
            engine = self.engines.get(rank) or FlashEngine(self.name, rank)
            dropped.update(engine.discard_newer(keep))
        removed = self.storage.discard_newer(self._storage_floor(keep)) if self.storage else []
        self.reported_step = min(self.reported_step, keep)
        self.persisted_step = min(self.persisted_step, keep)
        return sorted(dropped), removed

    def _storage_floor(self, keep: int) -> int:
        """The newest step a cut to `keep` may leave on storage: `keep`, or the committed
        step when it is newer. The master never restores a step older than the one it
        committed, so such a cut comes from a stale round: one this node hears late
        (it was cut off while the job went on without it). The committed steps are the
        live lineage's, on storage every node shares; the nemesis saw a node back from a
        partition delete the job's committed step that way."""
        assert self.storage is not None
        try:
            committed = self.storage.committed()
        except CheckpointError:
            committed = None  # unreadable tracker: as on files, none
        if committed is None or committed <= keep:
            return keep
        log.warning(
            f"not removing checkpoint steps up to {committed} from storage: they are "
            f"committed, and this node's round goes on from {keep if keep >= 0 else 'scratch'} "
            "(a round decided while it was away)"
        )
        return committed

    def any_left_in_memory(self) -> bool:
        """Whether any run of this job left slots in this machine's shared memory."""
        return any(default_dir().glob(f"rove-ckpt-{glob.escape(self.job)}.*-r*"))

    def left_in_memory(self, run: str) -> tuple[list[int], tuple[int, ...]]:
        """(the steps every rank has, newest first; the ranks) of the slots of `run` of
        this job in shared memory, left by an earlier agent of this node. Blocking: run
        it in a thread."""
        name = namespace(self.job, run)
        ranks = sorted({rank for rank, _ in shm_owner.slot_files(default_dir(), name)})
        if not ranks:
            return [], ()
        engines = [FlashEngine(name, r) for r in ranks]
        steps = set.intersection(*({s.step for s in e.slots()} for e in engines))
        return sorted(steps, reverse=True), tuple(ranks)

    def common_steps(self) -> set[int]:
        """The steps every local rank holds complete in memory."""
        if not self.engines:
            return set()
        return set.intersection(*({s.step for s in e.slots()} for e in self.engines.values()))

    def common_step(self) -> int | None:
        """The newest step every local rank holds complete in memory."""
        return max(self.common_steps(), default=None)

    def aligned_step(self, every: int, base: int, after: int) -> int | None:
        """The newest step every local rank holds in memory that is `base` plus a
        multiple of `every` and newer than `after` (None: none is).

        Every node persists these, whatever step it happened to see first: a node that
        looked between steps 5 and 6 and another that looked after 6 both persist 5, so
        the master finds 5 on every rank and commits it. (Persisting the newest step
        each had seen, they persisted 5 and 6, 10 and 11, ...: on a busy machine no
        step was ever on every rank, and nothing was committed until the job's end.)"""
        due = [s for s in self.common_steps() if s > after and (s - base) % every == 0]
        return max(due, default=None)

    def spilled_ranks(self) -> tuple[int, ...]:
        """This node's ranks with a slot spilled to disk (`rove.checkpoint.shm`)."""
        return tuple(
            rank
            for rank, engine in sorted(self.engines.items())
            if any(seg.spilled for seg in engine.segments)
        )

    def spilled(self) -> str | None:
        """What to say when this node's ranks' slots spilled to disk (shared memory
        could not hold them, `rove.checkpoint.shm`); None when none did."""
        segments = [
            (rank, seg)
            for rank, engine in sorted(self.engines.items())
            for seg in engine.segments
            if seg.spilled
        ]
        if not segments:
            return None
        ranks = sorted({rank for rank, _ in segments})
        size = max(seg.size for _, seg in segments)
        directory = default_dir()
        try:
            room = f" ({mib(shutil.disk_usage(directory).total)})"
        except OSError:
            room = ""
        return (
            f"{words.ranks(ranks)}: {'its' if len(ranks) == 1 else 'their'} checkpoint "
            f"({mib(size)} a slot, two slots a rank) does not fit in the shared memory of "
            f"{directory}{room}; the slots spill to {segments[0][1].spill} on disk: {SPILL_HINT}"
        )

    def new_in_memory(self) -> int | None:
        step = self.common_step()
        if step is None or step <= self.reported_step:
            return None
        self.reported_step = step
        return step

    def persist(self, step: int) -> Persisted:
        """Persist `step` of every local rank (blocking: run it in a thread).

        Raises:
            StorageError / CheckpointError: with the reason; nothing is committed.
        """
        assert self.storage is not None
        if self.copying:
            # every rank copied out first (a fraction of a second per GiB), then written
            # at storage's pace: no save can tear a copy, so slow storage still gets steps
            copies = [
                self._copy(engine, step, rank) for rank, engine in sorted(self.engines.items())
            ]
            for manifest, raw in copies:
                self.storage.persist_copy(manifest, raw)
        else:
            try:
                for rank, engine in sorted(self.engines.items()):
                    self.storage.persist(engine, self._slot(engine, step, rank), rank)
            except SlotOverwritten:
                self.copying = True
                raise
        self.persisted_step = max(self.persisted_step, step)
        return Persisted(step, tuple(sorted(self.engines)), self.storage.location)

    @staticmethod
    def _slot(engine: FlashEngine, step: int, rank: int) -> int:
        slot = engine.slot_of(step)
        if slot is None:
            raise SlotOverwritten(
                f"step {step} of rank {rank} is no longer in memory (a newer save took its slot)"
            )
        return slot

    def _copy(self, engine: FlashEngine, step: int, rank: int) -> tuple[Manifest, bytearray]:
        manifest, raw = copy_out(
            engine, self._slot(engine, step, rank), rank, self._copies.get(rank)
        )
        self._copies[rank] = raw
        return manifest, raw

    def copy_bytes(self) -> int:
        """The memory the copies take now (0 until the saver persists from copies)."""
        return sum(len(b) for b in self._copies.values())

    def raw(self, step: int, rank: int) -> tuple[Manifest, bytearray] | None:
        """`rank`'s `step` as storage would write it (its metadata then data, and its
        manifest), from this node's memory, whatever ranks it runs now; None if no slot
        holds it, or a save overwrote it meanwhile. Blocking: run it in a thread."""
        engine = self.engines.get(rank) or FlashEngine(self.name, rank)
        slot = engine.slot_of(step)
        if slot is None:
            return None
        try:
            return copy_out(engine, slot, rank)
        except CheckpointError:
            return None

    def commit(self, step: int) -> None:
        if self.storage is not None:
            self.storage.commit(step, self.keep, job=self.job)

    def unlink(self) -> None:
        for engine in self.engines.values():
            engine.unlink()
        if self._holder is not None:
            self._holder.release(remove=True)
            self._holder = None
