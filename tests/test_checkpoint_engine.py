"""Flash-checkpoint engine: shared-memory slots, bitwise round trips, torn and corrupted data."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from rove.checkpoint.engine import CheckpointError, FlashEngine
from rove.checkpoint.layout import CheckpointLayoutError
from rove.checkpoint.shm import WRITING
from rove.checkpoint.storage import FileStorage


def trained_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 16)).pow(2).mean().backward()
        opt.step()
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "py_rng": random.getstate(),
        "step": 3,
        "epoch": 0,
        "tag": "run-7",
        "half": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "empty": torch.empty(0),
        "nested": [1, (2, "three"), {"k": None}],
    }


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        raw_a = a.contiguous().reshape(-1).view(torch.uint8)
        raw_b = b.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(raw_a, raw_b), "bitwise equal"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def test_model_optimizer_and_plain_state_round_trip_bitwise(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    state = trained_state()
    engine.save(3, state)
    step, back = engine.load()
    assert step == 3
    assert_same(state, back)
    random.setstate(back["py_rng"])  # tuples stay tuples


def test_saves_alternate_slots_and_the_newest_complete_step_loads(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    slots = [engine.save(s, {"w": torch.full((4,), float(s))}).slot for s in (1, 2, 3)]
    assert slots == [0, 1, 0]
    step, state = engine.load()
    assert step == 3 and torch.equal(state["w"], torch.full((4,), 3.0))
    assert engine.load(step=2)[0] == 2
    with pytest.raises(CheckpointError, match="step 1"):
        engine.load(step=1)


def test_a_restarted_process_finds_the_state_in_memory(tmp_path: Path) -> None:
    FlashEngine("j1", 0, directory=tmp_path).save(9, {"w": torch.ones(3)})
    fresh = FlashEngine("j1", 0, directory=tmp_path)  # a new process attaching by name
    assert fresh.load()[0] == 9


def test_corrupted_memory_is_refused_and_the_previous_step_is_used(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    engine.save(1, {"w": torch.ones(1000)})
    newest = engine.save(2, {"w": torch.full((1000,), 2.0)})
    engine.seal(0)
    engine.seal(newest.slot)
    seg = engine.segments[newest.slot]
    header = seg.header()
    assert header is not None
    seg.view(header.data_offset + 100, 1)[0] ^= 0xFF  # one flipped byte
    step, state = engine.load()
    assert step == 1 and torch.equal(state["w"], torch.ones(1000))
    with pytest.raises(CheckpointError, match="failed its checksum"):
        engine.load(step=2)


def test_a_save_that_begins_as_the_agent_seals_is_never_marked_with_the_older_checksum(
    tmp_path: Path,
) -> None:
    """The agent seals a slot while the worker may save into it again at any moment:
    here the worker's next two saves land between the seal's last look at the slot
    and its write. The slot holds the newest step, loadable, not the older step's
    checksum over the newer bytes."""
    worker = FlashEngine("j1", 0, directory=tmp_path)
    worker.save(1, {"w": torch.ones(1000)})
    worker.save(2, {"w": torch.full((1000,), 2.0)})  # both slots exist, mapped by the agent
    worker.save(3, {"w": torch.full((1000,), 3.0)})  # slot 0
    agent = FlashEngine("j1", 0, directory=tmp_path)
    seg = agent.segments[0]
    looks = 0
    real_header = seg.header

    def header_then_the_worker_saves():  # type: ignore[no-untyped-def]
        nonlocal looks
        h = real_header()
        looks += 1
        if looks == 2:  # the seal's check after its digest: the worker saves right after
            worker.save(4, {"w": torch.full((1000,), 4.0)})  # into slot 1
            worker.save(5, {"w": torch.full((1000,), 5.0)})  # into slot 0, the one sealed
        return h

    seg.header = header_then_the_worker_saves  # type: ignore[method-assign]
    agent.seal(0)
    del seg.header
    assert [(s.step, s.sealed) for s in agent.slots()] == [(5, False), (4, False)]
    step, state = agent.load()
    assert step == 5 and torch.equal(state["w"], torch.full((1000,), 5.0))
    agent.seal(0)  # sealed again by the saver before it persists: now in force
    assert agent.slots()[0].sealed
    assert agent.load()[0] == 5


def test_every_slot_corrupted_is_a_clear_error(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    engine.save(1, {"w": torch.ones(10)})
    engine.seal(0)
    h = engine.segments[0].header()
    assert h is not None
    engine.segments[0].view(h.data_offset, 1)[0] ^= 1
    with pytest.raises(CheckpointError, match="checksum"):
        engine.load()


def test_nothing_saved_yet_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        FlashEngine("j1", 0, directory=tmp_path).load()


def test_a_value_that_cannot_be_stored_names_its_path(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    with pytest.raises(CheckpointLayoutError, match=r"object at \.extra\.fn"):
        engine.save(1, {"extra": {"fn": object()}})


def test_numpy_and_python_generator_states_and_numpy_scalars_round_trip(tmp_path: Path) -> None:
    """A PCG64 generator's state (128-bit ints: "can't serialize ints > 2**64 - 1") and a
    numpy float64 (a float subclass msgpack refused) failed the save with a TypeError;
    a numpy scalar came back as a 0-d tensor."""
    import enum
    import random

    import numpy as np

    class Color(str, enum.Enum):  # noqa: UP042 - the older way, whose str() is "Color.RED"
        RED = "red"

    rng = np.random.default_rng(7)
    rng.random()
    np.random.seed(3)
    state = {
        "pcg64": rng.bit_generator.state,
        "legacy": np.random.get_state(),
        "python": random.getstate(),
        "best": np.float64(0.25),
        "count": np.int64(-5),
        "flag": np.bool_(True),
        "huge": -(2**70),
        "color": Color.RED,
    }
    engine = FlashEngine("j1", 0, directory=tmp_path)
    engine.save(1, state)
    restored = engine.load()
    assert restored is not None
    _, back = restored
    again = np.random.default_rng()
    again.bit_generator.state = back["pcg64"]
    assert again.random() == rng.random(), "the generator goes on where it was saved"
    np.random.set_state(back["legacy"])
    drawn = np.random.rand()
    np.random.seed(3)
    assert drawn == np.random.rand()
    random.setstate(back["python"])
    assert (back["best"], back["count"], back["flag"]) == (0.25, -5, True)
    assert [type(back[k]) for k in ("best", "count", "flag")] == [float, int, bool]
    assert back["huge"] == -(2**70) and back["color"] == "red"


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
        (lambda: torch.empty(2, device="meta"), "meta"),
    ],
)
def test_a_tensor_that_is_not_dense_is_refused_naming_its_path_and_what_to_save(
    tmp_path: Path, make: Any, kind: str
) -> None:
    """(A sparse tensor failed deep in torch: "copy_() between dense and sparse Tensors
    is not implemented", the job's root cause pointing into rove's engine.)"""
    engine = FlashEngine("j1", 0, directory=tmp_path)
    engine.save(1, {"w": torch.ones(2)})
    with pytest.raises(CheckpointLayoutError, match=rf"a {kind}.* tensor at \.extra\[0\]: "):
        engine.save(2, {"w": torch.ones(2), "extra": [make()]})
    assert engine.newest() is not None and engine.newest().step == 1, "the step before stays"


def test_segments_are_reused_and_grow_only_when_the_state_grows(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    engine.save(1, {"w": torch.zeros(1000)})
    engine.save(2, {"w": torch.zeros(1000)})
    sizes = [s.size for s in engine.segments]
    inode = engine.segments[0].path.stat().st_ino
    engine.save(3, {"w": torch.zeros(1000)})
    assert [s.size for s in engine.segments] == sizes
    assert engine.segments[0].path.stat().st_ino == inode, "same segment, not a new one"
    engine.save(4, {"w": torch.zeros(10_000_000)})
    assert engine.segments[1].size > sizes[1]
    assert engine.load()[0] == 4


def test_a_reader_follows_slots_the_writer_replaced_to_fit_a_larger_state(
    tmp_path: Path,
) -> None:
    """The agent reads the slots its workers write, through engines of its own: a state
    that outgrows its slot (a new, larger file) must not hide every later step from it."""
    writer = FlashEngine("j1", 0, directory=tmp_path)
    writer.save(1, {"w": torch.zeros(10)})
    writer.save(2, {"w": torch.zeros(10)})
    reader = FlashEngine("j1", 0, directory=tmp_path)
    assert [s.step for s in reader.slots()] == [2, 1]
    big = torch.arange(2_000_000, dtype=torch.float32)  # 200,000 times larger
    writer.save(3, {"w": big})
    writer.save(4, {"w": big + 1})
    assert [s.step for s in reader.slots()] == [4, 3], "the reader maps the new files"
    step, state = reader.load()
    assert step == 4 and torch.equal(state["w"], big + 1)
    writer.save(5, {"w": torch.ones(3)})  # and shrinks again: the larger slot is reused
    step, state = reader.load()
    assert step == 5 and torch.equal(state["w"], torch.ones(3))
    storage = FileStorage(tmp_path / "ckpt")
    newest = reader.newest()
    assert newest is not None
    storage.persist(reader, newest.slot, 0)
    assert torch.equal(storage.load(5, 0)["w"], torch.ones(3))
    older = next(s for s in reader.slots() if s.step == 4)
    storage.persist(reader, older.slot, 0)
    assert torch.equal(storage.load(4, 0)["w"], big + 1), "persisted whole, never cut short"


WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from rove.checkpoint.engine import FlashEngine
    e = FlashEngine("j1", 0, directory=Path(sys.argv[1]))
    step = 0
    while True:
        step += 1
        e.save(step, {"w": torch.full((25_000_000,), float(step)), "step": step})
""")


def _wait_stopped(pid: int) -> None:
    stat = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "T" and time.monotonic() < deadline:
        time.sleep(0.001)


def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_step_intact(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)])
    engine = FlashEngine("j1", 0, directory=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            engine = FlashEngine("j1", 0, directory=tmp_path)
            headers = [s.header() for s in engine.segments]
            completes = [h for h in headers if h is not None and h.state != WRITING]
            if any(h is not None and h.state == WRITING for h in headers) and completes:
                # stopped first, then looked at again: the kill lands where it was seen
                # (on a busy machine the save could otherwise end between the two)
                proc.send_signal(signal.SIGSTOP)
                _wait_stopped(proc.pid)
                headers = [s.header() for s in engine.segments]
                if any(h is not None and h.state == WRITING for h in headers):
                    proc.send_signal(signal.SIGKILL)
                    break
                proc.send_signal(signal.SIGCONT)
            time.sleep(0.001)
        else:
            pytest.fail("never caught a save in progress")
    finally:
        proc.kill()
        proc.wait()
    engine = FlashEngine("j1", 0, directory=tmp_path)
    assert any(s.header().state == WRITING for s in engine.segments if s.header()), (
        "the kill landed mid-save"
    )
    step, state = engine.load()
    assert state["step"] == step
    assert torch.equal(state["w"], torch.full((25_000_000,), float(step))), "intact"


def test_load_without_copy_gives_views_a_model_can_load_from(tmp_path: Path) -> None:
    engine = FlashEngine("j1", 0, directory=tmp_path)
    model = torch.nn.Linear(4, 4)
    engine.save(1, {"model": model.state_dict()})
    _, state = engine.load(copy=False)
    fresh = torch.nn.Linear(4, 4)
    fresh.load_state_dict(state["model"])
    assert torch.equal(fresh.weight, model.weight)


SHM_FULL = textwrap.dedent(
    """
    import resource, signal, sys, torch
    from pathlib import Path
    from rove.checkpoint.engine import CheckpointError, FlashEngine

    engine = FlashEngine("full", 0, directory=Path(sys.argv[1]))
    engine.save(1, {"w": torch.ones(1000)})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # as a full tmpfs
    try:
        engine.save(2, {"w": torch.ones(1 << 20)})
    except CheckpointError as exc:
        print("REFUSED", exc)
    step, state = engine.load()
    print("LOADED", step, int(state["w"].sum()))
    """
)


def test_full_shared_memory_is_a_clear_error_and_the_previous_step_survives(
    tmp_path: Path,
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SHM_FULL, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "REFUSED cannot reserve 4.0 MiB of shared memory" in out.stdout, out.stdout + out.stderr
    assert "--shm-size" in out.stdout
    assert "LOADED 1 1000" in out.stdout
    assert not list(tmp_path.glob("*.new")), "no half-allocated segment left"
