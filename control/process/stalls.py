"""Says when a process's event loop was held, for how long, and by what.

Everything a rove daemon does runs on one asyncio loop: an agent's heartbeats, its
reports and replica transfers, a master's decisions and the renewal of its lease. One
synchronous call that holds the loop silences all of them at once, and from outside the
process looks like a mute node or a lapsed leader. (An agent that imported torch in its
loop, 1.4 s on a quiet machine and over 3 s on busy cores, had its node declared lost
in CI, and nothing in its log said why.)

`LoopWatch` stamps the time on the loop every `tick_s`, from a callback, and a thread of
its own looks at the stamp as often. Once the stamp is `threshold_s` old, the thread
takes the loop thread's stack: where it is held. When the loop runs again, the watch
says how long it was held and where: a warning, once per place a minute (with how many
times since). A loop found waiting in its selector was not held by its code: the
process got no CPU (an overloaded machine, a paused process), which is said at info.
A process that used under a tenth of the time in CPU meanwhile was not running either
when the thread got no look in (the whole process paused, then both woke at once) or
saw the loop's thread waiting to be scheduled (state R); a call that blocks in the
kernel (state S or D, little CPU) and one that computes (much CPU) are holds.

Deciding (`idle`, `where`, `Said`) is pure; the thread and the loop's callback are the
effects around it.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

#: How long the loop may be held before it is said (a heartbeat interval is 1 s).
THRESHOLD_S = 2.0
#: How often the loop stamps its time and the thread looks at it.
TICK_S = 0.25
#: The same place is said at most once in this long.
REPEAT_S = 60.0
#: A hold during which the process used less CPU than this share of it was no hold by
#: its code: the process was not running (paused, or a machine out of CPU).
RUNNING_SHARE = 0.1

#: Where a loop's thread waits when nothing holds it: asyncio's selector, and the
#: call into uvloop's loop (its waiting is C, below the last Python frame).
_IDLE = frozenset({("selectors", "select"), ("asyncio.runners", "run"), ("uvloop", "run")})


#: rove's modules that run the loop itself: a frame of theirs says nothing of the hold
_RUNNERS = frozenset({"rove.control.process.aio"})


@dataclass(frozen=True)
class Frame:
    """One frame of a stack: its module's name, file, line and function."""

    module: str
    file: str
    line: int
    function: str


def frames_of(frame: FrameType | None, most: int = 80) -> list[Frame]:
    """The stack from `frame` outwards: innermost first, at most `most` frames."""
    out: list[Frame] = []
    while frame is not None and len(out) < most:
        code = frame.f_code
        module = frame.f_globals.get("__name__")
        out.append(
            Frame(
                module if isinstance(module, str) else "?",
                code.co_filename,
                frame.f_lineno,
                code.co_name,
            )
        )
        frame = frame.f_back
    return out


def idle(stack: Sequence[Frame]) -> bool:
    """Whether a loop's thread with this stack (innermost first) was waiting for I/O or
    timers, not running anything."""
    return bool(stack) and (stack[0].module, stack[0].function) in _IDLE


def not_running(stack: Sequence[Frame] | None, state: str, cpu_s: float, held_s: float) -> bool:
    """Whether a loop held for `held_s` while its process used `cpu_s` of CPU was not
    held by its code but not running (see the module's docstring); `stack` and `state`:
    its thread's as the watch saw them (None and "": not seen)."""
    if stack is not None and idle(stack):
        return True
    return cpu_s < RUNNING_SHARE * held_s and (stack is None or state == "R")


def thread_state(tid: int) -> str:
    """The kernel's one-letter state of thread `tid` of this process ("R" running or
    waiting to run, "S" sleeping, "D" in I/O...), "" where it cannot be read."""
    try:
        stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    except OSError:
        return ""
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else ""


def where(stack: Sequence[Frame] | None) -> str:
    """The place a held loop was seen: the innermost frame, and the innermost of rove's
    own frames when that is another (what rove called that held it)."""
    if not stack:
        return "a place not seen (a call that held the GIL all along)"
    inner = stack[0]
    text = f"{inner.function} ({_short(inner.file)}:{inner.line})"
    own = next(
        (f for f in stack if f.module.startswith("rove.") and f.module not in _RUNNERS), None
    )
    if own is not None and own is not inner:
        text += f", called from {own.module}.{own.function} (line {own.line})"
    return text


def _short(file: str) -> str:
    parts = Path(file).parts
    return "/".join(parts[-2:]) if len(parts) > 1 else file


class Said:
    """Which places were said when, so that one place is said at most once per
    `repeat_s`, with how many times it was held since (pure: the caller gives `now`)."""

    def __init__(self, repeat_s: float = REPEAT_S) -> None:
        self.repeat_s = repeat_s
        self._last: dict[str, float] = {}
        self._since: dict[str, int] = {}

    def due(self, place: str, now: float) -> int | None:
        """None: not to be said now (counted); else how many times it was held
        unsaid since it was last said."""
        last = self._last.get(place)
        if last is not None and now - last < self.repeat_s:
            self._since[place] = self._since.get(place, 0) + 1
            return None
        self._last[place] = now
        return self._since.pop(place, 0)


class LoopWatch:
    """Watches the running loop of one process (`what`: "the agent of node n1"),
    logging with `log` (see the module's docstring). `start()` on the loop; `stop()`
    ends the thread."""

    def __init__(
        self,
        what: str,
        log: Any,
        *,
        threshold_s: float = THRESHOLD_S,
        tick_s: float = TICK_S,
        repeat_s: float = REPEAT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what = what
        self.log = log
        self.threshold_s = threshold_s
        self.tick_s = tick_s
        self.clock = clock
        self.said = Said(repeat_s)
        self._stamp = 0.0
        self._cpu = 0.0  # the process's CPU time at the stamp
        #: the stamp the loop was held past, and its thread's stack and state then
        self._seen: tuple[float, list[Frame], str] | None = None
        self._loop_thread = 0
        self._loop_tid = 0
        self._handle: asyncio.TimerHandle | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_thread, self._loop_tid = threading.get_ident(), threading.get_native_id()
        self._stamp, self._cpu = self.clock(), time.process_time()
        self._handle = loop.call_later(self.tick_s, self._tick, loop)
        self._thread = threading.Thread(target=self._look, name="rove-loop-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ends at its next look (not waited for: a daemon thread, it would
        add up to a tick to every process's exit)."""
        self._stopping.set()
        if self._handle is not None:
            self._handle.cancel()

    # ------------------------------------------------------------ on the loop

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        now, cpu = self.clock(), time.process_time()
        (stamp, self._stamp), (cpu_then, self._cpu) = (self._stamp, now), (self._cpu, cpu)
        if not self._stopping.is_set():
            self._handle = loop.call_later(self.tick_s, self._tick, loop)
        held = now - stamp - self.tick_s
        if held < self.threshold_s:
            return
        seen = self._seen
        stack, state = (seen[1], seen[2]) if seen is not None and seen[0] == stamp else (None, "")
        if not_running(stack, state, cpu - cpu_then, held):
            self.log.info(
                f"{self.what} got no CPU for {held:.1f} s (its machine overloaded, or the "
                "process paused): its heartbeats and reports waited meanwhile",
                held_s=round(held, 2),
            )
            return
        place = where(stack)
        since = self.said.due(place, now)
        if since is None:
            return
        more = f" ({since} more times since it was last said)" if since else ""
        self.log.warning(
            f"the event loop of {self.what} was held for {held:.1f} s, in {place}: its "
            f"heartbeats, reports and decisions waited meanwhile{more}",
            held_s=round(held, 2),
        )

    # --------------------------------------------------------- in the thread

    def _look(self) -> None:
        while not self._stopping.wait(self.tick_s):
            stamp = self._stamp
            if self.clock() - stamp < self.tick_s + self.threshold_s:
                continue
            if self._seen is not None and self._seen[0] == stamp:
                continue  # this hold's place is taken already
            frame = sys._current_frames().get(self._loop_thread)
            self._seen = (stamp, frames_of(frame), thread_state(self._loop_tid))
            del frame
