"""Running rove's coroutines: on uvloop when it is installed (10-40% faster JetStream I/O)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)`, on a uvloop event loop when uvloop is importable."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
