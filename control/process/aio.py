"""Running rove's coroutines: on uvloop when it is installed (10-40% faster JetStream I/O).

Also `Supervisor`, which watches a component's tasks (none may die silently),
`cancel_and_wait`, the one way rove stops its background tasks, `unless`, a wait that
a stop ends, and `StopSignals` / `stop_on_signals`, how a rove process ends on SIGTERM
or SIGINT: the first signal asks it to stop cleanly, a second one ends it at once; and
`Starting`, the same for a daemon still waiting for its bus (the first signal ends the
wait).

`run` also hears one known defect of nats-py (2.16) as one warning line instead of a
traceback: its reconnection task, cancelled by a newer one as it finished, sets a
result on the newer one's future, and the later of the two dies of `InvalidStateError`
("Task exception was never retrieved"), after the reconnection was over (the client is
connected and goes on). A user reading that traceback would take it for a crash.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from rove.control.errors import RoveError

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], *, watch: str | None = None) -> T:
    """`asyncio.run(main)`, on a uvloop event loop when uvloop is importable; nats-py's
    reconnection race is one warning line (`quiet_nats_reconnect_race`). A daemon names
    itself in `watch` ("the agent of node n1"): its loop is then watched, and a call
    that holds it for seconds is said with where (`rove.control.process.stalls`)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(_quieted(main, watch))
    return uvloop.run(_quieted(main, watch))


async def _quieted(main: Coroutine[Any, Any, T], watch: str | None) -> T:
    quiet_nats_reconnect_race(asyncio.get_running_loop())
    if watch is None:
        return await main
    from rove.control.process import logs, stalls

    watcher = stalls.LoopWatch(watch, logs.get("rove.loop"))
    watcher.start()
    try:
        return await main
    finally:
        watcher.stop()


def is_nats_reconnect_race(context: dict[str, Any]) -> bool:
    """Whether an event loop's error `context` is nats-py's reconnection task dying of
    `InvalidStateError` (see the module's docstring)."""
    task = context.get("future") or context.get("task")
    if not isinstance(task, asyncio.Task) or not isinstance(
        context.get("exception"), asyncio.InvalidStateError
    ):
        return False
    code = getattr(task.get_coro(), "cr_code", None)
    return (
        code is not None
        and code.co_qualname == "Client._attempt_reconnect"
        and Path(code.co_filename).parts[-3:] == ("nats", "aio", "client.py")
    )


def quiet_nats_reconnect_race(loop: asyncio.AbstractEventLoop) -> None:
    """On `loop`, log nats-py's reconnection race as one warning line; every other
    error goes to the handler the loop had (asyncio's default: the traceback)."""
    previous = loop.get_exception_handler()

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if is_nats_reconnect_race(context):
            from rove.control.process import logs

            logs.get("rove.bus").warning(
                "nats-py's reconnection task ended with InvalidStateError after the "
                "client reconnected (a known race in nats-py; nothing was lost)"
            )
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handle)


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], *, recancel_s: float = 1.0) -> None:
    """Cancel `tasks` and wait until every one has ended.

    A task can swallow a cancellation: on Python 3.11, `asyncio.wait_for`
    returns the result instead of raising when the awaited call completes in
    the same loop iteration as the cancel (gh-86296), and nats-py awaits every
    request through it. A plain `cancel()` then `gather()` waits forever on
    such a task (an agent that never exited was seen here); so any task still
    running after `recancel_s` is cancelled again. Results and exceptions of
    the tasks are not raised.
    """
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=recancel_s)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # retrieved: no "exception was never retrieved" warning


class Stopped(Exception):
    """`unless`: the stop came before what it awaited."""


async def unless(stopping: asyncio.Event, aw: Awaitable[T]) -> T:
    """`await aw`, unless `stopping` is set first: then `aw` is cancelled (and waited
    for) and `Stopped` is raised. For a daemon's waits that may last however long (its
    bus away, JetStream without quorum), so that its first signal (`stop()`) ends them
    instead of being heard once they are over."""
    waiting = asyncio.ensure_future(aw)
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not waiting.done():  # stopped (or cancelled) first
            await cancel_and_wait([waiting])
    if waiting.cancelled():
        raise Stopped()
    return waiting.result()


#: SIGHUP and SIGQUIT as this process started: ignored under `nohup` (SIGHUP) or as a
#: shell's background job (SIGQUIT), where they stay ignored (read before any library,
#: torch's `start_processes` among them, replaced them)
_IGNORED_AT_START = frozenset(
    sig for sig in (signal.SIGHUP, signal.SIGQUIT) if signal.getsignal(sig) == signal.SIG_IGN
)


class StopSignals:
    """SIGTERM, SIGINT, SIGHUP and SIGQUIT (torchrun's four) for a process that stops
    in two steps. (A terminal that closed, its SIGHUP, killed `rove run` at once: no
    clean stop, no save on the way out, a standalone job cut off.)

    The first signal *asks*: `ask(signum)` starts a clean stop (it must return at once:
    it runs on the event loop). Any later one *insists*: `insist(signum)` ends the
    process now (the default: `exit_now`). Both may be set after `install()`; a signal
    received before `ask` was set is in `received`, for the owner to act on. SIGHUP and
    SIGQUIT that the process started ignoring (`nohup`) stay ignored.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

    def __init__(
        self,
        ask: Callable[[int], object] | None = None,
        insist: Callable[[int], object] | None = None,
        signals: Sequence[signal.Signals] = SIGNALS,
    ) -> None:
        """`signals`: those handled (`rove run --signals-to-handle` names its own)."""
        self.ask: Callable[[int], object] = ask or (lambda _signum: None)
        self.insist: Callable[[int], object] = insist or self.exit_now
        self.received: list[int] = []
        self.signals = tuple(signals)

    def install(self) -> None:
        """Handle both signals on the running loop (again: after a library replaced the
        handlers, as torch's `start_processes` does)."""
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            if sig in _IGNORED_AT_START:
                signal.signal(sig, signal.SIG_IGN)  # (as it started, whoever replaced it)
            else:
                loop.add_signal_handler(sig, self._on, sig)

    def remove(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self.signals:
            if sig not in _IGNORED_AT_START:
                loop.remove_signal_handler(sig)

    def _on(self, signum: int) -> None:
        self.received.append(signum)
        (self.ask if len(self.received) == 1 else self.insist)(signum)

    def exit_now(self, signum: int) -> None:
        """End this process at once, with the status of the first signal received
        (128 + its number, as a shell reports a process a signal ended)."""
        name = signal.Signals(signum).name
        print(f"rove: {name} again: stopping at once", file=sys.stderr, flush=True)
        os._exit(128 + self.received[0])


class Supervisor:
    """The tasks of one component (`what`: "the agent", "master m1"), so that none dies
    silently: a process whose task died looks alive and does nothing.

    * `keep(task)`: a long-lived task (an actor, a consumer, an outbox). If it ends
      before `stop()` (an exception, or even a return), its traceback is logged with
      `log` and `on_failure(reason)` is called (once): the component ends with a clear
      error instead of living on deaf ("internal error: ..."; a `RoveError`, which
      says what happened and what to do, is said as itself).
    * `spawn(coro)`: a short side task (a check, a look at a worker); its failure is
      logged with its traceback, and the component goes on.
    * `stop()`: the component is leaving; nothing ending from now on is a failure (it
      cancels its tasks with `cancel_and_wait`).
    """

    def __init__(self, what: str, log: Any, on_failure: Callable[[str], object]) -> None:
        self.what = what
        self.log = log
        self.on_failure = on_failure
        self.stopping = False
        self._kept: set[asyncio.Task[Any]] = set()
        self._side: set[asyncio.Task[Any]] = set()

    def keep(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        self._kept.add(task)
        task.add_done_callback(self._kept_ended)
        return task

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._side.add(task)
        task.add_done_callback(self._side_ended)
        return task

    @property
    def side(self) -> list[asyncio.Task[Any]]:
        """The side tasks still running."""
        return list(self._side)

    def stop(self) -> None:
        """The component is leaving: a task that ends from now on has not failed."""
        self.stopping = True

    def _kept_ended(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled() or self.stopping:
            return
        exc = task.exception()
        self.stopping = True
        if isinstance(exc, RoveError):  # a failure rove names (what happened, what to do):
            # said once, by the owner's end (the traceback goes to the log)
            said = f"{self.what}'s {task.get_name()} task ended: {exc}"
            try:  # (the owner ends even if the line cannot be said)
                self.log.info(said, exc_info=exc)
            finally:
                self.on_failure(said)
            return
        what = f"{type(exc).__name__}: {exc}" if exc is not None else "it returned"
        try:
            self.log.error(f"{self.what}'s {task.get_name()} task ended ({what})", exc_info=exc)
        finally:
            self.on_failure(
                f"internal error: {self.what}'s {task.get_name()} task ended ({what}); "
                "see the log above"
            )

    def _side_ended(self, task: asyncio.Task[Any]) -> None:
        self._side.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.log.error(f"a task of {self.what} failed", exc_info=task.exception())


def stop_on_signals(stop: Callable[[], object]) -> StopSignals:
    """Call `stop()` when this process gets SIGTERM or SIGINT (inside a running loop);
    a second signal ends the process at once."""
    signals = StopSignals(lambda _signum: stop())
    signals.install()
    return signals


class Interrupted(Exception):
    """A stop signal (`signum`) stopped a process before it started (`Starting`)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Starting:
    """The stop signals (`StopSignals`) for a daemon whose start may wait for its bus however long
    (NATS down or not there yet, JetStream without quorum): made inside its main task,
    before it connects. Until `started(stop)`, the first signal cancels what `wait`
    awaits, which raises `Interrupted` (nothing ran yet); from then on it calls
    `stop()`, a clean stop. A second signal ends the process at once. (`signals` may be
    handed on: `rove run`'s agent takes them over once it hears decisions.)"""

    def __init__(self, what: str, signals: Sequence[signal.Signals] = StopSignals.SIGNALS) -> None:
        self.what = what
        self._task = asyncio.current_task()
        self._stop: Callable[[], object] | None = None
        self.signals = StopSignals(self._first, signals=signals)
        self.signals.install()

    def _first(self, signum: int) -> None:
        if self._stop is not None:
            self._stop()
            return
        name = signal.Signals(signum).name
        print(f"rove: {name} before {self.what} started: stopping", file=sys.stderr, flush=True)
        if self._task is not None:
            self._task.cancel()

    async def wait(self, aw: Awaitable[T]) -> T:
        """`await aw`; raises `Interrupted` if a signal cancelled it."""
        try:
            return await aw
        except asyncio.CancelledError:
            if not self.signals.received or self._stop is not None or self._task is None:
                raise
            self._task.uncancel()
            raise Interrupted(self.signals.received[0]) from None

    def started(self, stop: Callable[[], object]) -> None:
        """The daemon runs: a first signal now calls `stop()`."""
        self._stop = stop
