"""Temporary folders named for their process (`rove.control.process.tempdirs`): a
killed process's are removed by the next `make`, and nothing else is, with real
processes (one killed with SIGKILL, one alive)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rove.control.process import tempdirs


def made_by_child(
    tmp: Path, *, then: str = "", prefix: str = "rove-warm-quick", root: Path | None = None
) -> tuple[subprocess.Popen[str], Path]:
    """A process that makes its folder in `root` (default: `tmp`, its temporary
    directory), then runs `then`: it and the folder."""
    make = (
        "import sys; from pathlib import Path; from rove.control.process import tempdirs; "
        "root = Path(sys.argv[2]) if len(sys.argv) > 2 else None; "
        "print(tempdirs.make(sys.argv[1], root), flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", make + "\n" + then, prefix, *([str(root)] if root else [])],
        env={**os.environ, "TMPDIR": str(tmp)},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_processs_folder_goes_at_the_next_make_and_a_live_ones_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, its = made_by_child(tmp_path, then="import time; time.sleep(600)")
    (its / "ready").touch()  # (what a warm server leaves in it)
    assert its.is_dir() and its.name.startswith(f"rove-warm-quick-{tempdirs._namespace()}.")
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert its.is_dir(), "a process killed with SIGKILL leaves its folder"
    unmarked = tmp_path / "rove-warm-quick-abc123"  # (made before names carried a pid)
    unmarked.mkdir()
    elsewhere = tmp_path / f"rove-tf-{tempdirs._namespace() + 1}.{killed.pid}-x1y2"
    elsewhere.mkdir()  # another PID namespace's: its pid says nothing here
    alive, theirs = made_by_child(tmp_path, then="import sys; sys.stdin.read()")
    try:
        assert not its.exists(), "the next process's make swept the killed one's folder"
        mine = tempdirs.make("rove-tf")
        assert mine.name.startswith(f"rove-tf-{tempdirs._namespace()}.{os.getpid()}-")
        assert theirs.is_dir(), "a live process's folder stays"
        assert unmarked.is_dir() and elsewhere.is_dir()
        assert tempdirs.sweep() == [], "nothing more to sweep; this process's own stays"
        assert mine.is_dir()
    finally:
        alive.kill()
        alive.wait(30)
    assert tempdirs.sweep() == [theirs.name], "once that process is gone, its folder goes"


@pytest.mark.parametrize("long", [False, True])
def test_multiprocessings_folder_is_named_for_the_process_where_a_socket_fits(
    tmp_path: Path, long: bool
) -> None:
    """The warm servers' sockets are made in multiprocessing's temporary folder: rove
    names it for its process (so a killed `rove run`'s goes at the next one) unless a
    long TMPDIR would make a socket's path too long for AF_UNIX; then multiprocessing's
    own `pymp-*` is used, and `rove run` still starts its warm server."""
    tmp = Path(tempfile.mkdtemp(prefix="rv-", dir="/tmp")) if not long else tmp_path / ("x" * 60)
    tmp.mkdir(exist_ok=True)
    code = (
        "from multiprocessing import connection, process; from rove.agent import server_spawn; "
        "server_spawn.own_mp_tempdir(); print(connection.arbitrary_address('AF_UNIX'))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "TMPDIR": str(tmp)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        folder = Path(out).parent
        assert folder.parent == tmp
        assert folder.name.startswith("pymp-" if long else "rove-mp-"), out
        assert long or len(out) < 108, "a socket's path fits"
        assert not folder.exists(), "removed at the process's normal exit"
        assert sorted(p.name for p in tmp.iterdir()) == []
    finally:
        if not long:
            shutil.rmtree(tmp, ignore_errors=True)


def test_a_folder_made_elsewhere_is_swept_there(tmp_path: Path) -> None:
    """A Hugging Face resume writes its checkpoint out in /dev/shm (`root`): memory, that
    a worker killed before its clean-up held until the machine restarted. The next
    worker's resume removes it; the sweep keeps to its root."""
    shm = tmp_path / "shm"
    shm.mkdir()
    child, its = made_by_child(
        tmp_path, prefix="rove-hf-40", root=shm, then="import time; time.sleep(600)"
    )
    (its / "model.safetensors").write_bytes(b"x" * 4096)
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert its.parent == shm and (its / "model.safetensors").is_file()
    assert tempdirs.sweep(tmp_path) == [], "not in another root"
    mine = tempdirs.make("rove-hf-40", shm)
    assert sorted(p.name for p in shm.iterdir()) == [mine.name], "the killed worker's went"
