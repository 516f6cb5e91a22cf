"""Stopping background tasks, even those that swallow a cancellation."""

from __future__ import annotations

import asyncio
import gc

import nats.aio.client
import pytest

from rove.control.errors import RoveError
from rove.control.process import aio, logs
from rove.control.process.aio import Supervisor, cancel_and_wait


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again() -> None:
    swallowed = asyncio.Event()

    async def stubborn() -> None:
        # What asyncio.wait_for does on Python 3.11 when its call completes in the
        # same iteration as the cancel: the CancelledError is lost.
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            swallowed.set()
        await asyncio.sleep(3600)

    async def plain() -> None:
        await asyncio.sleep(3600)

    tasks = [asyncio.create_task(stubborn()), asyncio.create_task(plain())]
    await asyncio.sleep(0)
    await cancel_and_wait(tasks, recancel_s=0.05)
    assert swallowed.is_set()
    assert all(t.cancelled() for t in tasks)


async def test_finished_and_failed_tasks_are_waited_for_without_raising() -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    done = asyncio.create_task(asyncio.sleep(0))
    failed = asyncio.create_task(boom())
    await asyncio.sleep(0.01)
    await cancel_and_wait([done, failed])
    assert done.done() and failed.done()


class Log:
    """Records what a supervisor logs (pure logic: no need for structlog here)."""

    def __init__(self) -> None:
        self.errors: list[tuple[str, BaseException | None]] = []
        self.infos: list[tuple[str, BaseException | None]] = []

    def error(self, message: str, exc_info: BaseException | None = None) -> None:
        self.errors.append((message, exc_info))

    def info(self, message: str, exc_info: BaseException | None = None) -> None:
        self.infos.append((message, exc_info))


async def test_a_kept_task_that_dies_is_logged_with_its_error_and_ends_the_component() -> None:
    log, failures = Log(), []
    sup = Supervisor("the agent", log, failures.append)

    async def actor() -> None:
        raise IndexError("range object index out of range")

    task = sup.keep(asyncio.create_task(actor(), name="actor"))
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert failures == [
        "internal error: the agent's actor task ended (IndexError: range object index out "
        "of range); see the log above"
    ]
    ((message, exc),) = log.errors
    assert "the agent's actor task ended" in message and isinstance(exc, IndexError)


async def test_a_kept_task_that_dies_ends_the_component_even_if_its_line_cannot_be_said() -> None:
    """(A console gone away raised in the supervisor's own line: the node never ended.)"""
    failures: list[str] = []

    class Mute:
        def error(self, *_: object, **__: object) -> None:
            raise BrokenPipeError(32, "Broken pipe")

        info = error

    for exc in (IndexError("oops"), RoveError("the warm server ended")):
        sup = Supervisor("the agent", Mute(), failures.append)

        async def actor(exc: Exception = exc) -> None:
            raise exc

        await asyncio.gather(
            sup.keep(asyncio.create_task(actor(), name="actor")), return_exceptions=True
        )
        await asyncio.sleep(0)
    assert len(failures) == 2 and "oops" in failures[0] and "warm server" in failures[1]


async def test_a_kept_task_that_ends_on_an_error_rove_names_says_it_without_internal_error() -> (
    None
):
    """(A warm server that died unasked was said as "internal error: ..." though the
    message said what happened and what to do.)"""
    log, failures = Log(), []
    sup = Supervisor("the agent", log, failures.append)

    async def actor() -> None:
        raise RoveError("the warm server ended; run with --no-warm-start")

    await asyncio.gather(
        sup.keep(asyncio.create_task(actor(), name="actor")), return_exceptions=True
    )
    await asyncio.sleep(0)
    assert failures == [
        "the agent's actor task ended: the warm server ended; run with --no-warm-start"
    ]
    assert log.errors == [], "said once, by the component's end"
    ((_, exc),) = log.infos
    assert isinstance(exc, RoveError), "its traceback is in the log"


async def test_a_kept_task_that_returns_is_a_failure_too_but_not_once_stopping() -> None:
    log, failures = Log(), []
    sup = Supervisor("master m1", log, failures.append)

    async def quits() -> None:
        return None

    await sup.keep(asyncio.create_task(quits(), name="consumer"))
    await asyncio.sleep(0)
    assert failures == [
        "internal error: master m1's consumer task ended (it returned); see the log above"
    ]
    sup2 = Supervisor("master m2", log, failures.append)
    sup2.stop()
    await sup2.keep(asyncio.create_task(quits(), name="consumer"))
    await asyncio.sleep(0)
    assert len(failures) == 1, "a task ending while the component leaves is no failure"


async def test_a_side_task_that_fails_is_logged_and_the_component_goes_on() -> None:
    log, failures = Log(), []
    sup = Supervisor("the agent", log, failures.append)

    async def check() -> None:
        raise OSError("no such device")

    task = sup.spawn(check())
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert failures == [] and sup.side == []
    ((message, exc),) = log.errors
    assert message == "a task of the agent failed" and isinstance(exc, OSError)


class _Races:
    """What nats-py's reconnection task meets in the race: its first look at the
    reading task raises what `set_result` on the newer task's finished future raises."""

    def cancelled(self) -> bool:
        raise asyncio.InvalidStateError("invalid state")


def test_nats_pys_reconnection_race_is_one_warning_line_and_other_errors_keep_their_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nats-py's own `Client._attempt_reconnect` coroutine, dying of InvalidStateError
    with nobody awaiting it (as it does when a newer reconnection task replaced it), is
    said in one warning line under `aio.run`; another task's unretrieved error still
    prints asyncio's traceback."""

    warned: list[str] = []

    class Said:
        def warning(self, message: str) -> None:
            warned.append(message)

    monkeypatch.setattr(logs, "get", lambda _name: Said())

    async def main() -> None:
        client = nats.aio.client.Client()
        client._current_server = object()  # type: ignore[assignment]
        client._reading_task = _Races()  # type: ignore[assignment]
        race = asyncio.create_task(client._attempt_reconnect())

        async def other() -> None:
            raise ValueError("a bug of our own")

        plain = asyncio.create_task(other())
        await asyncio.wait([race, plain])
        del race, plain  # never retrieved: the loop's handler hears of them as they go
        gc.collect()

    aio.run(main())
    assert len(warned) == 1 and "nats-py's reconnection task ended with" in warned[0]
    assert "InvalidStateError: invalid state" not in caplog.text, "no traceback for the race"
    assert caplog.text.count("Task exception was never retrieved") == 1
    assert "ValueError: a bug of our own" in caplog.text
