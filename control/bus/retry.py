"""rove's one retry policy: exponential backoff with jitter, inside one total deadline.

Every retry loop in rove goes through `call` (stamina underneath): publishing
to JetStream, the outboxes of agents and data clients, the supervision of an
in-process master. What is worth another try is decided by `backoff` alone:

* a `TemporaryError` is retried after its own `retry_after` when it names one;
* nats-py's timeouts, "no responders", reconnect and buffer errors, JetStream's
  503 (no leader yet, no quorum) and the answers a clustered stream gives while a
  proposal is in flight (`BUSY_CODES`) are retried with the policy's backoff;
* anything else is raised at once.

The first attempt runs outside stamina: most calls succeed at once, and a
publish should not pay for the retry machinery it does not use (~30 µs).

A cancelled caller is never retried. nats-py's request waits with `asyncio.wait_for`,
which can turn the caller's cancellation into a timeout (Python 3.11); a timeout is
retryable, so the cancelled task went on retrying for ever. After any failure `call`
checks whether its task is being cancelled (`Task.cancelling`) and, if so, raises
`CancelledError`. (The nemesis's witness, cancelled while it published, published on
for a quarter of an hour, and the test hung.)

`wait_out` is the same policy without a deadline, for a daemon starting while the
bus is away (NATS down, JetStream without quorum): it waits, saying so once and then
once a minute, and goes on when the bus is back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
import stamina

from rove.control.errors import PublishDeadlineError, TemporaryError, plain
from rove.control.process import logs

log = logs.get("rove.retry")

T = TypeVar("T")

#: nats-py errors that say "not now", not "never".
RETRYABLE: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    asyncio.TimeoutError,
)


#: JetStream's answers on a clustered (R3) stream that mean "not now": a write that
#: checks a subject's last sequence while another write checked against that subject is
#: still being proposed (10164: "wrong last sequence", with no sequence number; a real
#: mismatch is 10071), and a retried write whose first try is still being proposed
#: (10158: "duplicate message id is in process"). Retried, the first is checked against
#: what was stored (a deposed master's write is then refused with 10071), the second
#: is answered as the duplicate it is. One server (R1) never gives either.
BUSY_CODES = frozenset({10164, 10158})


def backoff(exc: BaseException) -> bool | float:
    """Whether `exc` is worth another try: False, True (the policy's backoff) or seconds."""
    if isinstance(exc, TemporaryError):
        return exc.retry_after if exc.retry_after > 0 else True
    if isinstance(exc, RETRYABLE):
        return True
    return isinstance(exc, nats.js.errors.APIError) and (
        exc.code == 503 or exc.err_code in BUSY_CODES
    )


def _unless_cancelled(exc: Exception) -> None:
    """Raise `CancelledError` (from `exc`) when the current task is being cancelled:
    the failure may be its cancellation in disguise, and it must not be retried."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > 0:
        raise asyncio.CancelledError() from exc


async def call(
    fn: Callable[[float], Awaitable[T]],
    *,
    what: str,
    deadline_s: float | None,
    wait_initial: float = 0.05,
    wait_max: float = 1.0,
    attempt_s: float = 2.0,
    advice: str = "is the NATS server up and does JetStream have a leader?",
    failed: str = "no acknowledgement",
) -> T:
    """`await fn(timeout)` until it succeeds; retryable failures are tried again.

    `fn` gets the time its attempt may take: `attempt_s`, less when the deadline
    is nearer. With `deadline_s=None` it is retried for as long as it takes
    (an outbox that must never drop a fact).

    Raises:
        PublishDeadlineError: retryable failures lasted past `deadline_s`
            (naming `what`, the tries, the last error and `advice`).
        Exception: the first failure that `backoff` says is not worth retrying.
    """
    started = time.monotonic()
    deadline = None if deadline_s is None else started + deadline_s

    def budget() -> float:
        if deadline is None:
            return attempt_s
        return max(0.05, min(attempt_s, deadline - time.monotonic()))

    try:
        return await fn(budget())
    except Exception as exc:
        _unless_cancelled(exc)
        if not backoff(exc):
            raise
        last: Exception = exc
    tries = 1
    try:
        async for attempt in stamina.retry_context(
            on=backoff,
            attempts=None,
            timeout=None if deadline is None else max(0.001, deadline - time.monotonic()),
            wait_initial=wait_initial,
            wait_max=wait_max,
            wait_jitter=wait_initial,
        ):
            with attempt:
                tries += 1
                log.debug("retrying", what=what, attempt=tries, error=type(last).__name__)
                try:
                    return await fn(budget())
                except Exception as exc:
                    _unless_cancelled(exc)
                    last = exc
                    raise
    except Exception as exc:
        _unless_cancelled(exc)
        if not backoff(exc):
            raise
        last = exc
    raise PublishDeadlineError(
        f"{what}: {failed} after {tries} tries in {deadline_s:g}s (last error: "
        f"{type(last).__name__}: {last}); {advice}"
    ) from last


async def wait_out(
    fn: Callable[[], Awaitable[T]],
    *,
    what: str,
    every_s: float = 60.0,
    wait_initial: float = 0.5,
    wait_max: float = 5.0,
) -> T:
    """`await fn()` until it succeeds, however long the bus stays away: a retryable
    failure is tried again with backoff; the first is logged at once (naming `what`)
    and then one line every `every_s`. Any other failure is raised.
    """
    began = time.monotonic()
    said = 0.0
    wait = wait_initial
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not backoff(exc):
                raise
            now = time.monotonic()
            if not said or now - said >= every_s:
                said = now
                log.warning(
                    f"waiting for the bus: {what} ({plain(exc)}); going on when it answers",
                    waited_s=round(now - began),
                )
        await asyncio.sleep(wait)
        wait = min(wait * 2, wait_max)
