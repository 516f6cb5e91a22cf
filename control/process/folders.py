"""Folders this process must write: where rove keeps its own, and whether it can write
them, said before it needs to (stdlib only: a worker's checkpoint engine reads it)."""

from __future__ import annotations

import os
from pathlib import Path


def rove_home() -> Path:
    """Where rove keeps local state: `$ROVE_HOME`, else `~/.rove`."""
    return Path(os.environ.get("ROVE_HOME") or Path.home() / ".rove")


def unwritable(folder: Path) -> str | None:
    """Why this user cannot create the folder `folder` and write in it (None: it can,
    and it exists now): the system's words and the path they are about."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(f"this user cannot write in {folder}")
    except OSError as exc:
        return f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}"
    return None
