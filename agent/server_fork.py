"""A warm server forked from a ready one, instead of started afresh.

A fresh interpreter that becomes the full server imports torch again (2.3 CPU-seconds
here, before the 1.5 of what it adds); so does a server that learns the workers'
imports. Forked from a server that has torch imported already (the quick one, or the
full one for a learning server), it costs a fork and only what it adds: each node of a
job saved about 2 CPU-seconds, and its full server was ready that much sooner.

The fork is one more child of the ready server, asked for as a worker is (multiprocessing's
forkserver protocol), whose target makes it a server of its own:

- it gets its listening socket and the read end of its agent's "alive" pipe as a worker
  gets the objects it is given (file descriptors passed over the server's socket);
- it lets go of the agent's pipe to the server it was forked from (which would keep that
  server alive while this one lives), and stands for that server's pid
  (`rove.agent.warm.SERVER_PID`: its workers check their parent against it);
- it takes back the import path of the server it was forked from (multiprocessing gave
  it its agent's), as a fresh server would have it;
- it imports what it adds, says it is ready (`rove.agent.warm_ready.serve`), and runs
  multiprocessing's server loop, which ends once its agent's pipe closes.

It is the agent's grandchild: its liveness is read from a pidfd, not `waitpid`
(`ForkedServer.ensure_running`; one that died is started afresh, as multiprocessing does).
This leans on the private forkserver protocol of CPython 3.11-3.13 (`supported`; checked
by `tests/test_warm.py`); elsewhere, or with `ROVE_WARM_FORK=0`, the server starts
afresh, as before.
"""

from __future__ import annotations

import io
import os
import select
import signal
import socket
import sys
from collections.abc import Sequence
from multiprocessing import connection, popen_forkserver, reduction, spawn, util
from multiprocessing import forkserver as mpfs
from multiprocessing.context import ForkServerProcess, set_spawning_popen
from pathlib import Path
from typing import Any, NamedTuple

#: multiprocessing's server loop as this module drives it (CPython 3.11-3.13; 3.14 adds
#: an authentication key to the protocol).
_MAIN_PARAMETERS = ("listener_fd", "alive_r", "preload", "main_path", "sys_path")
# (private functions of multiprocessing, not in typeshed)
_util: Any = util
_connection: Any = connection


#: "0": every warm server starts afresh, as before servers were forked (the baseline of
#: `benchmarks/warm_servers.py`; a way out should forking ever misbehave somewhere).
FORK_ENV = "ROVE_WARM_FORK"


def supported() -> bool:
    """Whether this Python's forkserver is the one this module knows, pidfds exist, and
    FORK_ENV does not say no."""
    if os.environ.get(FORK_ENV, "1").strip() == "0":
        return False
    import inspect

    try:
        names = tuple(inspect.signature(mpfs.main).parameters)
    except (TypeError, ValueError):
        return False
    return (
        sys.version_info < (3, 14)
        and names == _MAIN_PARAMETERS
        and hasattr(os, "pidfd_open")
        and hasattr(popen_forkserver.Popen, "_launch")
    )


class Serving(NamedTuple):
    """What the forked server does before it serves (as a fresh one reads it from its
    environment: `rove.agent.warm_ready`)."""

    imports: tuple[str, ...]
    nice: int
    importer_file: str
    learned_file: str | None
    ready_file: str


class ForkedServer(mpfs.ForkServer):
    """multiprocessing's server object for a server this process did not start itself
    (its grandchild): alive while its pidfd says so. One that ended is started afresh,
    with the preload set on it, as multiprocessing starts its own again."""

    # (multiprocessing's private attributes, not in typeshed)
    _forkserver_address: Any
    _forkserver_alive_fd: int | None
    _forkserver_pid: int | None

    def __init__(self) -> None:
        super().__init__()
        self.pidfd: int | None = None
        self.popen: Any = None

    def ended(self, wait_s: float = 0.0) -> bool:
        """Whether it ended (waiting up to `wait_s` for it to)."""
        if self.pidfd is None:
            return True
        poller = select.poll()  # (not select(): a descriptor may be above 1024)
        poller.register(self.pidfd, select.POLLIN)
        return bool(poller.poll(int(wait_s * 1000)))

    def exit_code(self) -> int | None:
        """Its exit code as the server it was forked from said it (None while it runs,
        255 where that server is gone too)."""
        if self.popen is None:
            return None
        code: int | None = self.popen.poll()
        return code

    def ensure_running(self) -> None:
        if self._forkserver_pid is not None and not self.ended():
            return
        self.release()
        super().ensure_running()

    def release(self) -> None:
        """Close what this process holds of it (the alive pipe's write end, the pidfd,
        the fork's pipes): it ends once nothing else holds its pipe. (Its socket's path
        stays: `_Server.kill` removes it, a fresh start makes another.)"""
        for fd in (self._forkserver_alive_fd, self.pidfd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        if self.popen is not None and self.popen.finalizer is not None:
            self.popen.finalizer()
        self._forkserver_pid = self._forkserver_alive_fd = self.pidfd = self.popen = None


class _PopenFrom(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, asking `server` for the fork instead of the
    module's installed one (which forks the workers meanwhile, from other threads)."""

    _fds: list[int]

    def __init__(self, process_obj: Any, server: Any) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        # (multiprocessing's own _launch, with self._server in place of the module's)
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)
        self.finalizer = util.Finalize(self, _util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mpfs.read_signed(self.sentinel)


def fork(base: Any, serving: Serving, fallback: Sequence[str]) -> ForkedServer:
    """A server forked from `base` (multiprocessing's object of a ready server) that does
    what `serving` says, then serves. `fallback`: the preload of one started afresh in
    its place should it die. Raises OSError where the fork could not be asked for."""
    server = ForkedServer()
    server.set_forkserver_preload(list(fallback))
    with socket.socket(socket.AF_UNIX) as listener:
        address = _connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            Path(address).chmod(0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()
        reader = connection.Connection(alive_r, writable=False)
        try:
            child = ForkServerProcess(
                target=_serve, args=(listener, reader, serving), name="rove-warm-server"
            )
            popen = _PopenFrom(child, base)
        except BaseException:
            os.close(alive_w)
            raise
        finally:
            reader.close()  # (the fork has its own copy)
    server.popen = popen
    try:
        server.pidfd = os.pidfd_open(popen.pid)
    except OSError:  # (a kernel before 5.3: the fork is not kept, one starts afresh)
        os.kill(popen.pid, signal.SIGKILL)  # (its parent server reaps it)
        os.close(alive_w)
        popen.finalizer()
        raise
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = popen.pid
    return server


def let_the_server_go() -> None:
    """(In a child of a server: a worker, or a server forked from it.) Close the write end
    of the agent's pipe to the server, which multiprocessing hands every forked child:
    the server exits when it reads the pipe's end, and a worker holding it kept its
    server (so itself) alive after its agent was killed with SIGKILL, training on
    unsupervised for ever."""
    server: Any = getattr(mpfs, "_forkserver", None)
    alive = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        try:
            os.close(alive)
        except OSError:
            pass
        server._forkserver_alive_fd = None


def _serve(listener: socket.socket, alive: connection.Connection, serving: Serving) -> None:
    """The forked child: become a server of its own (see the module's docstring)."""
    from rove.agent import warm_ready

    let_the_server_go()  # (the one it was forked from: it must not keep that one alive)
    warm: Any = sys.modules.get("rove.agent.warm")  # (preloaded by every server)
    if warm is not None:
        warm.SERVER_PID = os.getpid()
    sys.path[:] = warm_ready.SYS_PATH  # (what a server started afresh would import from)
    alive_fd = os.dup(alive.fileno())
    alive.close()
    warm_ready.serve(
        list(serving.imports),
        serving.nice,
        serving.importer_file,
        serving.learned_file,
        serving.ready_file,
    )
    mpfs.main(listener.detach(), alive_fd, [])
