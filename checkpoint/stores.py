"""Which checkpoint storage a location names: an object store for a URL, else a
directory (`rove run --checkpoint-dir`, `ROVE_CKPT_DIR`, a checkpointer's argument)."""

from __future__ import annotations

from pathlib import Path

from rove.checkpoint.durable import is_url
from rove.checkpoint.object_store import ObjectStorage
from rove.checkpoint.storage import FileStorage, Storage


def open_storage(location: str | Path) -> Storage:
    """The storage at `location`: an object store for a URL (`s3://bucket/prefix`,
    `gs://...`, `az://...`), else a directory (a path, or `file://PATH`).

    Raises:
        StorageError: the URL names no store rove can use (the message says which).
    """
    text = str(location)
    if is_url(text):
        return ObjectStorage(text)
    return FileStorage(Path(text.removeprefix("file://")))
