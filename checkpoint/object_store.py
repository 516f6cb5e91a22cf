"""Persistent checkpoint storage in an object store: S3 (and S3-compatible stores such
as MinIO or Ceph), Google Cloud Storage and Azure Blob Storage, through `obstore`.

`rove run --checkpoint-dir s3://bucket/prefix` (or `gs://`, `az://`) selects it; the
same layout as on files, under the prefix:

    step-00000120/rank-00003.ckpt        the slot's description and tensor bytes
    step-00000120/rank-00003.json        manifest: sizes and the xxh3 checksum
    committed                            tracker: {"step": N, "job": J} (`durable.Tracker`)
    writers/JOB.json                     a running job's mark (`rove.checkpoint.writers`)

What makes it safe without renames or fsync: an object store makes each PUT atomic (a
reader sees the whole object or none; a large one is a multipart upload, which becomes
visible only when it completes). A rank's data object is uploaded first, then its
manifest, and only after the slot was checked unchanged, so a manifest always names a
whole, verified upload; `persisted_ranks` counts a rank only when both are there, and
`load` checks the size and the checksum again. The tracker is written only when the
master decided the step is on every rank.

Credentials and endpoints come from the environment, as each cloud's own tools read
them (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL`
for S3-compatible stores, `AWS_ALLOW_HTTP=true` for a plain-HTTP endpoint;
`GOOGLE_SERVICE_ACCOUNT`; `AZURE_STORAGE_ACCOUNT_NAME`, ...), or from the instance's
role where the cloud has one. No credential is ever on a command line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgspec

from rove.checkpoint import durable
from rove.checkpoint.engine import CheckpointError
from rove.checkpoint.storage import (
    WRITERS,
    Manifest,
    SlotOverwritten,
    Storage,
    StorageError,
    mark_name,
    overwritten,
    rebuild_verified,
)

if TYPE_CHECKING:
    from obstore.store import ObjectStore

#: Objects larger than this are uploaded in parts of this size (S3's parts are at least
#: 5 MiB); smaller ones in one PUT.
PART_BYTES = 16 * 1024 * 1024
#: Parts uploaded at once: each holds PART_BYTES in memory.
PART_CONCURRENCY = 4
#: How long one call may keep retrying a store that fails or is away (5xx answers,
#: refused or dropped connections) before the persist fails with its reason; the
#: saver's next due step tries again.
RETRY_TIMEOUT_S = 60.0
_STEP = re.compile(r"^step-(\d+)$")


def _short(exc: BaseException) -> str:
    """The first line of an obstore error (the rest is the HTTP client's debug dump)."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class ObjectStorage(Storage):
    """Checkpoints under `url` (`s3://bucket/prefix`, `gs://...`, `az://...`)."""

    def __init__(self, url: str) -> None:
        from obstore.store import from_url

        self.url = url.rstrip("/")
        try:
            self.store: ObjectStore = from_url(
                self.url,
                retry_config={
                    "max_retries": 10,
                    "retry_timeout": timedelta(seconds=RETRY_TIMEOUT_S),
                },
            )
        except Exception as exc:  # obstore raises several kinds for a bad URL or config
            raise StorageError(
                f"cannot use {url} for checkpoints: {_short(exc)}; give s3://BUCKET/PREFIX, "
                "gs://BUCKET/PREFIX or az://CONTAINER/PREFIX, with credentials in the "
                "environment"
            ) from exc

    @property
    def location(self) -> str:
        return self.url

    def _fail(self, what: str, exc: BaseException) -> StorageError:
        return StorageError(
            f"could not {what} in {self.url}: {_short(exc)}; training goes on with "
            "in-memory checkpoints; check the bucket, the endpoint and the credentials"
        )

    # -- objects ---------------------------------------------------------------------

    def _put(self, path: str, chunks: list[memoryview | bytes]) -> None:
        import obstore

        size = sum(len(c) for c in chunks)
        if size <= PART_BYTES:
            obstore.put(self.store, path, b"".join(chunks), use_multipart=False)
        else:
            obstore.put(
                self.store,
                path,
                _parts(chunks, PART_BYTES),
                chunk_size=PART_BYTES,
                max_concurrency=PART_CONCURRENCY,
            )

    def _get(self, path: str) -> bytearray:
        """The object's bytes in one writable buffer (tensors can view it), filled as
        they arrive: one copy of the state in memory, not two."""
        import obstore

        result = obstore.get(self.store, path)
        out = bytearray(result.meta["size"])
        at = 0
        for chunk in result:
            view = memoryview(chunk)
            out[at : at + len(view)] = view
            at += len(view)
        if at != len(out):
            raise CheckpointError(f"{self.url}/{path}: read {at} of {len(out)} bytes")
        return out

    def _names(self, prefix: str | None) -> tuple[list[str], list[str]]:
        """(sub-prefixes, object names) directly under `prefix`."""
        import obstore

        found = obstore.list_with_delimiter(self.store, prefix)
        return list(found["common_prefixes"]), [o["path"] for o in found["objects"]]

    def _delete_step(self, step: int) -> None:
        import obstore

        _, names = self._names(_step_dir(step))
        if names:
            obstore.delete(self.store, names)

    # -- the port ----------------------------------------------------------------------

    def write(self, manifest: Manifest, parts: list[memoryview], torn: Callable[[], bool]) -> None:
        import obstore

        step, rank = manifest.step, manifest.rank
        data = f"{_step_dir(step)}/rank-{rank:05d}.ckpt"
        try:
            self._put(data, list(parts))
        except Exception as exc:
            raise self._fail(f"persist step {step} of rank {rank}", exc) from exc
        if torn():
            # the upload may hold a mix of two steps: no manifest names it, and it goes
            try:
                obstore.delete(self.store, data)
            except Exception:  # noqa: BLE001 - unnamed by any manifest, it is never loaded
                pass
            raise SlotOverwritten(overwritten(step, rank))
        try:
            self._put(f"{_step_dir(step)}/rank-{rank:05d}.json", [msgspec.json.encode(manifest)])
        except Exception as exc:
            raise self._fail(f"persist the manifest of step {step} rank {rank}", exc) from exc

    def persisted_ranks(self, step: int) -> set[int]:
        try:
            _, names = self._names(_step_dir(step))
        except Exception as exc:
            raise self._fail(f"list step {step}", exc) from exc
        stems = {n.rsplit("/", 1)[-1] for n in names}
        return {
            int(s.removeprefix("rank-").removesuffix(".json"))
            for s in stems
            if s.startswith("rank-")
            and s.endswith(".json")
            and s.removeprefix("rank-").removesuffix(".json").isdigit()
            and s.removesuffix(".json") + ".ckpt" in stems
        }

    def steps(self) -> list[int]:
        try:
            prefixes, _ = self._names(None)
        except Exception as exc:
            raise self._fail("list the steps", exc) from exc
        found = []
        for prefix in prefixes:
            match = _STEP.match(prefix.rstrip("/").rsplit("/", 1)[-1])
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def commit(self, step: int, keep: int, job: str | None = None) -> None:
        if step not in self.steps():
            raise CheckpointError(f"step {step} was never persisted; it cannot be committed")
        try:
            self._put("committed", [durable.Tracker(step, job).encode()])
        except Exception as exc:
            raise self._fail(f"mark step {step} committed", exc) from exc
        committed_or_older = [s for s in self.steps() if s <= step]
        for old in committed_or_older[: max(0, len(committed_or_older) - keep)]:
            try:
                self._delete_step(old)
            except Exception:  # noqa: BLE001 - an old step left behind is only space
                pass

    def tracker(self) -> durable.Tracker | None:
        try:
            raw = self._get("committed")
        except FileNotFoundError:
            return None  # nothing committed yet
        except Exception as exc:
            raise self._fail("read the committed step", exc) from exc
        return durable.Tracker.decode(raw)  # (no readable tracker: as on files)

    def discard_newer(self, step: int) -> list[int]:
        newer = [s for s in self.steps() if s > step]
        for s in newer:
            try:
                self._delete_step(s)
            except Exception as exc:
                raise self._fail(f"remove step {s} of an abandoned lineage", exc) from exc
        return newer

    def load(self, step: int, rank: int) -> Any:
        base = f"{_step_dir(step)}/rank-{rank:05d}"
        try:
            manifest = msgspec.json.decode(self._get(f"{base}.json"), type=Manifest)
            raw = self._get(f"{base}.ckpt")
        except FileNotFoundError as exc:
            raise CheckpointError(f"step {step} of rank {rank} is not in {self.url}") from exc
        except msgspec.DecodeError as exc:
            raise CheckpointError(f"the manifest of step {step} rank {rank} is unreadable") from exc
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(
                f"could not read step {step} of rank {rank} from {self.url}: {_short(exc)}"
            ) from exc
        return rebuild_verified(raw, manifest, step, rank, "object")

    def put_mark(self, job: str, raw: bytes) -> None:
        try:
            self._put(mark_name(job), [raw])
        except Exception as exc:
            raise self._fail(f"mark the location as job {job}'s", exc) from exc

    def marks(self) -> list[bytes]:
        found = []
        try:
            _, names = self._names(WRITERS)
            for name in sorted(names):
                with contextlib.suppress(FileNotFoundError):  # (removed as it was listed)
                    found.append(bytes(self._get(name)))
        except Exception as exc:
            raise self._fail("read the jobs' marks", exc) from exc
        return found

    def drop_mark(self, job: str) -> None:
        import obstore

        try:
            obstore.delete(self.store, mark_name(job))
        except FileNotFoundError:
            pass
        except Exception as exc:
            raise self._fail(f"remove job {job}'s mark", exc) from exc


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _parts(chunks: Iterable[memoryview | bytes], size: int) -> Iterable[bytes]:
    """`chunks` cut into pieces of `size` bytes (the last may be shorter): each part of a
    multipart upload but the last must be at least the store's minimum."""
    pending = bytearray()
    for chunk in chunks:
        view = memoryview(chunk)
        while len(view):
            take = min(size - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) == size:
                yield bytes(pending)
                pending.clear()
    if pending:
        yield bytes(pending)
