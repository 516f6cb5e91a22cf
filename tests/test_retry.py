"""rove's one retry policy: what is retried, how soon, and for how long."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest

from rove.control.bus import retry
from rove.control.errors import (
    BusUnavailableError,
    ConfigError,
    PublishDeadlineError,
    TemporaryError,
)


@pytest.mark.parametrize(
    ("exc", "verdict"),
    [
        (TemporaryError("leader election", retry_after=2.5), 2.5),
        (BusUnavailableError("down"), True),
        (nats.errors.TimeoutError(), True),
        (nats.errors.NoRespondersError(), True),
        (nats.js.errors.APIError(code=503, description="no leader"), True),
        (nats.js.errors.APIError(code=400, description="bad request"), False),
        (ConfigError("bad flag"), False),
        (ValueError("bug"), False),
    ],
)
def test_backoff_says_what_is_worth_another_try_and_when(exc: Exception, verdict: object) -> None:
    assert retry.backoff(exc) == verdict


async def test_a_retryable_failure_is_tried_again_until_it_succeeds() -> None:
    tries: list[float] = []

    async def flaky(budget: float) -> str:
        tries.append(budget)
        if len(tries) < 3:
            raise nats.errors.TimeoutError
        return "stored"

    assert await retry.call(flaky, what="x", deadline_s=30, wait_initial=0.01) == "stored"
    assert len(tries) == 3
    assert all(0 < b <= 2.0 for b in tries), "each attempt gets a bounded budget"


async def test_a_permanent_failure_is_raised_at_once() -> None:
    tries = 0

    async def broken(_budget: float) -> None:
        nonlocal tries
        tries += 1
        raise ConfigError("no such stream")

    with pytest.raises(ConfigError):
        await retry.call(broken, what="x", deadline_s=30)
    assert tries == 1


async def test_retries_stop_at_the_total_deadline_naming_the_last_error() -> None:
    tries = 0

    async def down(_budget: float) -> None:
        nonlocal tries
        tries += 1
        raise nats.errors.NoRespondersError

    with pytest.raises(PublishDeadlineError, match=r"publish x: no acknowledgement after \d+"):
        await retry.call(down, what="publish x", deadline_s=0.3, wait_initial=0.01)
    assert tries >= 2


async def test_without_a_deadline_it_goes_on_until_the_call_succeeds() -> None:
    tries = 0

    async def later(_budget: float) -> int:
        nonlocal tries
        tries += 1
        if tries < 5:
            raise BusUnavailableError("the server restarts")
        return tries

    assert await retry.call(later, what="x", deadline_s=None, wait_initial=0.01) == 5


async def test_a_cancelled_call_ends_even_when_the_client_turned_its_cancel_into_a_timeout() -> (
    None
):
    """nats-py's request waits with `asyncio.wait_for`, which can hand the caller's
    cancellation back as a timeout: a retryable error. The call must end cancelled."""
    calls = 0

    async def request(_timeout: float) -> None:
        nonlocal calls
        calls += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise nats.errors.TimeoutError from None  # what the client gave back

    task = asyncio.create_task(retry.call(request, what="publish", deadline_s=None))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert calls == 1, "not retried"
