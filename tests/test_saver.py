"""The agent's saver and the run namespace of shared-memory slots."""

from __future__ import annotations

import asyncio
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from rove.agent.saver import Saver
from rove.checkpoint.engine import FlashEngine, namespace


def test_slots_of_an_earlier_run_of_the_job_are_neither_seen_nor_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path))
    old = FlashEngine(namespace("j1", "aaaa"), 0)
    old.save(70, {"w": torch.ones(4)})  # a killed earlier run left step 70 behind
    other_job = FlashEngine(namespace("j10", "cccc"), 0)
    other_job.save(5, {"w": torch.ones(4)})
    saver = Saver("j1", None)
    saver.ranks((0,), "bbbb")
    assert saver.common_step() is None, "the new run does not see the old run's step"
    assert not list(tmp_path.glob("rove-ckpt-j1.aaaa-*")), "and the old slots are removed"
    assert list(tmp_path.glob("rove-ckpt-j10.cccc-*")), "another job's slots are left alone"
    FlashEngine(namespace("j1", "bbbb"), 0).save(3, {"w": torch.ones(4)})
    assert saver.new_in_memory() == 3
    # a second agent of the run on this machine leaves the first one's lock be
    lock = tmp_path / "rove-ckpt-j1.bbbb.lock"
    held = lock.stat().st_ino  # the run is held
    other = Saver("j1", None)
    other.ranks((1,), "bbbb")
    assert lock.stat().st_ino == held, "the lock both agents hold, not a new one"
    assert list(tmp_path.glob("rove-ckpt-j1.bbbb-r0-*")), "nor its slots"


def test_workers_name_their_slots_by_the_run_the_agent_gives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ROVE_JOB_RUN", "bbbb")
    assert namespace("j1") == "j1.bbbb"
    monkeypatch.delenv("ROVE_JOB_RUN")
    assert namespace("j1") == "j1", "outside rove run: the job name alone"


def test_a_round_restored_to_a_step_drops_every_newer_step_of_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 2 ran ranks 2 and 3 here up to step 94; round 3 restores step 93 with this
    node as ranks 0 and 1: step 94 of ranks 2 and 3 must not survive to be loaded when
    the world grows back and the new lineage reaches 94 again."""
    from rove.checkpoint.storage import FileStorage

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "shm"))
    name = namespace("j1", "run1")
    storage = FileStorage(tmp_path / "ckpt")
    for rank in (2, 3):
        engine = FlashEngine(name, rank)
        for step in (93, 94):
            stats = engine.save(step, {"w": torch.full((2,), float(step))})
            storage.persist(engine, stats.slot, rank)
    saver = Saver("j1", str(tmp_path / "ckpt"))
    saver.ranks((0, 1), "run1")
    saver.reported_step = saver.persisted_step = 94
    dropped, removed = saver.cut(93)
    assert (dropped, removed) == ([94], [94])
    for rank in (2, 3):
        assert [s.step for s in FlashEngine(name, rank).slots()] == [93]
    assert storage.steps() == [93]
    assert (saver.reported_step, saver.persisted_step) == (93, 93), "94 will be new again"
    assert saver.cut(None) == ([93], [93]), "a fresh start keeps nothing"


def test_a_late_round_never_removes_a_committed_step_from_shared_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node cut off while the job went on hears round 4 (restore step 50) only once
    it is back, after the job committed step 85 to the storage every node shares: its
    cut keeps 85 (only the uncommitted steps after it go)."""
    from rove.checkpoint.storage import FileStorage

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "shm"))
    storage = FileStorage(tmp_path / "ckpt")
    engine = FlashEngine(namespace("j1", "run1"), 0)
    for step in (50, 80, 85, 90):
        stats = engine.save(step, {"w": torch.full((2,), float(step))})
        storage.persist(engine, stats.slot, 0)
    storage.commit(85, keep=5)
    saver = Saver("j1", str(tmp_path / "ckpt"))
    saver.ranks((0, 1), "run1")
    _, removed = saver.cut(50)
    assert removed == [90] and storage.steps() == [50, 80, 85] and storage.committed() == 85
    _, removed = saver.cut(None)
    assert removed == [] and storage.steps() == [50, 80, 85]


class _Outbox:
    def __init__(self) -> None:
        self.events: list[object] = []

    def put(self, event: object) -> None:
        self.events.append(event)


class _Saver:
    """Persists nothing: each call raises the next error given. It persists from copies
    already (what a step overwritten while it was persisted switches a real saver to)."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.storage = object()
        self.copying = True

    def persist(self, step: int) -> None:
        raise self.errors.pop(0)


class _Persists:
    """Persists every step (nowhere)."""

    storage, copying = object(), False

    def persist(self, step: int) -> object:
        return types.SimpleNamespace(ranks=(0,), location="somewhere")


async def test_a_step_a_newer_save_overwrote_is_quiet_until_it_keeps_happening() -> None:
    """A saver persisting from copies loses a step only when the workers save faster
    than it copies (a newer one is persisted next): the job's log says so; the console
    (a warning) only once OVERWRITTEN_SAY in a row went, or for any other reason a
    persist failed."""
    from structlog.testing import capture_logs

    from rove.agent import ckpt_duty
    from rove.agent.facts import NodeFacts
    from rove.checkpoint.engine import CheckpointError
    from rove.checkpoint.storage import SlotOverwritten
    from rove.control.catalogue import events as ev

    outbox = _Outbox()
    duty = ckpt_duty.CheckpointDuty(NodeFacts(outbox, job="j", node="n"), None)  # type: ignore[arg-type]
    n = ckpt_duty.OVERWRITTEN_SAY
    duty.saver = _Saver(  # type: ignore[assignment]
        [SlotOverwritten("slot 1 was overwritten while it was persisted")] * n
        + [CheckpointError("bad header")]
    )
    with capture_logs() as logs:
        for step in range(n + 1):
            await duty._persist(step)
    warned = [entry["event"] for entry in logs if entry["log_level"] == "warning"]
    assert len(warned) == 2, logs
    assert warned[0].startswith(f"the last {n} checkpoint steps were overwritten"), warned
    assert "storage is slower than the workers save" in warned[0]
    assert warned[1] == f"could not persist checkpoint step {n}: bad header"
    assert [type(e) for e in outbox.events] == [ev.CkptFailed] * (n + 1)


async def test_a_persist_failing_again_the_same_way_is_said_once_then_now_and_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full disk fails every persist: the console (a warning) says it once, again only
    every FAILING_SAY_S while it lasts, and when persisting works again; every failure is
    in the job's log and an event."""
    from structlog.testing import capture_logs

    from rove.agent import ckpt_duty
    from rove.agent.facts import NodeFacts
    from rove.checkpoint.engine import CheckpointError

    clock = [1000.0]
    monkeypatch.setattr(ckpt_duty.time, "monotonic", lambda: clock[0])
    outbox = _Outbox()
    duty = ckpt_duty.CheckpointDuty(NodeFacts(outbox, job="j", node="n"), None)  # type: ignore[arg-type]
    full = [CheckpointError(f"step {s}: no space left on device") for s in range(5)]
    duty.saver = _Saver([*full[:3], CheckpointError("permission denied"), full[4]])  # type: ignore[assignment]
    with capture_logs() as logs:
        for step in range(3):
            await duty._persist(step)
            clock[0] += 60
        clock[0] += ckpt_duty.FAILING_SAY_S
        await duty._persist(3)  # another kind of failure: said at once
        await duty._persist(4)  # the first kind again: said again (the kind changed)
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warned == [
        "could not persist checkpoint step 0: step 0: no space left on device",
        "could not persist checkpoint step 3: permission denied",
        "could not persist checkpoint step 4: step 4: no space left on device",
    ], warned
    assert len(outbox.events) == 5
    duty.saver = _Saver([CheckpointError("step 5: no space left on device")] * 2)  # type: ignore[assignment]
    with capture_logs() as logs:
        await duty._persist(5)  # the same kind, soon: the log only
        clock[0] += ckpt_duty.FAILING_SAY_S
        await duty._persist(6)
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warned == [
        "still cannot persist checkpoints (7 in a row): could not persist checkpoint "
        "step 6: step 5: no space left on device"
    ], warned

    duty.saver = _Persists()  # type: ignore[assignment]
    with capture_logs() as logs:
        await duty._persist(7)
        await duty._persist(8)
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warned == ["checkpoints persist again: step 7 reached storage, after 7 failed in a row"]


async def test_an_unexpected_persist_failure_is_said_and_the_next_goes_on() -> None:
    """A persist runs as a task of its own: an exception that is not storage failing (a
    bug) used to end it unseen, the step silently not persisted. It is logged as an
    internal error with its traceback, is a `ckpt_failed` event, and the next due step
    is persisted as after any failure."""
    from structlog.testing import capture_logs

    from rove.agent import ckpt_duty
    from rove.agent.facts import NodeFacts
    from rove.control.catalogue import events as ev

    outbox = _Outbox()
    duty = ckpt_duty.CheckpointDuty(NodeFacts(outbox, job="j", node="n"), None)  # type: ignore[arg-type]
    duty.saver = _Saver([KeyError("rank 3")])  # type: ignore[assignment]
    with capture_logs() as logs:
        await duty._persist(10)
    (said,) = [e for e in logs if e["log_level"] == "error"]
    assert said["event"] == "internal error persisting checkpoint step 10"
    assert isinstance(said["exc_info"], KeyError)
    (failed,) = outbox.events
    assert isinstance(failed, ev.CkptFailed) and failed.step == 10
    assert failed.error == "internal error: KeyError: 'rank 3'"

    duty.saver = _Persists()  # type: ignore[assignment]
    with capture_logs() as logs:
        await duty._persist(20)
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert warned == ["checkpoints persist again: step 20 reached storage, after 1 failed in a row"]


async def test_a_node_whose_persist_failed_persists_the_same_steps_as_its_peer_next() -> None:
    """Two nodes persist every 5th step. One's persist of step 10 fails (its disk was
    full); the other's succeeds. Both must persist 15 next, or no step is ever on every
    rank again and none can be committed (the nemesis found every later commit gone)."""
    duties = [_duty(node, Steps(failing)) for node, failing in (("na", {10}), ("nb", set()))]
    for step in range(1, 31):
        for duty in duties:
            duty.saver.newest = step  # type: ignore[attr-defined]
            duty.tick()
            if duty._persisting is not None:
                await duty._persisting
    assert duties[1].saver.persisted == [5, 10, 15, 20, 25, 30]  # type: ignore[attr-defined]
    assert duties[0].saver.persisted == [5, 15, 20, 25, 30]  # type: ignore[attr-defined]


async def test_nodes_that_look_at_different_moments_persist_the_same_steps() -> None:
    """On a busy machine a node's agent may look only after step 6 was saved, its peer's
    between 5 and 6: both must persist 5 (still in memory), not each the newest it saw,
    or no step is ever on every rank and nothing is committed until the job ends (the
    nemesis found a whole job with one commit, at its end)."""
    eager = _duty("na", Steps(set()))
    late = _duty("nb", Steps(set()))
    for step in range(1, 31):
        for duty, looks in ((eager, True), (late, step % 5 == 1)):  # nb: at 1, 6, 11, ...
            duty.saver.newest = step  # type: ignore[attr-defined]
            if looks:
                duty.tick()
                if duty._persisting is not None:
                    await duty._persisting
    assert eager.saver.persisted == [5, 10, 15, 20, 25, 30]  # type: ignore[attr-defined]
    assert late.saver.persisted == [5, 10, 15, 20, 25]  # type: ignore[attr-defined]


def _duty(node: str, saver: Steps) -> Any:
    from rove.agent import ckpt_duty
    from rove.agent.facts import NodeFacts

    duty = ckpt_duty.CheckpointDuty(NodeFacts(_Outbox(), job="j", node=node), None)  # type: ignore[arg-type]
    duty.saver = saver  # type: ignore[assignment]
    duty.persist_every = 5
    return duty


class Steps:
    """A node's saver that holds its two newest steps in memory (as the slots do), and
    persists what it is asked, failing the steps in `failing`; which step is due is the
    real `Saver.aligned_step`."""

    storage = object()
    engines = {0: None}
    aligned_step = Saver.aligned_step
    copying = False

    def __init__(self, failing: set[int]) -> None:
        self.failing, self.newest, self.reported_step = failing, 0, -1
        self.persisted_step, self.persisted = -1, []

    def common_steps(self) -> set[int]:
        return {s for s in (self.newest - 1, self.newest) if s > 0}

    def common_step(self) -> int | None:
        return self.newest or None

    def touch(self) -> None:
        pass  # (its memory is nobody's to reclaim)

    def spilled(self) -> str | None:
        return None  # (its steps are in memory)

    def spilled_ranks(self) -> tuple[int, ...]:
        return ()

    def new_in_memory(self) -> int | None:
        if self.newest <= self.reported_step:
            return None
        self.reported_step = self.newest
        return self.newest

    def persist(self, step: int) -> object:
        from rove.checkpoint.engine import CheckpointError

        if step in self.failing:
            raise CheckpointError(f"step {step}: the disk is full")
        self.persisted.append(step)
        self.persisted_step = step
        return type("Done", (), {"ranks": (0,), "location": "x"})()


class _SlowDisk:
    """A real `FileStorage` on a disk slower than the workers save: each rank's bytes
    are written only after `during()` ran (the workers' next saves)."""

    def __init__(self, root: Path, during: Any) -> None:
        from rove.checkpoint.storage import FileStorage

        class Slow(FileStorage):
            def write(self, manifest: Any, parts: Any, torn: Any) -> None:
                during()
                super().write(manifest, parts, torn)

        self.storage = Slow(root)


async def test_storage_slower_than_the_saves_still_gets_steps_persisted_from_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two ranks on a node; while storage writes a step, the workers save two newer ones
    (both slots turn over). Straight from shared memory the step is torn: nothing of it is
    kept, the console says why and what rove does, and from then on each step is copied
    out first: the next step is persisted whole, though the slots turned over again while
    it was written, and loads back as it was saved."""
    from structlog.testing import capture_logs

    from rove.agent import ckpt_duty
    from rove.agent.facts import NodeFacts
    from rove.control.catalogue import events as ev

    monkeypatch.setenv("ROVE_SHM_DIR", str(tmp_path / "shm"))
    name = namespace("j1", "run1")
    engines = {r: FlashEngine(name, r) for r in (0, 1)}
    saved = {"step": 0}

    def save_all() -> None:
        saved["step"] += 1
        for r, e in engines.items():
            e.save(saved["step"], {"w": torch.full((1000,), float(saved["step"] * 10 + r))})

    def two_newer() -> None:
        save_all()
        save_all()

    save_all()
    outbox = _Outbox()
    duty = ckpt_duty.CheckpointDuty(NodeFacts(outbox, job="j1", node="n"), None)  # type: ignore[arg-type]
    duty.saver = Saver("j1", None)
    duty.saver.storage = _SlowDisk(tmp_path / "ckpt", two_newer).storage
    duty.saver.ranks((0, 1), "run1")
    with capture_logs() as logs:
        await duty._persist(1)
        assert duty.saver.copying
        assert not (tmp_path / "ckpt" / "step-00000001").exists() or not list(
            (tmp_path / "ckpt" / "step-00000001").glob("*.json")
        ), "no manifest names a torn file"
        newest = saved["step"]
        await duty._persist(newest)
    warned = [e["event"] for e in logs if e["log_level"] == "warning"]
    assert len(warned) == 1 and "storage is slower than the workers save" in warned[0], warned
    assert "persisted from the copy" in warned[0]
    assert saved["step"] >= newest + 4, "the slots turned over while each step was written"
    assert [type(e) for e in outbox.events] == [ev.CkptFailed, ev.CkptPersisted]
    assert outbox.events[1].step == newest  # type: ignore[attr-defined]
    for r in (0, 1):
        state = duty.saver.storage.load(newest, r)
        assert torch.equal(state["w"], torch.full((1000,), float(newest * 10 + r)))
    assert duty.saver.copy_bytes() > 2 * 4000, "one copy per rank, kept for the next step"


def test_a_persist_stride_covers_one_and_a_half_persists_in_powers_of_two() -> None:
    from rove.agent.ckpt_duty import persist_stride

    assert persist_stride(0, 5) == 1  # storage keeps up: every due step
    assert persist_stride(3, 5) == 1  # 5 >= 4.5
    assert persist_stride(4, 5) == 2  # 5 < 6 <= 10
    assert persist_stride(100, 5) == 32  # 160 >= 150 > 80
    assert persist_stride(10**9, 1) == 1 << 12  # bounded
    # nested: a node's points include those of any node with a larger stride
    for a, b in ((7, 50), (12, 13), (3, 400)):
        fine, coarse = sorted((persist_stride(a, 5), persist_stride(b, 5)))
        assert coarse % fine == 0


async def test_nodes_whose_uploads_last_different_steps_persist_common_steps() -> None:
    """Two nodes persisting from copies (storage slower than the saves): na's uploads
    last 7 steps, nb's 19. Each persisting the newest due step when free again, they
    persisted different steps and nothing could be committed (two nodes on S3: 700, 785,
    880 and 740, 830, 920). Each now persists on a grid of its own stride, powers of
    two that nest: the steps nb persists are persisted by na too."""
    import threading

    duties = {n: _duty(n, Steps(set())) for n in ("na", "nb")}
    lasts = {"na": 7, "nb": 19}
    for d in duties.values():
        d.persist_every = 1
        d.saver.copying = True
        d.saver.gates = {}
        real = Steps.persist

        def gated(step: int, d: Any = d, real: Any = real) -> object:
            gate = d.saver.gates[step] = threading.Event()
            gate.wait(10)
            return real(d.saver, step)

        d.saver.persist = gated
    ends: dict[str, int] = {}
    for step in range(1, 400):
        for n, d in duties.items():
            d.saver.newest = step
            if ends.get(n) == step:  # the upload started `lasts[n]` steps ago ends now
                d.tick()  # (what it saw meanwhile is reported first)
                for gate in d.saver.gates.values():
                    gate.set()
                await d._persisting
                del ends[n]
            d.tick()
            if d._persisting is not None and not d._persisting.done() and n not in ends:
                ends[n] = step + lasts[n]
                await asyncio.sleep(0.01)  # the task starts its upload
    for d in duties.values():  # the uploads still running end
        for gate in d.saver.gates.values():
            gate.set()
        if d._persisting is not None:
            await d._persisting
    persisted = {n: d.saver.persisted for n, d in duties.items()}
    common = set(persisted["na"]) & set(persisted["nb"])
    assert len(common) >= 5, persisted
    assert set(persisted["nb"][2:]) <= set(persisted["na"]), persisted
    assert duties["na"]._stride < duties["nb"]._stride
