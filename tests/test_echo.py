"""Workers' stderr reaches the console byte for byte (rove.agent.echo)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from rove.agent.echo import Echo, EchoedLogs


def _drain(fd: int, into: bytearray) -> None:
    while chunk := os.read(fd, 1 << 16):
        into += chunk


def test_what_workers_write_is_copied_unchanged_and_whole(tmp_path: Path) -> None:
    """Carriage returns, partial lines and bytes that are not UTF-8 pass as written; a
    file created after the echo started is picked up; what is written just before the
    stop still arrives."""
    first, late = tmp_path / "0.log", tmp_path / "1.log"
    first.write_bytes(b"")
    read_end, write_end = os.pipe()
    got = bytearray()
    reader = threading.Thread(target=_drain, args=(read_end, got))
    reader.start()
    echo = Echo({0: str(first), 1: str(late)}, fd=write_end).start()
    with first.open("ab", buffering=0) as f:
        f.write(b"epoch 1 10%\repoch 1 ")
        time.sleep(0.2)
        f.write(b"50%\xff\n")
        late.write_bytes(b"late rank\n")
        f.write(b"no newline at the end")
        echo.stop()
    os.close(write_end)
    reader.join()
    os.close(read_end)
    text = bytes(got)
    assert (
        text.replace(b"late rank\n", b"") == b"epoch 1 10%\repoch 1 50%\xff\nno newline at the end"
    )
    assert b"late rank\n" in text


def test_the_ranks_filter_chooses_whose_output_is_echoed(tmp_path: Path) -> None:
    paths = {0: "/x/0/stderr.log", 1: "/x/1/stderr.log", 2: ""}
    assert EchoedLogs(tmp_path, None).echoed(paths) == {0: paths[0], 1: paths[1]}
    assert EchoedLogs(tmp_path, {1}).echoed(paths) == {1: paths[1]}


def test_each_round_and_rank_has_its_files_and_torchs_error_file(tmp_path: Path) -> None:
    specs = EchoedLogs(tmp_path / "n1")
    envs = {0: {"RANK": "4", "ROVE_ROUND": "2"}, 1: {"RANK": "5", "ROVE_ROUND": "2"}}
    dest = specs.reify(envs)
    folder = tmp_path / "n1" / "round2"
    assert dest.stdouts == {0: str(folder / "rank4.stdout"), 1: str(folder / "rank5.stdout")}
    assert dest.stderrs[1] == str(folder / "rank5.stderr")
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(folder / "rank5.error.json")
    (folder / "rank4.stdout").write_text("an earlier run of the job name")
    specs.reify({0: {"RANK": "4", "ROVE_ROUND": "2"}})
    assert not (folder / "rank4.stdout").exists(), "a rerun's round starts afresh"
