"""Dead runs' shared memory reclaimed: real files, real locks held by real processes,
and two real `rove run --standalone` jobs on one machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rove.checkpoint import shm_owner
from tests.support import patience, rove_cli

TRAIN = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _slots(directory: Path, run: str) -> list[Path]:
    paths = [directory / f"rove-ckpt-{run}-r{r}-s{s}" for r in (0, 1) for s in (0, 1)]
    for path in paths:
        path.write_bytes(b"x" * 64)
    return paths


def _aged(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def _alive(code: str, ready: str) -> subprocess.Popen[str]:
    """A Python process running `code`, once it printed `ready`; then it sleeps."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"{code}\nprint({ready!r}, flush=True)\nimport time; time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == ready
    return proc


def test_only_runs_nobody_holds_and_nobody_touched_for_the_grace_are_reclaimed(
    tmp_path: Path,
) -> None:
    held = _slots(tmp_path, "held.1")
    dead = _slots(tmp_path, "dead.2")
    fresh = _slots(tmp_path, "fresh.3")
    legacy = _slots(tmp_path, "legacy.4")  # no lock file: an older rove's (modified now)
    mine = _slots(tmp_path, "mine.5")
    other = tmp_path / "rove-ckpt-dead.2-results"  # not a slot
    other.write_text("keep")
    holder = _alive(
        "from pathlib import Path\n"
        "from rove.checkpoint.shm_owner import Holder\n"
        f"h = Holder(Path({str(tmp_path)!r}), 'held.1')",
        "held",
    )
    try:
        for run in ("dead.2", "fresh.3", "mine.5"):
            shm_owner.Holder(tmp_path, run).release()  # its agent is gone
        for run in ("held.1", "dead.2", "mine.5"):
            _aged(shm_owner.lock_path(tmp_path, run), 700)
        gone = shm_owner.reclaim(tmp_path, 600, frozenset({"mine.5"}))
        assert [run for run, _ in gone] == ["dead.2"] and gone[0][1] == 4 * 64
        assert not any(p.exists() for p in dead)
        assert not shm_owner.lock_path(tmp_path, "dead.2").exists()
        assert all(p.exists() for p in (*held, *fresh, *legacy, *mine, other))
        # the holder is killed: its run is kept for the grace from its last touch
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        assert [r for r, _ in shm_owner.reclaim(tmp_path, 600, frozenset())] == [
            "held.1",
            "mine.5",
        ]
        assert [r for r, _ in shm_owner.reclaim(tmp_path, 0, frozenset())] == [
            "fresh.3",
            "legacy.4",
        ]
        assert not any(p.exists() for p in (*held, *fresh, *mine, *legacy))
        assert other.exists()
    finally:
        holder.kill()
        holder.wait(30)


def test_slots_without_a_lock_file_go_once_old_and_mapped_by_no_process(tmp_path: Path) -> None:
    """An older rove's slots (no lock file): kept while modified within the grace or
    mapped by a process (its workers), reclaimed once neither."""
    recent = _slots(tmp_path, "recent.1")
    mapped = _slots(tmp_path, "mapped.2")
    old = _slots(tmp_path, "old.3")
    for path in (*mapped, *old):
        _aged(path, 700)
    user = _alive(
        f"import mmap\nf = open({str(mapped[3])!r}, 'r+b'); m = mmap.mmap(f.fileno(), 0)",
        "mapped",
    )
    try:
        gone = shm_owner.reclaim(tmp_path, 600, frozenset())
        assert gone == [("old.3", 4 * 64)]
        assert not any(p.exists() for p in old)
        assert all(p.exists() for p in (*recent, *mapped)), "in use, or written lately"
    finally:
        user.kill()
        user.wait(30)
    assert [run for run, _ in shm_owner.reclaim(tmp_path, 600, frozenset())] == ["mapped.2"]


def test_a_run_taken_up_again_after_its_slots_were_reclaimed_holds_a_new_lock(
    tmp_path: Path,
) -> None:
    shm_owner.Holder(tmp_path, "r.1").release()
    assert shm_owner.reclaim(tmp_path, 0, frozenset()) == [("r.1", 0)]
    again = shm_owner.Holder(tmp_path, "r.1")
    try:
        _aged(shm_owner.lock_path(tmp_path, "r.1"), 10_000)
        assert shm_owner.reclaim(tmp_path, 0, frozenset()) == [], "held"
        again.touch(force=True)
        assert time.time() - shm_owner.lock_path(tmp_path, "r.1").stat().st_mtime < 60
    finally:
        again.release(remove=True)
    assert not shm_owner.lock_path(tmp_path, "r.1").exists()


def test_a_bad_grace_is_said_and_the_default_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROVE_SHM_GRACE_S", "soon")
    assert shm_owner.grace_s() == shm_owner.GRACE_S
    monkeypatch.setenv("ROVE_SHM_GRACE_S", "-5")
    assert shm_owner.grace_s() == shm_owner.GRACE_S
    monkeypatch.setenv("ROVE_SHM_GRACE_S", "0")
    assert shm_owner.grace_s() == 0.0


@pytest.mark.slow
def test_a_killed_jobs_shared_memory_is_reclaimed_by_the_next_job_after_the_grace(
    tmp_path: Path,
) -> None:
    """`rove run --standalone` killed with SIGKILL leaves its flash slots (a restarted
    agent of it would restore from them). Another job started within the grace keeps
    them; one started after it reclaims them, and says so."""
    shm = tmp_path / "shm"
    env = {**os.environ, "ROVE_HOME": str(tmp_path / "home"), "ROVE_SHM_DIR": str(shm)}
    killed = subprocess.Popen(
        [
            *(sys.executable, "-m", "rove.control.cli.main", "run", "--standalone"),
            *("--job", "killed", "--nproc-per-node", "2", str(TRAIN)),
            *("--steps", "100000", "--ckpt-every", "1", "--step-sleep", "0.05"),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + patience(120)
        while len(list(shm.glob("rove-ckpt-killed.*-r*-s*"))) < 4:
            assert time.monotonic() < deadline, "the first job never saved"
            time.sleep(0.1)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
    left = sorted(shm.glob("rove-ckpt-killed.*-r*-s*"))
    deadline = time.monotonic() + patience(30)
    while holders := _pids_with(shm):
        if time.monotonic() > deadline:
            said = {
                p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ") for p in holders
            }
            raise AssertionError(f"the killed job's processes live on: {said}")
        time.sleep(0.1)
    short = ["--nproc-per-node", "1", str(TRAIN), "--steps", "2", "--ckpt-every", "1"]
    within = rove_cli("run", "--standalone", "--job", "within", *short, timeout=300, env=env)
    assert within.returncode == 0, (within.stdout + within.stderr)[-3000:]
    assert all(p.exists() for p in left), "kept for a restarted agent of the killed job"
    after = rove_cli(
        "run",
        "--standalone",
        "--job",
        "after",
        *short,
        timeout=300,
        env={**env, "ROVE_SHM_GRACE_S": "0"},
    )
    out = after.stdout + after.stderr
    assert after.returncode == 0, out[-3000:]
    assert not any(p.exists() for p in left), "reclaimed"
    assert "of shared memory a killed run left" in out and "(killed." in out, out[-3000:]
    assert not list(shm.glob("rove-ckpt-within.*")), "an ended job frees its own"


def _pids_with(directory: Path) -> list[int]:
    """Processes with a file of `directory` mapped or open (the killed job's workers, and
    whoever still holds its lock file: its run is not dead until none does)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
            fds = [str(fd.readlink()) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if str(directory) in maps or any(f.startswith(str(directory)) for f in fds):
            pids.append(int(proc.name))
    return pids
