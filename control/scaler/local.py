"""The `local` backend: every node is a `rove run` process on this machine.

Each node runs in its own session (a process group), with a memory limit from
its plan: cgroup v2 `memory.max` in a child cgroup where this process may
create one, else `RLIMIT_AS` on every process of the node (the address space,
a looser bound than resident memory: it is what this machine allows). A worker
that allocates past the limit fails with an out-of-memory error, which the
agent diagnoses as `oom`, so "OOM -> more memory" really happens here.

At most once: before starting node N the backend writes a marker
`<state>/<job>/N.json` with O_EXCL; a marker means N was created. A scaler
killed between the marker and the spawn leaves a marker saying "spawning";
a restarted scaler looks for N's process (by its command line) and starts it
only if there is none. Nodes outlive the scaler (a restarted one adopts them),
unless `die_with_parent` (the in-process scaler of `rove run --auto-scale`,
whose nodes also write to its console; otherwise each node logs to
`<state>/<job>/N.log`).

With `standby` (a pool agent's backend) one node process is kept ready while none
runs: `prepare()` starts `rove.agent.standby`, which imports what `rove run` needs and
starts its full warm server, and the next launch hands it the node's arguments
instead of starting a process (a node started that way is found through its process
object, not its command line: only the backend that started it adopts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import psutil
import structlog

from rove.control.bus import embedded
from rove.control.catalogue import events as ev
from rove.control.errors import PermanentError, TemporaryError
from rove.control.process import cgroups
from rove.control.scaler import standby as standby_node
from rove.control.scaler.backend import Backend, Ended, NodeInfo, last_line

log = structlog.get_logger("rove.scaler.local")

_MODULE = "rove.control.cli.main"
#: The least time between two standby processes (one that dies at once is not a loop).
STANDBY_RESPAWN_S = 10.0
#: Standby processes that may end unasked before the backend stops making them.
STANDBY_TRIES = 3


class _Marker(msgspec.Struct, kw_only=True):
    node: str
    state: str  # "spawning" | "spawned"
    pid: int = 0
    started: float = 0.0
    limit: str = ""


def node_command(
    python: str, job: str, node: str, nats_url: str, argv: tuple[str, ...]
) -> list[str]:
    """The command line of a local node (its first 8 items identify it)."""
    return [
        python,
        "-m",
        _MODULE,
        "run",
        "--job",
        job,
        "--node-id",
        node,
        "--nats",
        nats_url,
        *argv,
    ]


def _identity(cmdline: list[str]) -> tuple[str, str] | None:
    if (
        len(cmdline) >= 8
        and cmdline[1:4] == ["-m", _MODULE, "run"]
        and (cmdline[4], cmdline[6]) == ("--job", "--node-id")
    ):
        return cmdline[5], cmdline[7]
    return None


def _cgroup_root() -> Path | None:
    """Our cgroup v2 directory if a child cgroup with a memory limit can be made there."""
    root = cgroups.own_dir()
    try:
        if root is None or "memory" not in (root / "cgroup.subtree_control").read_text().split():
            return None
    except OSError:
        return None
    return root if os.access(root, os.W_OK) else None


class LocalBackend(Backend):
    name = "local"

    def __init__(
        self,
        nats_url: str,
        *,
        state_dir: Path | None = None,
        die_with_parent: bool = False,
        grace_s: float = 20.0,
        python: str = sys.executable,
        use_cgroup: bool = True,
        console: bool = False,
        node_auth: Callable[[str, str], Awaitable[list[str]]] | None = None,
        standby: bool = False,
    ) -> None:
        self.nats_url = nats_url
        #: `(job, node)` → the node's credentials arguments (`--nats-auth ...`), made
        #: before it starts (a closed standalone job's server learns each node's key)
        self.node_auth = node_auth
        self.state_dir = state_dir
        self.die_with_parent = die_with_parent
        self.grace_s = grace_s
        self.python = python
        self.console = console
        self._cgroup = _cgroup_root() if use_cgroup else None
        self._children: dict[tuple[str, str], subprocess.Popen[bytes]] = {}
        self._adopted: dict[tuple[str, str], psutil.Process] = {}
        self._reported: set[tuple[str, str]] = set()
        self.standby = standby
        self._standby: subprocess.Popen[bytes] | None = None
        self._standby_ready: Path | None = None
        self._standby_failures = 0
        self._standby_at = -STANDBY_RESPAWN_S

    # ------------------------------------------------------------------ files

    def _dir(self, job: str) -> Path:
        base = self.state_dir if self.state_dir is not None else embedded.job_dir(job) / "scaler"
        path = base / job if self.state_dir is not None else base
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _marker_path(self, job: str, node: str) -> Path:
        return self._dir(job) / f"{node}.json"

    def log_path(self, job: str, node: str) -> Path:
        return self._dir(job) / f"{node}.log"

    def _read(self, job: str, node: str) -> _Marker | None:
        try:
            return msgspec.json.decode(self._marker_path(job, node).read_bytes(), type=_Marker)
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as exc:
            raise PermanentError(
                f"cannot read the marker of node {node} ({self._marker_path(job, node)}): {exc}; "
                "remove the file if that node is not running"
            ) from exc

    def _write(self, job: str, marker: _Marker, *, exclusive: bool = False) -> bool:
        path = self._marker_path(job, marker.node)
        data = msgspec.json.encode(marker)
        if exclusive:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return True
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
        return True

    # ------------------------------------------------------------------ processes

    def _scan(self, job: str) -> dict[str, psutil.Process]:
        found = {}
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                ident = _identity(proc.info["cmdline"] or [])
                if ident is not None and ident[0] == job and proc.status() != psutil.STATUS_ZOMBIE:
                    found[ident[1]] = proc
        return found

    def _pid(self, job: str, node: str) -> int | None:
        child = self._children.get((job, node))
        if child is not None:
            return child.pid if child.poll() is None else None
        proc = self._scan(job).get(node)
        return proc.pid if proc is not None else None

    def _spawn(
        self, job: str, spec: ev.NodeLaunch, workload: ev.Workload, auth_args: list[str]
    ) -> tuple[int, str]:
        memory = spec.resources.memory_bytes
        cgroup = None
        limit = "no memory limit"
        if memory and self._cgroup is not None:
            try:
                cgroup = self._cgroup / f"rove-{job}-{spec.node}"
                cgroup.mkdir(exist_ok=True)
                (cgroup / "memory.max").write_text(str(memory))
                limit = f"memory.max {memory / ev.GIB:.3g} GiB"
            except OSError as exc:
                log.warning(
                    "no cgroup for the node; using RLIMIT_AS", node=spec.node, error=str(exc)
                )
                cgroup = None
        if memory and cgroup is None:
            limit = f"RLIMIT_AS {memory / ev.GIB:.3g} GiB per process"
        die = self.die_with_parent

        def preexec() -> None:  # in the child, between fork and exec
            if die:
                embedded.die_with_parent()
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text("0")
            elif memory:
                resource.setrlimit(resource.RLIMIT_AS, (memory, memory))

        cmd = node_command(
            self.python, job, spec.node, self.nats_url, (*auth_args, *ev.node_argv(workload, spec))
        )
        ready = self._take_standby()
        if ready is not None:
            assignment = standby_node.Assignment(
                argv=tuple(cmd[4:]),
                cwd=workload.cwd,
                log=None if self.console else str(self.log_path(job, spec.node)),
                cgroup=str(cgroup) if cgroup is not None else None,
                memory=memory if cgroup is None else 0,
            )
            try:
                assert ready.stdin is not None
                ready.stdin.write(standby_node.encode(assignment))
                ready.stdin.close()
            except OSError as exc:  # it died since it was looked at: a process as usual
                log.warning("the standby node could not take the node", error=str(exc))
            else:
                self._children[(job, spec.node)] = ready
                return ready.pid, f"{limit}, from a standby"
        # the node's output: this process's console (`rove run --auto-scale`), or a file
        logf = None if self.console else open(self.log_path(job, spec.node), "ab")  # noqa: SIM115
        try:
            child = subprocess.Popen(
                cmd,
                cwd=workload.cwd or None,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=None if logf is None else subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,  # only a prctl, a setrlimit or one write
            )
        except OSError as exc:
            raise PermanentError(
                f"cannot start node {spec.node}: {exc} (command: {cmd[:4]} ...)"
            ) from exc
        finally:
            if logf is not None:
                logf.close()
        self._children[(job, spec.node)] = child
        return child.pid, limit

    # ------------------------------------------------------------------ the standby

    def prepare(self) -> None:
        """(`standby`) A standby node ready for the next launch, unless one is (or one was
        started in the last `STANDBY_RESPAWN_S`)."""
        if not self.standby or (self._standby is not None and self._standby.poll() is None):
            return
        folder = self.state_dir if self.state_dir is not None else embedded.rove_home() / "pool"
        if self._standby is not None:  # it ended unasked
            self._standby_failures += 1
            code = self._standby.poll()
            self._standby = None
            if self._standby_failures >= STANDBY_TRIES:
                self.standby = False
                log.error(
                    f"standby nodes are off: {STANDBY_TRIES} ended unasked (the last with "
                    f"{code}); nodes start as new processes. See {folder / 'standby.log'}"
                )
                return
            log.warning("the standby node ended unasked", exit_code=code)
        if time.monotonic() - self._standby_at < STANDBY_RESPAWN_S:
            return
        self._standby_at = time.monotonic()
        folder.mkdir(parents=True, exist_ok=True)
        die = self.die_with_parent
        self._standby_ready = folder / f"standby-{os.getpid()}-{self._standby_at:.3f}.ready"
        self._standby_ready.unlink(missing_ok=True)
        with open(folder / "standby.log", "ab") as out:
            self._standby = subprocess.Popen(
                [self.python, "-m", standby_node.MODULE],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=embedded.die_with_parent if die else None,
                env={**os.environ, standby_node.READY_ENV: str(self._standby_ready)},
            )
        log.info("a standby node is getting ready", pid=self._standby.pid)

    def standby_ready(self) -> bool:
        """Whether a standby node waits with its warm server ready."""
        alive = self._standby is not None and self._standby.poll() is None
        return alive and self._standby_ready is not None and self._standby_ready.exists()

    def _take_standby(self) -> subprocess.Popen[bytes] | None:
        if self._standby_ready is not None:
            self._standby_ready.unlink(missing_ok=True)
            self._standby_ready = None
        ready, self._standby = self._standby, None
        if ready is not None and ready.poll() is None:
            return ready
        return None

    def _drop_standby(self) -> None:
        ready = self._take_standby()
        if ready is None:
            return
        with contextlib.suppress(OSError):
            assert ready.stdin is not None
            ready.stdin.close()  # it leaves at once once it reads the end
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ready.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            ready.wait(self.grace_s)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(ready.pid, signal.SIGKILL)
        ready.wait()

    # ------------------------------------------------------------------ the port

    async def launch(
        self, job: str, spec: ev.NodeLaunch, workload: ev.Workload, deadline: float
    ) -> str:
        marker = _Marker(node=spec.node, state="spawning")
        if not self._write(job, marker, exclusive=True):
            old = self._read(job, spec.node)
            if old is not None and old.state == "spawned":
                return f"pid {old.pid} (created before)"
            pid = self._pid(job, spec.node)
            if pid is not None:  # spawned, then the scaler died before it could say so
                self._write(job, _Marker(node=spec.node, state="spawned", pid=pid))
                return f"pid {pid} (found running)"
        if time.monotonic() > deadline:
            raise TemporaryError(f"no time left to start node {spec.node}")
        auth_args = await self.node_auth(job, spec.node) if self.node_auth is not None else []
        pid, limit = self._spawn(job, spec, workload, auth_args)
        self._write(
            job, _Marker(node=spec.node, state="spawned", pid=pid, started=time.time(), limit=limit)
        )
        log.info("node started", job=job, node=spec.node, pid=pid, limit=limit)
        return f"pid {pid}, {limit}"

    async def remove(self, job: str, node: str, deadline: float) -> None:
        pid = self._pid(job, node)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        stop_by = min(deadline, time.monotonic() + self.grace_s)
        while time.monotonic() < stop_by:
            if self._pid(job, node) is None:
                return
            await asyncio.sleep(0.1)
        log.warning("node did not stop in time: killing it", job=job, node=node, pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        child = self._children.get((job, node))
        if child is not None:
            await asyncio.to_thread(child.wait)

    async def nodes(self, job: str) -> list[NodeInfo]:
        out = []
        running = self._scan(job)
        for path in sorted(self._dir(job).glob("*.json")):
            marker = self._read(job, path.stem)
            if marker is None:
                continue
            child = self._children.get((job, marker.node))
            code = child.poll() if child is not None else None
            alive = code is None if child is not None else marker.node in running
            out.append(
                NodeInfo(
                    node=marker.node,
                    where=f"pid {marker.pid}" if marker.pid else "never started",
                    running=alive,
                    exit_code=code,
                )
            )
        return out

    async def ended(self, job: str) -> list[Ended]:
        out = []
        for (j, node), child in list(self._children.items()):
            if j != job or (j, node) in self._reported:
                continue
            code = child.poll()
            if code is not None:
                self._reported.add((j, node))
                # (its last line says why it exited with a code; not a signal's kill)
                said = _last_line(self.log_path(j, node)) if 0 < code < 128 else ""
                reason = _exit_text(code) + (f": {said}" if said else "")
                out.append(Ended(node=node, reason=reason, exit_code=code))
        # nodes a restarted scaler adopted: no exit code, only that they are gone
        for path in self._dir(job).glob("*.json"):
            key = (job, path.stem)
            if key in self._children or key in self._reported:
                continue
            marker = self._read(job, path.stem)
            if marker is None or marker.state != "spawned":
                continue
            proc = self._adopted.get(key)
            if proc is None:
                with contextlib.suppress(psutil.Error):
                    proc = psutil.Process(marker.pid)
                    if _identity(proc.cmdline()) == (job, marker.node):
                        self._adopted[key] = proc
                        continue
                self._reported.add(key)
                out.append(Ended(node=marker.node, reason="its process is gone"))
            elif not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE:
                self._reported.add(key)
                out.append(Ended(node=marker.node, reason="its process is gone"))
        return out

    async def close(self) -> None:
        for child in self._children.values():
            child.poll()  # reap what ended; running nodes keep running
        await asyncio.to_thread(self._drop_standby)


def _last_line(path: Path) -> str:
    """The last line a node wrote to its log (`rove run`'s refusal, a traceback's last
    line), "" for none (its output went to the console, or nothing was written)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    return last_line(tail)


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"its process was killed by {signal.Signals(-code).name}"
    return f"its process exited with code {code}"
