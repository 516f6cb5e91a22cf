"""Running rove's coroutines: on uvloop when it is installed (10-40% faster JetStream I/O).

Also `cancel_and_wait`, the one way rove stops its background tasks, and
`stop_on_signals`, how a daemon ends on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on a uvloop event loop when uvloop is importable."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


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


def stop_on_signals(stop: Callable[[], object]) -> None:
    """Call `stop()` when this process gets SIGTERM or SIGINT (inside a running loop)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
