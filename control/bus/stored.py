"""A job that has ended, read from what it left on disk; and where a job on a shared NATS
ran (`remember_shared`, `shared_url`: read with no `--nats`).

A `--standalone` job keeps its whole event stream in its embedded server's store,
`ROVE_HOME/jobs/<job>/nats/jetstream`. While the job runs the CLI reads it through
that server (its URL in `nats.url`). Once the job has ended, or its launcher was
killed and left a `nats.url` that answers no more, a reader opens the stored stream
itself: `StoredJob.open()` copies the store to a scratch folder and the bus starts a
server of its own on the copy (loopback, a free port, the job's own credentials),
stopped and deleted when the reader closes it. Nothing a reader does is ever written
to the job's own store (a JetStream server writes its store as it starts).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from rove.control.bus import embedded
from rove.control.errors import ConfigError
from rove.control.process import logs, tempdirs

if TYPE_CHECKING:
    from rove.control.bus.options import BusOptions

log = logs.get("rove.stored")


def answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a server listens at `url` (a `nats.url` left by a killed launcher
    names a port that no one listens on any more)."""
    parts = urlsplit(url.split(",")[0].strip())
    address = (parts.hostname or "127.0.0.1", parts.port or 4222)
    try:
        with socket.create_connection(address, timeout_s):
            return True
    except OSError:
        return False


#: The shared NATS a job's node ran on from this machine (its folder's `shared-nats.url`).
SHARED_URL = "shared-nats.url"
_USERINFO = re.compile(r"://[^/,]*@")


def remember_shared(job: str, url: str) -> None:
    """Keep in `job`'s folder the shared NATS it runs on (`rove run --nats URL`), without
    the user and password a URL may hold: `rove status --job J`, `rove jobs` and the other
    readers find it there without `--nats` (they bring their own credentials)."""
    path = embedded.job_dir(job) / SHARED_URL
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_USERINFO.sub("://", url) + "\n")
    except OSError as exc:  # (a convenience: the job goes on without it)
        log.info("could not keep the job's NATS URL", job=job, error=str(exc))


def forget_shared(job: str) -> None:
    """`job` runs on a server of this machine now (`rove run --standalone`): the shared
    NATS an earlier run of its name ran on is no longer where the readers look."""
    with contextlib.suppress(OSError):
        (embedded.job_dir(job) / SHARED_URL).unlink(missing_ok=True)


def shared_url(job: str) -> str | None:
    """The shared NATS `job` ran on from this machine (None: none kept)."""
    try:
        return (embedded.job_dir(job) / SHARED_URL).read_text().strip() or None
    except OSError:
        return None


def running_url(job: str) -> str | None:
    """The URL of `job`'s embedded server if it still answers; a stale `nats.url`
    (its server gone with a killed launcher) is removed."""
    url = embedded.recorded_url(job)
    if url is None:
        return None
    if answers(url):
        return url
    log.debug("a stale nats.url: its server is gone", job=job, url=url)
    embedded.url_file(job).unlink(missing_ok=True)
    return None


@dataclass(frozen=True)
class StoredJob:
    """The stored stream of an ended job on this machine."""

    job: str
    store: Path  # ROVE_HOME/jobs/<job>/nats

    @classmethod
    def find(cls, job: str) -> StoredJob | None:
        store = embedded.job_store(job)
        return cls(job, store) if (store / "jetstream").is_dir() else None

    @property
    def auth_config(self) -> Path | None:
        path = embedded.job_dir(self.job) / "auth" / "nats-auth.conf"
        return path if path.is_file() else None

    def credentials(self, role: str) -> Path | None:
        path = embedded.job_dir(self.job) / "auth" / f"{role}.json"
        return path if path.is_file() else None

    def open(self) -> Path:
        """A scratch copy of the store, for a server of the reader's own (the caller
        deletes it: `discard`).

        Raises:
            ConfigError: the store cannot be copied (unreadable, or half deleted).
        """
        scratch = tempdirs.make(f"rove-read-{self.job}")
        try:
            shutil.copytree(self.store / "jetstream", scratch / "jetstream")
        except (OSError, shutil.Error) as exc:
            discard(scratch)
            raise ConfigError(
                f"job {self.job!r} has ended and its stored events under {self.store} "
                f"cannot be read: {exc}"
            ) from exc
        return scratch


def discard(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)


def discard_read_copy(options: BusOptions) -> None:
    """Delete the scratch copy of an ended job's store that `options` read from."""
    if options.stored_job is not None and options.embedded_dir is not None:
        discard(options.embedded_dir)
