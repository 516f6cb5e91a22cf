"""The warm servers workers are forked from: multiprocessing forkservers that imported
torch once (stdlib only, so `rove run` can start one before it imports torch itself).

Two servers, so that neither the first line nor a restart waits:

- the *quick* server imports what a script needs before its first line (torch, and the
  few rove modules a worker runs): `rove run` starts it first thing, so it imports
  while the launcher imports torch for its own parser and the round forms (both take
  about 2 s here; torchrun's workers import torch only after its launcher did);
- the *full* server also imports what a restart would otherwise import again (DDP's
  `torch._dynamo`, about 1.6 s, the checkpoint API, rove's data client, `--preload`
  modules). It is forked from the quick one once that one is ready (torch imported
  once per node, not twice: 2.3 CPU-seconds a node here; `rove.agent.server_fork`),
  and imports the rest in a thread at nice 19 (`BACKGROUND_NICE`), so it only takes CPU
  that training and the launcher leave (a short job beside a busy core paid 1.5 s
  for it at normal priority); the thread that forks keeps the server's nice 0,
  and so do its workers. Every round formed once it is ready is forked from it, and
  the quick one is then stopped. Where training keeps every core busy (CPU training)
  a nice-19 thread may never get to run: a full server not ready `NICE_FOR_S` after it
  started imports on at normal priority (`escalate`: its import thread and its session
  reniced in place, where rove may raise a priority: root, CAP_SYS_NICE), or else is
  replaced by one that imports at normal priority from the start, so no job recovers
  from the quick server for its whole life. (Replacing it threw away what it had
  imported: a third of the agents of a slow test run here escalated.)

- a *learned* server (`learn`, `rove.agent.imports`) also imports what the workers
  imported beyond the server they were forked from (an HF script's `transformers` and
  its dependencies: 2-3 s a restart paid again). It starts once the workers' lists are
  in and the full server is ready to compare with, is forked from it, imports in the
  background as the full one does (hurried the same way where the cores are busy),
  and once ready takes the full one's place as the one restarts fork from (the full
  one is stopped then). A module it must not import (it starts a thread or a process,
  initialises CUDA, or reads a variable each worker has its own value of) is refused
  by name: that server never serves, and the next one learns without that module's package.

Where `rove run` did not start a quick server (a managed node, a test), the agent
starts the full one afresh as its first round forms; so does a Python whose forkserver
`rove.agent.server_fork` does not know (3.14 on). A pool agent's standby node
(`rove.agent.standby`) calls `start` before any job needs it: the full one, at normal
priority (nothing else runs on an idle pool agent).

A forked worker does not run the launcher's main module again (multiprocessing does
that for every child of a forkserver: 0.5 s per worker for the `rove` command):
`rove.agent.warm_ready`, imported last by each server, makes the server's `__main__`
stand for the launcher's, and says the server is ready.

multiprocessing keeps one forkserver per process behind module-level functions; the
servers here are its own `ForkServer` objects, and the one that serves is installed in
their place (`_install`): private to CPython's multiprocessing, and checked by
`tests/test_warm.py` on the Python that runs them.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.forkserver as mpfs
import os
import shutil
import signal
from collections.abc import Sequence
from multiprocessing import util
from pathlib import Path
from typing import Any, NamedTuple

from rove.agent import imports, server_fork, server_spawn
from rove.agent.imports import top
from rove.control.domain.words import counted
from rove.control.errors import plain
from rove.control.process import tempdirs

#: What a worker needs before its script's first line.
QUICK = (
    "torch",
    "torch.distributed",
    "rove.agent.warm",
    "rove.agent.script",
    "rove.agent.groups",
    "rove.agent.progress",
)
#: And what a restart should find imported already.
FULL = (
    *QUICK,
    "torch.nn.parallel",
    "torch._dynamo",  # DDP imports it on construction: about 1.6 s
    "torch.distributed.elastic.multiprocessing",
    "rove.checkpoint.api",
    # rove's data client (with nats-py, aiohttp, prometheus_client: about 180 modules,
    # 0.4-0.6 s): examples/train.py on leased shards restarted in 0.8-0.9 s without it
    # here, 0.4 s with it
    "rove.shard_service.sampler",
    "rove.shard_service.client",
)
#: Imported last by every server: it is ready (and its __main__ is the launcher's).
READY_MODULE = "rove.agent.warm_ready"
READY_ENV = "ROVE_WARM_READY_FILE"
#: What a server in the background imports itself, at which nice (rove.agent.warm_ready).
IMPORTS_ENV = "ROVE_WARM_IMPORTS"
NICE_ENV = "ROVE_WARM_NICE"
#: Where a server importing in the background says its import thread's id.
IMPORTER_ENV = "ROVE_WARM_IMPORTER_FILE"
#: Where a learning server finds what the workers imported (`rove.agent.imports`).
LEARNED_ENV = "ROVE_WARM_LEARNED_FILE"
#: The fewest new modules worth a server that learns them: it is one more process (and
#: imports torch again where it cannot be forked: a few CPU-seconds); fewer modules
#: import in a fraction of a second (2-12 ms each here: 79 of aiohttp's in 0.2 s; an
#: HF script's 550 in 2.4 s).
LEARN_AT_LEAST = 100
#: The most servers that learn a process starts (each one more process, importing in
#: the background): the first round's lists, and a retry or two without a refused package.
MAX_LEARNING = 3
BACKGROUND_NICE = 19
#: How long the full server may import at BACKGROUND_NICE before one at normal priority
#: replaces it (longer than a short job's life after its agent started, here 5-9 s).
NICE_FOR_S = 15.0
#: How often the agent looks whether the quick server is ready to fork the full one from.
READY_POLL_S = 0.2
#: How long `kill` waits for a forked server to be gone (SIGKILL: at once, in practice).
KILL_WAIT_S = 5.0

#: Flags of `rove run` under which no warm server is wanted (or no job runs).
_NOT_WARM = frozenset(
    {
        "--no-warm-start",
        "--no_warm_start",
        "--no-python",
        "--no_python",
        "--tf-ps",
        "--tf_ps",
        "--auto-scale",
        "--auto_scale",
        "-h",
        "--help",
    }
)


class _Server:
    """One forkserver of ours: multiprocessing's object and where it says it is ready."""

    def __init__(
        self,
        preload: Sequence[str],
        kind: str,
        *,
        nice: int = 0,
        learned: Sequence[str] = (),
        worker_keys: Sequence[str] = (),
        base: _Server | None = None,
    ) -> None:
        """`nice`: above 0, the server imports `preload` in a thread at that nice, then
        `learned` with care (`rove.agent.imports.take`; `worker_keys`: the variables
        each worker has its own value of). `base`: a ready server to fork this one from
        (`rove.agent.server_fork`), where this Python allows; else it starts afresh."""
        self.kind = kind
        self.nice = nice
        self.preload = tuple(preload)
        self.learned = tuple(learned)
        self._dir = tempdirs.make(f"rove-warm-{kind}")
        self.ready_file = self._dir / "ready"
        self.importer_file = self._dir / "importer"
        self.refusal_file = self._dir / "refused"
        self._modules: frozenset[str] | None = None
        # (Any: its private attributes, read and reset here, are not in typeshed)
        learned_file = self._dir / "learned"
        if self.learned:
            learned_file.write_text(
                json.dumps({"modules": self.learned, "worker_keys": list(worker_keys)})
            )
        server_spawn.own_mp_tempdir()
        if base is not None and base.ready() and server_fork.supported():
            serving = server_fork.Serving(
                self.preload,
                nice,
                str(self.importer_file),
                str(learned_file) if self.learned else None,
                str(self.ready_file),
            )
            try:
                self.server: Any = server_fork.fork(
                    base.server, serving, [*self.preload, READY_MODULE]
                )
                return
            except OSError:
                pass  # (the base server is gone meanwhile: one starts afresh)
        self.server = mpfs.ForkServer()
        env = {READY_ENV: str(self.ready_file), **server_spawn.main_marker()}
        if nice > 0:
            env |= {
                IMPORTS_ENV: ",".join(self.preload),
                NICE_ENV: str(nice),
                IMPORTER_ENV: str(self.importer_file),
            }
            if self.learned:
                env[LEARNED_ENV] = str(learned_file)
            self.server.set_forkserver_preload([READY_MODULE])
        else:
            assert not self.learned, "a server learns in the background"
            self.server.set_forkserver_preload([*self.preload, READY_MODULE])
        with server_spawn.environ(env), server_spawn.deaf_to_hangups():
            self.server.ensure_running()  # (and multiprocessing's resource tracker, once)

    @property
    def pid(self) -> int | None:
        pid: int | None = self.server._forkserver_pid
        return pid

    def ready(self) -> bool:
        """Whether it imported everything and serves (never blocks)."""
        return self.ready_file.exists()

    def modules(self) -> frozenset[str]:
        """The modules a ready server imported (what its workers find imported)."""
        if self._modules is None and self.ready():
            try:
                names = json.loads(self.ready_file.read_text())["modules"]
                self._modules = frozenset(n for n in names if isinstance(n, str))
            except (OSError, ValueError, TypeError, KeyError):
                self._modules = frozenset()
        return self._modules or frozenset()

    def refused(self) -> tuple[str, str] | None:
        """(package, why) when this learning server refused a module it was to import
        (it never serves), or ("", why) when it ended before it was ready."""
        try:
            said = json.loads(self.refusal_file.read_text())
            return str(said["culprit"]), str(said["why"])
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, KeyError):
            return "", "it said it refused a module, unreadably"
        pid = self.pid
        if pid is None or self.ready():
            return None
        if isinstance(self.server, server_fork.ForkedServer):
            if not self.server.ended():
                return None
            code = self.server.exit_code()
            return "", "it ended before it was ready" + (
                "" if code is None else f" ({_code(code)})"
            )
        try:
            ended, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None  # (not this process's child: nothing to tell)
        if ended == 0:
            return None
        self.server._forkserver_pid = None
        return "", f"it ended before it was ready ({_status(status)})"

    def hurry(self) -> bool:
        """Raise its background import to normal priority in place: its import thread's
        nice, and its session's where the kernel groups tasks by session. False where
        that is not allowed (raising a priority takes root or CAP_SYS_NICE) or the
        thread is not known (yet)."""
        pid = self.pid
        try:
            tid = int(self.importer_file.read_text())
        except (OSError, ValueError):
            return False
        if pid is None or not Path(f"/proc/{pid}/task/{tid}").exists():
            return False
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 0)
            Path(f"/proc/{pid}/autogroup").write_text("0")
        except FileNotFoundError:
            pass  # no autogroups here: the thread's own nice is what counts
        except OSError:
            return False
        self.nice = 0
        return True

    def kill(self) -> None:
        """End it now (its workers die with it: they ask for SIGKILL when it dies)."""
        pid, alive = self.server._forkserver_pid, self.server._forkserver_alive_fd
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # (a forked one is its parent server's to reap)
        if isinstance(self.server, server_fork.ForkedServer):
            self.server.ended(wait_s=KILL_WAIT_S)  # (gone, as waitpid would have it)
            self.server.release()  # (its alive pipe among what it closes)
            alive = None
        if alive is not None:
            with contextlib.suppress(OSError):
                os.close(alive)
        address = self.server._forkserver_address
        if address and not util.is_abstract_socket_namespace(address):
            with contextlib.suppress(OSError):
                Path(address).unlink()
        self.server._forkserver_pid = self.server._forkserver_alive_fd = None
        self.server._forkserver_address = None
        shutil.rmtree(self._dir, ignore_errors=True)


def _status(status: int) -> str:
    return _code(os.waitstatus_to_exitcode(status))


def _code(code: int) -> str:
    """An exit code as multiprocessing gives it (a signal's negated)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


class _Servers:
    """This process's warm servers: the one that serves, the full one to come, and one
    learning what the workers imported (which takes the full one's place once ready)."""

    def __init__(self) -> None:
        self.serving: _Server | None = None
        self.coming: _Server | None = None
        self.learning: _Server | None = None
        #: the full server's preload, while it waits for the quick one to fork from
        self.wanted: tuple[str, ...] | None = None
        self.extra: tuple[str, ...] = ()
        #: packages a learning server refused (never learned again by this process)
        self.refused: set[str] = set()
        #: modules a learning server was given (one it could not import is not given again)
        self.tried: set[str] = set()
        self.learners = 0

    def install(self, server: _Server) -> None:
        """Make `server` the one multiprocessing's "forkserver" context forks from."""
        _install(server.server)
        self.serving = server


_servers = _Servers()


def early_start(argv: Sequence[str]) -> bool:
    """`rove run ARGS`, before anything else: start the quick server now, unless the
    arguments say warm start is off (then the launcher stops one it would not use)."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("-")}
    if flags & _NOT_WARM or os.environ.get("PYTHON_EXEC"):
        return False
    if not any(not a.startswith("-") for a in argv):
        return False  # no script: the parser will say so (a flag's value passes this)
    if _servers.serving is None:
        _servers.install(_Server(QUICK, "quick"))
    return True


def start(extra: Sequence[str] = ()) -> None:
    """The agent starts: a server to fork its first round from (a quick one that
    `rove run` started, or else the full one now), and the full one in the background;
    `extra`: `--preload` modules, for the full server."""
    _servers.extra = tuple(extra)
    full = (*FULL, *_servers.extra)
    if _servers.serving is None:
        _servers.install(_Server(full, "full"))
    elif _servers.serving.kind == "quick" and _servers.coming is None:
        _servers.wanted = full
        _start_full()


def _start_full() -> None:
    """The full server, forked from the quick one once that one is ready (it has torch
    imported: a fork costs milliseconds where a fresh server imports torch again, 2-3
    CPU-seconds; `rove.agent.server_fork`). Until then the event loop looks again every
    READY_POLL_S; where there is no loop to look again, or the quick server ended, or
    forking a server is not possible here, the full one starts afresh now."""
    wanted, quick = _servers.wanted, _servers.serving
    if wanted is None or _servers.coming is not None:
        return
    waiting = (
        quick is not None
        and quick.kind == "quick"
        and not quick.ready()
        and quick.refused() is None
        and server_fork.supported()
    )
    if waiting:
        import asyncio  # (not at the top: `rove run` imports this module first thing)

        with contextlib.suppress(RuntimeError):  # (no event loop: it starts afresh now)
            asyncio.get_running_loop().call_later(READY_POLL_S, _start_full)
            return
    _servers.wanted = None
    base = quick if quick is not None and quick.ready() else None
    try:  # (maybe in a callback of the loop: said here, not as asyncio's traceback)
        _servers.coming = _Server(wanted, "full", nice=BACKGROUND_NICE, base=base)
    except Exception as exc:  # noqa: BLE001 - restarts fork from the quick one meanwhile
        import structlog

        structlog.get_logger(__name__).warning(
            f"the warm server for restarts did not start ({plain(exc)}): restarts fork "
            "from the quick one and import the rest themselves"
        )
        return
    _escalate_later()


def escalate() -> bool:
    """The full server is still importing at a low priority (the cores are busy): it
    imports on at normal priority (`_Server.hurry`), or where that is not allowed one
    at normal priority starts in its place, so that restarts are fast from now on (its
    imports cost a few seconds of CPU once). A server that learns is hurried the same
    way, where allowed (else it imports on at its low priority: restarts have the full
    one meanwhile). True when it did any of these."""
    import structlog

    said = f"was not ready after {NICE_FOR_S:.0f}s at a low priority (the cores are busy); "
    done = False
    coming, learning = _servers.coming, _servers.learning
    if coming is not None and coming.nice != 0 and not coming.ready():
        said_full = "the warm server for restarts " + said
        if coming.hurry():
            structlog.get_logger(__name__).info(said_full + "it imports on at normal priority")
        else:
            serving = _servers.serving
            base = serving if serving is not None and serving.ready() else None
            _servers.coming = _Server(coming.preload, "full", base=base)
            coming.kill()
            structlog.get_logger(__name__).info(
                said_full + "one imports at normal priority in its place"
            )
        done = True
    if learning is not None and learning.nice != 0 and not learning.ready() and learning.hurry():
        structlog.get_logger(__name__).info(
            "the warm server that learns the workers' imports "
            + said
            + "it imports on at normal priority"
        )
        done = True
    return done


def _escalate_later() -> None:
    import asyncio  # (not at the top: `rove run` imports this module first thing)

    with contextlib.suppress(RuntimeError):  # (no event loop: nobody to escalate)
        asyncio.get_running_loop().call_later(NICE_FOR_S, escalate)


def promote() -> None:
    """Before a round forks its workers (the last round's have been stopped): the
    newest ready server serves from now on (one that learned the workers' imports,
    else the full one); those it supersedes are stopped (the quick one, and the full
    one when a learned one takes over: it imported everything the full one does)."""
    learning, coming = _servers.learning, _servers.coming
    if learning is not None and learning.ready():
        best, superseded = learning, [_servers.serving, coming]
        _servers.learning = _servers.coming = None
    elif coming is not None and coming.ready():
        best, superseded = coming, [_servers.serving]
        _servers.coming = None
    else:
        return
    _servers.install(best)
    import structlog

    learned = (
        f" that learned {counted(len(best.learned), 'module')} the workers imported"
        if best.learned
        else ""
    )
    structlog.get_logger(__name__).info(f"workers fork from the {best.kind} warm server{learned}")
    for old in superseded:
        if old is not None:
            old.kill()


class Lesson(NamedTuple):
    """What `learn` did."""

    #: a server that learns was started now
    started: bool = False
    #: the names it imports beyond what restarts find imported now
    new: tuple[str, ...] = ()
    #: (package, why): a server refused this package (it is not learned again)
    refused: tuple[str, str] | None = None
    #: nothing more to do for these names: restarts will find them imported, or no
    #: more servers may learn (until the workers name more, asking again changes nothing)
    settled: bool = False


def learn(names: Sequence[str], worker_keys: Sequence[str]) -> Lesson:
    """The workers imported `names` (`rove.agent.imports`): make sure the server that
    restarts will fork from imports them too. Called again and again (the agent's duty
    ticks) until settled: it waits while no server to compare with is ready or one is
    learning, starts one that learns (in the background, at BACKGROUND_NICE, with
    everything the full server imports) where names are missing, and tells of a
    refusal once. A learned server once ready is the one restarts fork from next (the
    full one it supersedes is stopped then). At most MAX_LEARNING servers a process."""
    learning = _servers.learning
    if learning is not None:
        if learning.ready():
            if _servers.coming is not None:
                _servers.coming.kill()
            _servers.coming, _servers.learning = learning, None
        else:
            refusal = learning.refused()
            if refusal is None:
                return Lesson()  # (still importing)
            _servers.learning = None
            learning.kill()
            package, _why = refusal
            if package:
                _servers.refused.add(package)
                _servers.tried -= set(learning.learned)  # (the others: again, without it)
            else:
                _servers.learners = MAX_LEARNING  # (it died: do not try again)
            return Lesson(refused=refusal)
    base = _servers.coming or _servers.serving
    if base is None or not base.ready():
        return Lesson()
    known, tried, refused = base.modules(), _servers.tried, _servers.refused
    new = tuple(n for n in names if n not in known and n not in tried and top(n) not in refused)
    if len(new) < LEARN_AT_LEAST or _servers.learners >= MAX_LEARNING:
        return Lesson(settled=True)
    before = [n for n in base.learned if top(n) not in refused]
    _servers.learning = _Server(
        (*FULL, *_servers.extra),
        "learned",
        nice=BACKGROUND_NICE,
        learned=imports.union([before, new]),
        worker_keys=worker_keys,
        base=base,
    )
    _servers.tried.update(new)  # (one a server could not import is not tried again)
    _servers.learners += 1
    _escalate_later()
    return Lesson(started=True, new=new)


def stop() -> None:
    """Kill every warm server of this process now."""
    for server in (_servers.learning, _servers.coming, _servers.serving):
        if server is not None:
            server.kill()
    _servers.coming = _servers.learning = _servers.wanted = None


def serving_ready() -> bool:
    """Whether the server that forks now has imported everything (never blocks)."""
    return _servers.serving is not None and _servers.serving.ready()


def serving() -> tuple[str, int | None] | None:
    """(kind, pid) of the server that forks now, if any."""
    s = _servers.serving
    return None if s is None else (s.kind, s.pid)


def _install(server: mpfs.ForkServer) -> None:
    mpfs._forkserver = server
    mpfs.ensure_running = server.ensure_running
    mpfs.get_inherited_fds = server.get_inherited_fds
    mpfs.connect_to_new_process = server.connect_to_new_process
    mpfs.set_forkserver_preload = server.set_forkserver_preload
