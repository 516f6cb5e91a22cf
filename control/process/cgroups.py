"""This process's cgroup v2 directory (the unified hierarchy), if it has one."""

from __future__ import annotations

import contextlib
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def own_dir() -> Path | None:
    """`/sys/fs/cgroup/<path>` of this process under cgroup v2, or None (v1, or unreadable)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::") and (ROOT / "cgroup.controllers").exists():
                return ROOT / line.split(":", 2)[2].lstrip("/")
    return None
