"""What wakes an agent when one of its processes ends: a pidfd per process.

Shared by the worker runtimes (torch's and TensorFlow's): the agent waits on the
processes themselves instead of polling them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os


class Sentinels:
    """What wakes the agent about its workers: one pidfd per worker (readable when it
    exits, Linux 5.3+), and the read ends of their return queues (`return_fds`).

    The agent also looks once a second whatever happens (a backstop, in case torch's
    internals change under `return_fds`); where pidfds are not available it looks
    every 0.1 s.
    """

    def __init__(self, pids: dict[int, int], shared_fds: list[int]) -> None:
        self._fds: dict[int, bool] = dict.fromkeys(shared_fds, False)  # fd -> ours to close
        self._gone = 0  # exited (and reaped) before we could watch them
        self._fallback = False
        for pid in pids.values():
            try:
                self._fds[os.pidfd_open(pid)] = True
            except ProcessLookupError:
                self._gone += 1
            except (OSError, AttributeError):
                self.close()
                self._fallback = True
                break

    async def next_exit(self, backstop_s: float = 1.0) -> bool:
        """Wait until one more sentinel fires, or `backstop_s` passed (a safety net: the
        caller looks at the workers again either way); False when none is left."""
        if self._fallback:
            await asyncio.sleep(0.1)
            return True
        if self._gone:
            self._gone -= 1
            return True
        if not self._fds:
            return False
        loop = asyncio.get_running_loop()
        fired: asyncio.Future[int] = loop.create_future()
        for fd in self._fds:
            loop.add_reader(fd, _resolve, fired, fd)
        try:
            fd = await asyncio.wait_for(fired, backstop_s)
        except TimeoutError:
            return True
        finally:
            for other in self._fds:
                loop.remove_reader(other)
        if self._fds.pop(fd):
            os.close(fd)
        return True

    def close(self) -> None:
        for fd, ours in self._fds.items():
            if ours:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fds = {}


def _resolve(future: asyncio.Future[int], fd: int) -> None:
    if not future.done():
        future.set_result(fd)
