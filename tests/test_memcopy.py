"""`rove.checkpoint.memcopy`: the copy agents use for large buffers (a checkpoint's
copy out of shared memory, a replica installed into a slot), and the zeroing that
touches a fresh slot's pages, both without torch."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from rove.checkpoint.memcopy import copy_into, zero
from tests.support import fresh_python


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


def test_zero_clears_a_mapping_and_leaves_no_export_behind(tmp_path: Path) -> None:
    with (tmp_path / "seg").open("w+b") as f:
        f.write(os.urandom(2 << 20))
        f.flush()
        shm = mmap.mmap(f.fileno(), 2 << 20)
        zero(shm)
        assert shm[:] == bytes(2 << 20)
        f.truncate(3 << 20)
        shm.resize(3 << 20)  # no export of the mapping is left behind (else BufferError)
        shm.close()
    buf = bytearray(b"abc")
    zero(buf)
    assert buf == bytes(3)
    zero(bytearray())


def test_an_agent_allocates_and_fills_a_slot_without_importing_torch(tmp_path: Path) -> None:
    """What an agent does with a replica it receives (a fresh slot, filled and sealed,
    then read back raw) imports no torch: a torch import in its event loop held its
    heartbeats for seconds on busy cores."""
    probe = (
        "import sys\n"
        "from pathlib import Path\n"
        "from rove.checkpoint.engine import FlashEngine\n"
        f"e = FlashEngine('j', 0, directory=Path({str(tmp_path)!r}))\n"
        "meta, data, seal = e.receive(7, 16, 1 << 20)\n"
        "meta[:] = bytes(16); data[:] = bytes(1 << 20); meta.release(); data.release()\n"
        "seal(0)\n"
        "assert e.newest() is not None and e.newest().step == 7, e.newest()\n"
        "assert 'torch' not in sys.modules, 'a received slot imported torch'\n"
        "print('ok')\n"
    )
    assert "ok" in fresh_python(probe, timeout=60)


def test_zero_in_parts_covers_every_byte_of_an_uneven_buffer_without_torch() -> None:
    """Without torch (the agent) a large buffer is zeroed by several threads, a part
    each: every byte, the parts' edges and the odd tail included."""
    probe = (
        "import sys\n"
        "from rove.checkpoint import memcopy\n"
        "n = 3 * memcopy.PART + 4099\n"
        "buf = bytearray(b'\\xff') * n\n"
        "memcopy.zero(buf)\n"
        "assert buf.count(0) == n, 'not every byte zeroed'\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    assert "ok" in fresh_python(probe, timeout=120)


def test_zero_with_torch_imported_uses_it_and_leaves_no_export_behind(tmp_path: Path) -> None:
    import torch  # (a worker's process: torch's threads fault the pages in)

    assert torch.__version__
    buf = bytearray(os.urandom(1 << 16))
    zero(buf)
    assert buf == bytes(1 << 16)
    buf.extend(b"x")  # resizable again: no export of it is left behind (else BufferError)
