"""Copies of large buffers that let other threads run meanwhile.

`dst[:] = src` on a bytearray or memoryview copies while holding the GIL, and slowly:
1 GiB took 0.89 s here, during which the agent's event loop (its heartbeats, its
replica transfers) could not run at all. `ctypes.memmove` is a plain `memmove` that
releases the GIL: the same copy took 0.12 s, and a thread beside it was never held up
more than a few milliseconds. `zero` is the same for a fresh segment's pages (a
`memset` that faults every page in). Torch-free: the agent imports no torch, and a
`torch` import in its event loop (1.4 s quiet, over 3 s on busy cores) silenced its
heartbeats past a short node timeout.
"""

from __future__ import annotations

import ctypes
import mmap

Buffer = bytes | bytearray | memoryview


def copy_into(dst: Buffer, src: Buffer) -> None:
    """Copy all of `src` into `dst`, of the same length (ValueError otherwise). `dst`
    must be writable; a read-only `src` is copied the slow way."""
    d, s = memoryview(dst).cast("B"), memoryview(src).cast("B")
    try:
        if len(d) != len(s):
            raise ValueError(f"cannot copy {len(s)} bytes into {len(d)}")
        if not len(d):
            return
        if s.readonly:
            d[:] = s
            return
        to, of = ctypes.c_char.from_buffer(d), ctypes.c_char.from_buffer(s)
        try:
            ctypes.memmove(ctypes.addressof(to), ctypes.addressof(of), len(d))
        finally:
            del to, of  # (the buffers' exports end: an mmap behind them may be resized)
    finally:
        d.release()
        s.release()


def zero(dst: mmap.mmap | bytearray | memoryview) -> None:
    """Write zeros over all of `dst` (writable), releasing the GIL meanwhile: every page
    of a fresh mapping is faulted in now, not in the first save into it."""
    d = memoryview(dst).cast("B")
    try:
        if not len(d):
            return
        to = ctypes.c_char.from_buffer(d)
        try:
            ctypes.memset(ctypes.addressof(to), 0, len(d))
        finally:
            del to  # (the buffer's export ends: the mapping may be closed or replaced)
    finally:
        d.release()
