"""Stopping background tasks, even those that swallow a cancellation."""

from __future__ import annotations

import asyncio

from rove.control.aio import cancel_and_wait


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
