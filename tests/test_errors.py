"""Errors said to people: their words, never Python's repr."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import nats.errors

from rove.control.errors import BusUnavailableError, plain

ROOT = Path(__file__).parent.parent


def test_an_error_is_said_in_its_own_words_or_in_what_its_kind_means() -> None:
    assert plain(BusUnavailableError("NATS is down; start it")) == "NATS is down; start it"
    assert plain(TimeoutError()) == "timed out"
    assert plain(asyncio.CancelledError()) == "cancelled"
    refused = ConnectionRefusedError(111, "Connection refused")
    assert plain(refused) == "Connection refused"
    missing = FileNotFoundError(2, "No such file or directory", "/ckpt/step-5")
    assert plain(missing) == "No such file or directory: /ckpt/step-5"
    assert plain(nats.errors.TimeoutError()) == "nats: timeout"
    assert plain(KeyError("rank")) == "'rank'"

    class LeaseExpiredError(Exception):
        pass

    assert plain(LeaseExpiredError()) == "lease expired"
    assert "\n" not in plain(ValueError("first line\nsecond line"))


#: an exception said through Python's repr, or a warning (which the console shows) naming
#: its class
_INTERNALS = re.compile(r"repr\(exc|exc!r|\.(warning|error|critical)\(.*type\(exc\)\.__name__")


def test_no_exception_of_the_product_is_said_with_pythons_repr() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in ("agent", "control", "shard_service", "checkpoint")
        for path in (ROOT / package).rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if _INTERNALS.search(line)
    ]
    assert not found, "\n".join(found)
