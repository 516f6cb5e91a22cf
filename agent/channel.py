"""A TCP connection between two agents for bulk bytes (peer replicas of checkpoints),
on the event loop's own socket calls: bytes are sent straight from the caller's buffer
and read straight into the caller's buffer (a replica's memory, a shared-memory slot),
never copied on the way.

asyncio's streams copy every byte twice on the way in (into the reader's buffer, then
out of it) and once on the way out for what the socket does not take at once; at 1 GiB
beside training that was half the transfer's time (`benchmarks/replica_channel.py`).
"""

from __future__ import annotations

import asyncio
import socket

from rove.checkpoint import replica as wire
from rove.checkpoint.durable import CheckpointError

#: Bytes handed to the socket at a time while a payload travels (each under the timeout).
CHUNK = 4 << 20
#: One send or read of a replica transfer (of up to `CHUNK`) that takes longer fails it.
IO_TIMEOUT_S = 30.0
#: What ends a transfer early (said, and the peer or source tried again later).
TRANSFER_ERRORS = (OSError, TimeoutError, CheckpointError)


class Channel:
    """One connected, non-blocking socket; every send or read of `timeout_s` or more
    fails with TimeoutError, an ended connection with CheckpointError (with how far it
    got), anything else with OSError."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.timeout_s = timeout_s
        self._loop = asyncio.get_running_loop()

    @classmethod
    async def connect(cls, addr: str, port: int, timeout_s: float) -> Channel:
        infos = await asyncio.get_running_loop().getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, where = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            chan = cls(sock, timeout_s)
            async with asyncio.timeout(timeout_s):
                await chan._loop.sock_connect(sock, where)
        except BaseException:
            sock.close()
            raise
        return chan

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        for at in range(0, max(len(view), 1), CHUNK):
            async with asyncio.timeout(self.timeout_s):
                await self._loop.sock_sendall(self.sock, view[at : at + CHUNK])

    async def fill(self, view: memoryview) -> None:
        """Read exactly `len(view)` bytes into `view`."""
        view = view.cast("B")
        size, got = len(view), 0
        while got < size:
            async with asyncio.timeout(self.timeout_s):
                n = await self._loop.sock_recv_into(self.sock, view[got : got + CHUNK])
            if n == 0:
                raise CheckpointError(f"the other side left after {got} of {size} bytes")
            got += n

    async def exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        await self.fill(memoryview(buf))
        return bytes(buf)

    async def body(self) -> bytes:
        """A header or an answer: its 4-byte length (`replica.length`), then its bytes."""
        return await self.exactly(wire.length(await self.exactly(4)))

    def close(self) -> None:
        self.sock.close()
