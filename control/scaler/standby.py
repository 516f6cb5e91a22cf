"""What a local backend tells a standby node (`rove.agent.standby`) to make it a node:
one JSON line on the standby's standard input."""

from __future__ import annotations

from typing import Final

import msgspec

#: The standby's module (`python -m`), started by the local backend of a pool agent.
MODULE: Final = "rove.agent.standby"
#: The file a standby creates once its warm server has imported everything.
READY_ENV: Final = "ROVE_STANDBY_READY_FILE"


class Assignment(msgspec.Struct, frozen=True, kw_only=True):
    """What makes a standby the node: `rove run ARGV` in `cwd`, its output appended to
    `log` (None: keep the standby's), its memory limited by joining `cgroup` (a
    directory whose `memory.max` is set) or else by `RLIMIT_AS` of `memory` bytes."""

    argv: tuple[str, ...]
    cwd: str = ""
    log: str | None = None
    cgroup: str | None = None
    memory: int = 0


def encode(a: Assignment) -> bytes:
    """One line for the standby's standard input."""
    return msgspec.json.encode(a) + b"\n"


def decode(line: bytes) -> Assignment:
    """Raises msgspec.ValidationError (or DecodeError) for a line that is no assignment."""
    return msgspec.json.decode(line, type=Assignment)
