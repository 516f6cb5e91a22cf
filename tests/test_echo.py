"""Workers' output reaches the console byte for byte and is kept, rotated, in the job's
folder (rove.agent.echo): through real pipes, as torch's workers write them."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from rove.agent.diagnosis import read_tail
from rove.agent.echo import Echo, EchoedLogs


def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _drain(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1 << 16):
        into += chunk


def test_what_workers_write_is_copied_unchanged_kept_and_rotated(tmp_path: Path) -> None:
    """Carriage returns, partial lines and bytes that are not UTF-8 pass as written; the
    kept file rotates past its size and keeps the one before (`.1`); what is written just
    before the stop still arrives; a rank outside the filter is kept, not echoed."""
    specs = EchoedLogs(tmp_path / "n1", local_ranks_filter={0}, max_bytes=64)
    envs = {0: {"RANK": "0", "ROVE_ROUND": "1"}, 1: {"RANK": "1", "ROVE_ROUND": "1"}}
    dest = specs.reify(envs)
    read_end, write_end = os.pipe()
    console = bytearray()
    reader = threading.Thread(target=_drain, args=(read_end, console))
    reader.start()
    streams = specs.take()
    for s in streams:
        s.console_fd = write_end if s.console_fd is not None else None
    echo = Echo(streams).start()
    # as torch opens them: a worker function's redirect ("w+b"), a subprocess's ("w")
    with open(dest.stderrs[0], "w+b", buffering=0) as err0, open(dest.stderrs[1], "w") as err1:
        err0.write(b"epoch 1 10%\repoch 1 ")
        err0.write(b"50%\xff\n")
        err1.write("rank 1 is kept, not shown\n")
        err1.flush()
        _until(lambda: (tmp_path / "n1/round1/rank0.stderr").stat().st_size == 25)
        err0.write(b"x" * 100 + b"no newline at the end")  # past 64 bytes: rotated first
        echo.stop()
    os.close(write_end)
    reader.join()
    os.close(read_end)
    written = b"epoch 1 10%\repoch 1 50%\xff\n" + b"x" * 100 + b"no newline at the end"
    assert bytes(console) == written, "rank 0 only, as written"
    folder = tmp_path / "n1" / "round1"
    kept = (folder / "rank0.stderr.1").read_bytes() + (folder / "rank0.stderr").read_bytes()
    assert kept == written, "nothing lost to the rotation"
    assert (folder / "rank0.stderr.1").read_bytes() == b"epoch 1 10%\repoch 1 50%\xff\n"
    assert (folder / "rank1.stderr").read_text() == "rank 1 is kept, not shown\n"
    assert (
        read_tail(str(folder / "rank0.stderr"))
        .encode("utf-8", "surrogateescape")
        .endswith(b"no newline at the end")
    )
    assert "epoch 1 50%" in read_tail(str(folder / "rank0.stderr")), "reaches into .1"
    assert not (folder / ".pipes" / "rank0.stderr").exists(), "pipes removed once done"
    assert specs.kept[(1, "stderr")] == str(folder / "rank1.stderr")


def test_each_round_and_rank_has_its_files_and_torchs_error_file(tmp_path: Path) -> None:
    specs = EchoedLogs(tmp_path / "n1")
    envs = {0: {"RANK": "4", "ROVE_ROUND": "2"}, 1: {"RANK": "5", "ROVE_ROUND": "2"}}
    dest = specs.reify(envs)
    folder = tmp_path / "n1" / "round2"
    assert specs.kept[(0, "stdout")] == str(folder / "rank4.stdout")
    assert dest.stdouts[0].endswith(".pipes/rank4.stdout"), "torch opens the pipe"
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(folder / "rank5.error.json")
    for stream in specs.take():
        stream.close()
    (folder / "rank4.stdout").write_text("an earlier run of the job name")
    specs.reify({0: {"RANK": "4", "ROVE_ROUND": "2"}})
    assert (folder / "rank4.stdout").read_text() == "", "a rerun's round starts afresh"
    for stream in specs.take():
        stream.close()


def test_a_function_worker_opens_its_own_pipes(tmp_path: Path) -> None:
    """torch opens a function entrypoint's log files as seekable ones, which a pipe is
    not: such workers are given their pipes in the environment and open them themselves."""
    specs = EchoedLogs(tmp_path / "n1")
    specs.by_worker = True
    envs = {0: {"RANK": "0", "ROVE_ROUND": "1"}}
    dest = specs.reify(envs)
    assert dest.stdouts[0] == dest.stderrs[0] == "", "torch leaves them alone"
    assert envs[0]["ROVE_STDERR_PIPE"].endswith(".pipes/rank0.stderr")
    for stream in specs.take():
        stream.close()
