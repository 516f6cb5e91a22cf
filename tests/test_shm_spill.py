"""Checkpoint slots spill to disk when shared memory cannot hold them: a real tmpfs too
small for the state (a container's /dev/shm is 64 MiB unless told otherwise), real
files on disk, and a real `rove run` whose worker crashes and restores its spilled
step from memory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rove.checkpoint import shm_owner
from rove.checkpoint.engine import CheckpointError, FlashEngine, spill_dir
from tests.support import rove_cli

#: bytes of the small tmpfs: one slot of `BIG` does not fit, one of `SMALL` does
TMPFS = 1 << 20
BIG = 300_000  # floats: 1.1 MiB
SMALL = 1_000


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 1 MiB, as a container's too-small /dev/shm."""
    assert os.geteuid() == 0, "(these tests mount a small tmpfs: they need root)"
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS}", "tmpfs", str(shm)], check=True)
    try:
        yield shm
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=True)


def test_a_state_too_big_for_shared_memory_spills_to_disk_and_loads_as_any_other(
    small_shm: Path, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    worker = FlashEngine("j.1", 0, directory=small_shm, spill=spill)
    agent = FlashEngine("j.1", 0, directory=small_shm, spill=spill)  # another reader
    worker.save(1, {"w": torch.full((SMALL,), 1.0)})
    assert not worker.segments[0].path.is_symlink(), "a state that fits stays in memory"
    assert [s.step for s in agent.slots()] == [1]
    worker.save(2, {"w": torch.full((BIG,), 2.0)})  # the state grew past the tmpfs
    link = worker.segments[1].path
    assert link.is_symlink() and link.readlink() == spill / link.name
    assert worker.segments[1].spilled and (spill / link.name).stat().st_size > TMPFS
    # the reader follows the slot's new file, checksums it, and loads it
    assert [s.step for s in agent.slots()] == [2, 1]
    agent.seal(agent.slot_of(2) or 0)
    step, state = agent.load()
    assert step == 2 and torch.equal(state["w"], torch.full((BIG,), 2.0))
    worker.save(3, {"w": torch.full((SMALL,), 3.0)})  # into slot 0, in memory
    worker.save(4, {"w": torch.full((BIG,), 4.0)})  # slot 1 again: its spilled file reused
    assert agent.load()[0] == 4 and torch.equal(agent.load()[1]["w"], torch.full((BIG,), 4.0))
    worker.close()
    agent.unlink()
    assert not list(small_shm.iterdir()) and not list(spill.iterdir()), "link and file removed"


def test_a_spilled_slot_that_fits_again_comes_back_to_memory_and_leaves_no_file(
    small_shm: Path, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    ballast = small_shm / "ballast"  # another process's shared memory, for a while
    ballast.write_bytes(b"\0" * (900 << 10))
    engine = FlashEngine("j.1", 0, directory=small_shm, spill=spill, slots=1)
    engine.save(1, {"w": torch.ones(75_000)})  # 300 KiB: more than is left
    assert engine.segments[0].spilled and len(list(spill.iterdir())) == 1
    ballast.unlink()
    engine.save(2, {"w": torch.ones(150_000)})  # larger, and it fits now
    assert not engine.segments[0].spilled and not engine.segments[0].path.is_symlink()
    assert not list(spill.iterdir()), "the spilled file went when the slot came back"
    assert engine.load()[0] == 2


def test_without_a_spill_folder_or_room_on_it_the_save_is_refused_and_says_both(
    small_shm: Path, tmp_path: Path
) -> None:
    off = FlashEngine("off.1", 0, directory=small_shm, spill=None)
    with pytest.raises(CheckpointError, match=r"cannot reserve [\d.]+ MiB of shared memory"):
        off.save(1, {"w": torch.ones(BIG)})
    # the spill folder on a full tmpfs of its own (the disk full too)
    full = small_shm / "also-full"
    full.mkdir()
    (small_shm / "ballast").write_bytes(b"\0" * (TMPFS - (64 << 10)))
    both = FlashEngine("both.1", 0, directory=small_shm, spill=full)
    with pytest.raises(CheckpointError) as err:
        both.save(1, {"w": torch.ones(BIG)})
    said = str(err.value)
    assert f"nor spill it to {full} on disk" in said and "--shm-size" in said, said
    assert not [p for p in small_shm.rglob("*.new")], "no half-made file left"


def test_spilled_files_whose_links_are_gone_are_reclaimed_after_the_grace(
    small_shm: Path, tmp_path: Path
) -> None:
    spill = tmp_path / "spill"
    live = FlashEngine("live.1", 0, directory=small_shm, spill=spill)
    live.save(1, {"w": torch.ones(BIG)})
    orphan = spill / "rove-ckpt-gone.1-r0-s0"  # its link went with a restart's tmpfs
    orphan.write_bytes(b"x" * 4096)
    young = spill / "rove-ckpt-young.1-r0-s0"
    young.write_bytes(b"x" * 4096)
    then = time.time() - 700
    for path in (orphan, *spill.glob("rove-ckpt-live.1-*")):
        os.utime(path, (then, then))
    assert shm_owner.reclaim_spilled(spill, small_shm, 600) == 4096
    assert not orphan.exists() and young.exists()
    assert live.load()[0] == 1, "a slot still linked is kept, however old"
    # a dead run's slots reclaimed from shared memory take their spilled files along
    shm_owner.Holder(small_shm, "live.1").release()
    os.utime(shm_owner.lock_path(small_shm, "live.1"), (then, then))
    [(run, freed)] = shm_owner.reclaim(small_shm, 600, frozenset())
    assert run == "live.1" and freed > TMPFS
    assert not list(spill.glob("rove-ckpt-live.1-*"))


CRASH_ONCE = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from rove.checkpoint.api import FlashCheckpointer
    from rove.agent import progress

    dist.init_process_group("gloo")
    ckpt = FlashCheckpointer()
    w, start = torch.zeros(300_000), 0
    restored = ckpt.load()
    if restored:
        start, state = restored
        w = state["w"]
        print("RESTORED", start, os.environ["ROVE_RESTORE_SOURCE"], float(w[0]), flush=True)
        start += 1
    for step in range(start, 8):
        w += 1
        ckpt.save(step, {"w": w})
        progress.report(step)
        if step == 4 and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            sys.exit("crash after step 4")
    """
)


def test_a_job_whose_state_outgrows_shared_memory_trains_restores_and_commits(
    small_shm: Path, tmp_path: Path
) -> None:
    """A worker's state does not fit in the node's shared memory: the job says so once,
    its slots spill to disk, the crashed worker restores its step from them (not from
    storage), the last step is committed, and the spilled files go with the job."""
    script = tmp_path / "grow.py"
    script.write_text(CRASH_ONCE)
    home = tmp_path / "home"
    out = rove_cli(
        *("run", "--standalone", "--job", "spill", "--max-restarts", "1"),
        *("--checkpoint-dir", str(tmp_path / "ckpt"), str(script)),
        timeout=300,
        env={"ROVE_HOME": str(home), "ROVE_SHM_DIR": str(small_shm)},
    )
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert said.count("does not fit in the shared memory of") == 1, said[-4000:]
    spill = home / "spill" / socket.gethostname()
    assert f"the slots spill to {spill} on disk" in said
    assert "RESTORED 4 memory 5.0" in said, said[-4000:]
    assert "step 7, is committed" in said, said[-4000:]
    assert not list(spill.iterdir()), "the job's spilled slots freed at its end"
    events = rove_cli("events", "--job", "spill", "--json", env={"ROVE_HOME": str(home)})
    spilled = [
        e["spilled"] for e in map(json.loads, events.stdout.splitlines()) if e.get("spilled")
    ]
    assert spilled and all(s == [0] for s in spilled), events.stdout[-3000:]


def test_the_spill_folder_is_said_by_the_environment_or_rove_s_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pwd

    monkeypatch.setenv("ROVE_SHM_SPILL_DIR", str(tmp_path / "here"))
    assert spill_dir() == tmp_path / "here"
    monkeypatch.setenv("ROVE_SHM_SPILL_DIR", "")
    assert spill_dir() is None, "set empty: no spill"
    monkeypatch.delenv("ROVE_SHM_SPILL_DIR")
    monkeypatch.setenv("ROVE_HOME", str(tmp_path / "home"))
    # (by host: a home folder a cluster's machines share holds each one's own)
    assert spill_dir() == tmp_path / "home" / "spill" / socket.gethostname()
    # a container's user with no ROVE_HOME, no HOME and no passwd entry: no spill, and
    # no engine that fails to start for it (Path.home() raises)
    monkeypatch.delenv("ROVE_HOME")
    monkeypatch.delenv("HOME", raising=False)

    def nobody(_uid: int) -> None:
        raise KeyError("no such user")

    monkeypatch.setattr(pwd, "getpwuid", nobody)
    assert spill_dir() is None
    FlashEngine("homeless.1", 0, directory=tmp_path / "shm").save(1, {"w": torch.ones(4)})


def test_rove_status_says_which_ranks_spilled_to_disk() -> None:
    """`ckpt_in_memory` names the ranks whose slots spilled; the master keeps them as of
    each node's newest report, and `rove status` says them beside the node's step (the
    console said it once, and `rove status` said only "in memory")."""
    import msgspec

    from rove.control.cli import status_ckpt
    from rove.control.master import checkpoints as ckpt
    from tests import factories

    c = ckpt.CkptState()
    c = ckpt.on_in_memory(
        c, msgspec.structs.replace(factories.in_memory("na", 3, (0, 1)), spilled=(0, 1))
    )
    c = ckpt.on_in_memory(c, factories.in_memory("nb", 3, (2, 3)))
    view = status_ckpt.view(c)
    assert view["spilled"] == {"na": [0, 1]}
    said = status_ckpt.line(view)
    assert "in memory: na step 3 (ranks 0-1 spilled to disk), nb step 3" in said, said
    # the slots came back to memory (room again): the next report says none
    c = ckpt.on_in_memory(c, factories.in_memory("na", 4, (0, 1)))
    assert status_ckpt.view(c)["spilled"] == {}
    assert "in memory: na step 4, nb step 3" in status_ckpt.line(status_ckpt.view(c))
