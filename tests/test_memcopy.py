"""`rove.checkpoint.memcopy.copy_into`: the copy agents use for large buffers (a
checkpoint's copy out of shared memory, a replica installed into a slot)."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from rove.checkpoint.memcopy import copy_into


def test_it_copies_between_bytearrays_views_and_a_shared_memory_mapping(tmp_path: Path) -> None:
    src = bytearray(os.urandom(1 << 20))
    dst = bytearray(1 << 20)
    copy_into(dst, src)
    assert dst == src
    with (tmp_path / "seg").open("w+b") as f:
        f.truncate(3 << 20)
        shm = mmap.mmap(f.fileno(), 3 << 20)
        view = memoryview(shm)
        copy_into(view[4096 : 4096 + len(src)], src)  # into a mapping, at an offset
        back = bytearray(len(src))
        copy_into(back, view[4096 : 4096 + len(src)])  # and out of it
        assert back == src
        view.release()
        f.truncate(4 << 20)
        shm.resize(4 << 20)  # no export of the mapping is left behind (else BufferError)
        shm.close()


def test_a_read_only_source_and_an_empty_copy_work_and_a_length_mismatch_is_refused() -> None:
    dst = bytearray(5)
    copy_into(dst, b"hello")
    assert dst == b"hello"
    copy_into(bytearray(), b"")
    with pytest.raises(ValueError, match="cannot copy 5 bytes into 4"):
        copy_into(bytearray(4), b"hello")
