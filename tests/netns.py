"""A network namespace linked to this host by a veth pair, for partition tests (root only).

A process started with `enter` as its `preexec_fn` lives in the namespace: it reaches
the host at `host_ip` and is itself `ns_ip` (its own loopback is its own). `cut()` takes
the namespace's end of the link down, `heal()` brings it back: everything inside is cut
off from everything outside, and back, as a node behind a failed switch.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import uuid

_CLONE_NEWNET = 0x40000000


def available() -> bool:
    """Whether this process may create network namespaces (root, with `ip`)."""
    return (
        os.geteuid() == 0
        and subprocess.run(["ip", "netns", "list"], capture_output=True, check=False).returncode
        == 0
    )


class Netns:
    def __init__(self, index: int = 1) -> None:
        tag = uuid.uuid4().hex[:6]
        self.name = f"rove-{tag}"
        self.host_if, self.ns_if = f"rh{tag}", f"rn{tag}"
        self.host_ip, self.ns_ip = f"10.231.{index}.1", f"10.231.{index}.2"

    def _ip(self, *args: str, inside: bool = False) -> None:
        cmd = ["ip", "netns", "exec", self.name, "ip", *args] if inside else ["ip", *args]
        subprocess.run(cmd, check=True, capture_output=True)

    def create(self) -> Netns:
        self._ip("netns", "add", self.name)
        self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self._ip("link", "set", self.ns_if, "netns", self.name)
        self._ip("addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        self._ip("link", "set", self.host_if, "up")
        self._ip("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if, inside=True)
        self._ip("link", "set", self.ns_if, "up", inside=True)
        self._ip("link", "set", "lo", "up", inside=True)
        return self

    def enter(self) -> None:
        """A `preexec_fn`: move the child into the namespace (in a session of its own)
        before it execs."""
        self.join()
        os.setsid()

    def join(self) -> None:
        """Move the calling process (a child between fork and exec) into the namespace."""
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(f"/var/run/netns/{self.name}", os.O_RDONLY)
        try:
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns failed")
        finally:
            os.close(fd)

    def cut(self) -> None:
        self._ip("link", "set", self.ns_if, "down", inside=True)

    def heal(self) -> None:
        self._ip("link", "set", self.ns_if, "up", inside=True)

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
