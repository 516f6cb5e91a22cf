"""Where a worker process is: its Python and native stacks (py-spy), and what they say.

`dump(pid)` runs `py-spy dump --native` (it pauses the process for a moment);
`diagnose(text)` reads a dump (pure) and names what it recognises:

* torch's gloo teardown deadlock (`rove.agent.groups`): the main thread waits for a
  gloo thread inside `~ProcessGroupGloo` while a gloo run-loop thread waits for the
  GIL (`gil_scoped_acquire`);
* otherwise the main thread's innermost Python frame ("in time.sleep at x.py:3").

py-spy needs ptrace rights on the worker (the agent's own children: granted unless
a container drops CAP_SYS_PTRACE or `kernel.yama.ptrace_scope` is 3).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

TEARDOWN_DEADLOCK = (
    "in torch's gloo teardown deadlock (the main thread waits for a gloo thread in "
    "~ProcessGroupGloo while holding the GIL, and that thread waits for the GIL)"
)


def _py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def dump(pid: int, timeout_s: float = 30.0) -> str:
    """The stacks of `pid`, or why there are none (blocking: call it from a thread)."""
    spy = _py_spy()
    if spy is None:
        return "(no stacks: py-spy is not installed)"
    try:
        out = subprocess.run(
            [spy, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"(no stacks: py-spy took more than {timeout_s:g}s)"
    text = (out.stdout + out.stderr).strip()
    return text or f"(no stacks: py-spy exited with {out.returncode})"


_THREAD = re.compile(r"^Thread \d+ ", re.MULTILINE)
_FRAME = re.compile(r"^\s+(\S+) \((\S+?):(\d+)\)$")


def diagnose(text: str) -> str:
    """One line on where the dumped process is stuck ('' when the dump says nothing)."""
    threads = _split(text)
    if not threads:
        return ""
    main = next((t for t in threads if "MainThread" in t.splitlines()[0]), threads[0])
    # ~ProcessGroupGloo waits for its work queue to drain, then joins its threads:
    # either wait hangs on a gloo thread that waits for the GIL the main thread holds
    joins_gloo = "ProcessGroupGloo::~ProcessGroupGloo" in main
    waits_gil = any(
        "gil_scoped_acquire" in t and ("runLoop" in t or "~AsyncWork" in t)
        for t in threads
        if t is not main
    )
    if joins_gloo and waits_gil:
        return TEARDOWN_DEADLOCK
    for line in main.splitlines()[1:]:
        frame = _FRAME.match(line)
        if frame is not None:
            name, path, lineno = frame.groups()
            return f"in {name} at {Path(path).name}:{lineno}"
    return ""


def _split(text: str) -> list[str]:
    starts = [m.start() for m in _THREAD.finditer(text)]
    return [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=False)]
