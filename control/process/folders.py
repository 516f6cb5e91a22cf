"""Folders this process must write: whether it can, said before it needs to."""

from __future__ import annotations

import os
from pathlib import Path


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
