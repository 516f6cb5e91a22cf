"""Durable TensorFlow checkpoints with rove's commit rule, for a TF2 coordinator.

    from rove.checkpoint.tf import TfCheckpointer

    ckpt = TfCheckpointer(tf.train.Checkpoint(model=model, optimizer=opt))
    restored = ckpt.restore()            # the newest committed step that verifies, or None
    ...
    ckpt.save(step, extra={"data": feed.state_dict()})

With `ParameterServerStrategy` the variables live on the parameter servers and
the coordinator saves them all (`tf.train.Checkpoint.write` reads them over
gRPC). A save follows the layout of every rove checkpoint
(`rove.checkpoint.durable`):

    step-00000120/ckpt.index, ckpt.data-00000-of-00001   TensorFlow's files
    step-00000120/manifest.json   sizes and xxh3 checksums of those, and `extra`
    committed                     {"step": 120}

Everything is written into a temporary directory, every file fsynced, the
directory renamed into place and fsynced, and only then is the step marked
committed: the coordinator is the only writer, so a step is committed once
all of it is durable. A crash at any point leaves the previous committed step
whole. `restore()` loads the newest committed step whose files match their
manifest, falling back to older ones (logged) when one is torn; `extra` (the
data position) comes back with it.

`directory` defaults to `$ROVE_CKPT_DIR/tf` (`rove run --checkpoint-dir`).

With variables on other tasks, TensorFlow traces its saver's function anew at every
save, by design (`MultiDeviceSaver.save`: "this will cause a function re-trace on each
save ... needed to ensure we pick up the latest values of options"), and from the fifth
save on warns, twice a save, that "tracing is expensive": that one warning is kept off
the console (`_SaverRetraces`); every other TensorFlow line is left as it is.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

from rove.agent import progress
from rove.checkpoint import durable
from rove.checkpoint.durable import CheckpointError

log = logging.getLogger("rove.checkpoint")

_PREFIX = "ckpt"


class _SaverRetraces(logging.Filter):
    """Drops TensorFlow's retracing warning about its own saver's per-save function."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "MultiDeviceSaver.save.<locals>.tf_function_save" not in record.getMessage()


_QUIET_SAVER = _SaverRetraces()


class Restored(NamedTuple):
    step: int
    extra: dict[str, Any]


class Saved(NamedTuple):
    step: int
    path: Path
    seconds: float  # the coordinator was blocked this long (write, checksum, fsync)


class TfCheckpointer:
    def __init__(
        self, checkpoint: Any, directory: str | Path | None = None, *, keep: int = 3
    ) -> None:
        if directory is None:
            base = os.environ.get("ROVE_CKPT_DIR")
            if not base:
                raise CheckpointError(
                    "TfCheckpointer needs a directory: pass one, or run under `rove run "
                    "--checkpoint-dir DIR`, which sets ROVE_CKPT_DIR"
                )
            if durable.is_url(base):
                raise CheckpointError(
                    f"TfCheckpointer writes TensorFlow's checkpoint files to a directory, and "
                    f"ROVE_CKPT_DIR is an object store ({base}): pass TfCheckpointer a "
                    "directory on a volume every chief can reach"
                )
            directory = Path(base) / "tf"
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.checkpoint = checkpoint
        self.root = Path(directory)
        self.keep = keep
        # (a logger adds a filter once, however many checkpointers add it)
        logging.getLogger("tensorflow").addFilter(_QUIET_SAVER)

    def save(self, step: int, extra: dict[str, Any] | None = None) -> Saved:
        """Write, verify and commit `step` (blocking).

        Raises:
            CheckpointError: the files could not be written (disk full, unwritable
                directory); the previous committed step is untouched.
        """
        began = time.monotonic()
        final = durable.step_dir(self.root, step)
        tmp = self.root / f".tmp-step-{step:08d}-{os.getpid()}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            self.checkpoint.write(str(tmp / _PREFIX))
            files = {}
            for path in sorted(tmp.iterdir()):
                files[path.name] = {"size": path.stat().st_size, "xxh3": _checksum(path)}
                durable.fsync_file(path)
            manifest = {"step": step, "files": files, "extra": extra or {}}
            durable.write_atomic(tmp / "manifest.json", [json.dumps(manifest).encode()])
            durable.fsync_dir(tmp)
            if final.exists():  # a step saved again (a restored lineage reaches it anew)
                shutil.rmtree(final)
            tmp.rename(final)
            durable.fsync_dir(self.root)
            durable.mark_committed(self.root, step)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(
                f"could not save TensorFlow checkpoint step {step} in {self.root}: {exc} "
                "(free some space or choose another --checkpoint-dir; the last committed "
                "step is intact)"
            ) from exc
        self._prune(step)
        progress.checkpoint_blocked(time.monotonic() - began)
        return Saved(step, final, time.monotonic() - began)

    def _prune(self, newest: int) -> None:
        old = [s for s in durable.steps(self.root) if s < newest]
        for step in old[: max(0, len(old) - (self.keep - 1))]:
            shutil.rmtree(durable.step_dir(self.root, step), ignore_errors=True)
        for stray in self.root.glob(".tmp-step-*"):
            if not stray.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stray, ignore_errors=True)  # left by a crashed save

    def committed(self) -> int | None:
        return durable.committed(self.root)

    def restore(self) -> Restored | None:
        """Load the newest committed step whose files verify (None: nothing to restore)."""
        newest = durable.committed(self.root)
        if newest is None:
            return None
        began = time.monotonic()
        tried = []
        for step in reversed([s for s in durable.steps(self.root) if s <= newest]):
            problem, extra = self._verify(step)
            if problem is None:
                status = self.checkpoint.read(str(durable.step_dir(self.root, step) / _PREFIX))
                status.expect_partial()  # optimizer slots are created on the first step
                progress.restored(time.monotonic() - began, step)
                return Restored(step, extra)
            log.warning("checkpoint step %s is not usable (%s); trying an older one", step, problem)
            tried.append(f"step {step}: {problem}")
        raise CheckpointError(
            f"no committed TensorFlow checkpoint in {self.root} verifies ({'; '.join(tried)}): "
            "remove the directory to start over"
        )

    def _verify(self, step: int) -> tuple[str | None, dict[str, Any]]:
        directory = durable.step_dir(self.root, step)
        try:
            manifest = json.loads((directory / "manifest.json").read_text())
        except (OSError, ValueError) as exc:
            return f"no readable manifest: {exc}", {}
        for name, want in manifest["files"].items():
            path = directory / name
            if not path.is_file() or path.stat().st_size != want["size"]:
                return f"{name} is missing or truncated", {}
            if _checksum(path) != want["xxh3"]:
                return f"{name} failed its checksum", {}
        return None, dict(manifest.get("extra") or {})


def _checksum(path: Path) -> int:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.intdigest()
