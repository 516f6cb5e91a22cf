"""Failure diagnosis: why did a worker process end badly? (pure functions)

The agent classifies every failed worker from its exit code or signal, the
error file that torch's `@record` writes, and the tail of its log:

    user_error     a Python exception in the training script (type and message kept),
                   or its command line refused (argparse's `error:` line, exit code 2),
                   or its module missing (`python -m`'s "No module named", exit code 1)
    oom            host or CUDA out of memory
    killed         SIGKILL / SIGTERM from outside (OOM killer, an operator, a preemption)
    segfault       SIGSEGV, SIGBUS, SIGILL, SIGFPE, or SIGABRT without a known cause
    communication  NCCL / gloo / c10d store errors and collective timeouts
    hang           no step progress for the hang timeout (decided by the agent, not here)
    hardware       GPU or driver faults (Xid, ECC, "GPU is lost")
    unknown        a non-zero exit code with nothing else to go on (said with the
                   last line the worker wrote, if any)

Signals and exception types are matched before log patterns; the log patterns
are checked from the most specific (hardware) to the most generic.
"""

from __future__ import annotations

import json
import re
import signal as signal_module
from typing import Any, NamedTuple

from rove.control.catalogue.events import LOG_TAIL_BYTES, REASON_CHARS, FailureKind
from rove.control.domain import words

_HARDWARE = re.compile(
    r"\bXid\b|uncorrectable ECC|ECC error|GPU is lost|NVML_ERROR_GPU_IS_LOST|fallen off the bus"
    r"|cudaErrorECCUncorrectable|CUDA error: unspecified launch failure",
    re.IGNORECASE,
)
_OOM = re.compile(
    r"CUDA out of memory|OutOfMemoryError|\bMemoryError\b|Cannot allocate memory"
    r"|std::bad_alloc|HIP out of memory",
)
_COMMUNICATION = re.compile(
    r"NCCL error|ncclSystemError|ncclInternalError|ncclRemoteError|ProcessGroupNCCL"
    r"|Watchdog caught collective operation timeout|gloo/transport|\[gloo\]|Gloo connectFullMesh"
    r"|Connection reset by peer|Connection closed by peer|DistNetworkError|DistStoreError"
    r"|Socket Timeout|Timed out .* (store|rendezvous)|Broken pipe"
    r"|Address already in use|Could not start gRPC server",
    re.IGNORECASE,
)
_EXCEPTION_LINE = re.compile(
    r"^[A-Za-z_][\w.]*: .*$|^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)$"
)
_TRACEBACK = "Traceback (most recent call last):"
#: what torch's log handling puts before each line of a rank's output
_RANK_PREFIX = re.compile(r"^\[[\w.-]+\]:")
#: argparse's last words, with exit code 2: `train.py: error: unrecognized arguments: ...`
_USAGE_ERROR = re.compile(r"^(?:\[[\w.-]+\]:)?(\S+: error: .+)$", re.MULTILINE)

#: Python's words for `python -m NAME` without a module NAME, with exit code 1
_NO_MODULE = re.compile(
    r"^(?:\[[\w.-]+\]:)?\S+: (No module named \S+|Error while finding module specification .+)$",
    re.MULTILINE,
)

#: a listening socket refused its port, as torch's store (`port: 29500, ... EADDRINUSE`)
#: and rove's TensorFlow server (`port 23456 of this node is taken`) say it
_PORT_IN_USE = re.compile(
    r"port: (\d+),[^\n]*EADDRINUSE|port (\d+) of this node is taken", re.IGNORECASE
)

_SEGFAULT_SIGNALS = {"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"}
_KILL_SIGNALS = {"SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"}


class Diagnosis(NamedTuple):
    kind: FailureKind
    reason: str

    @property
    def said(self) -> str:
        """As a sentence says it: "killed by SIGKILL", "oom: CUDA out of memory"."""
        return words.failure(self.kind.value, self.reason)


def signal_name(exit_code: int | None) -> str | None:
    """The signal behind an exit code: negative (Popen) or 128+N (shells)."""
    if exit_code is None:
        return None
    number = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else None
    if number is None:
        return None
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return None


#: What torch puts in a failure's error data when the worker wrote no error file
#: (a script without `@record`): placeholders, not messages.
_NO_MESSAGE = frozenset({"<NONE>", "<N/A>"})


def error_file_message(data: Any) -> str | None:
    """The exception line from torch's `@record` error file contents, if any.

    torch reports `{"message": "<NONE>"}` for a worker that wrote no error file;
    that is no message, and the caller falls back on the log tail.
    """
    if not data:
        return None
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError:
            text = data.strip()
            return text.splitlines()[-1] if text and text not in _NO_MESSAGE else None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    if isinstance(message, str) and message.strip() and message.strip() not in _NO_MESSAGE:
        return message.strip().splitlines()[-1]
    return None


def last_exception(log_tail: str) -> str | None:
    """`ValueError: bad config` from the last Python traceback in the log tail."""
    if _TRACEBACK not in log_tail:
        return None
    after = log_tail[log_tail.rindex(_TRACEBACK) :].splitlines()
    for line in reversed(after):
        text = _unprefixed(line)
        if text and not text.startswith(("File ", "^", "~")) and _EXCEPTION_LINE.match(text):
            return text
    return None


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
#: where installed code lives: a frame there is a library's, not the script's
_LIBRARY = re.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python\d[.\d]*[/\\]")


def where(error_data: Any = None, log_tail: str = "") -> str | None:
    """`train.py:42`: where the failing script raised, from the traceback in torch's error
    file or else the last one in the log tail: the innermost frame outside installed
    libraries (the innermost of all if every frame is a library's)."""
    stack = ""
    if isinstance(error_data, str):
        try:
            error_data = json.loads(error_data)
        except json.JSONDecodeError:
            error_data = None
    message = error_data.get("message") if isinstance(error_data, dict) else None
    if isinstance(message, dict):
        extra = message.get("extraInfo")
        if isinstance(extra, dict) and isinstance(extra.get("py_callstack"), str):
            stack = extra["py_callstack"]
    if not stack and _TRACEBACK in log_tail:
        stack = log_tail[log_tail.rindex(_TRACEBACK) :]
    frames = [(path, line) for path, line in _FRAME.findall(stack) if path != "<string>"]
    if not frames:
        return None
    own = [frame for frame in frames if not _LIBRARY.search(frame[0])]
    path, line = (own or frames)[-1]
    return f"{path}:{line}"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


def classify(exit_code: int | None, error_data: Any = None, log_tail: str = "") -> Diagnosis:
    """Classify one failed worker."""
    sig = signal_name(exit_code)
    recorded = error_file_message(error_data)
    exception = recorded or last_exception(log_tail)
    text = "\n".join(x for x in (exception or "", log_tail) if x)
    if _HARDWARE.search(text):
        line = next((x for x in text.splitlines() if _HARDWARE.search(x)), "hardware fault")
        return Diagnosis(FailureKind.HARDWARE, _clip(line))
    if _OOM.search(text):
        line = next((x for x in text.splitlines() if _OOM.search(x)), "out of memory")
        return Diagnosis(FailureKind.OOM, _clip(exception or line))
    if sig in _KILL_SIGNALS and not recorded:
        # (a worker whose error file records an exception raised it, and was then torn
        # down during its ending: the exception is what happened to it)
        return Diagnosis(FailureKind.KILLED, f"killed by {sig}")
    if _COMMUNICATION.search(text):
        line = next((x for x in text.splitlines() if _COMMUNICATION.search(x)), "")
        return Diagnosis(FailureKind.COMMUNICATION, _clip(exception or line))
    if sig in _SEGFAULT_SIGNALS:
        return Diagnosis(FailureKind.SEGFAULT, f"crashed with {sig}")
    if exception:
        return Diagnosis(FailureKind.USER_ERROR, _clip(exception))
    missing = _NO_MODULE.findall(log_tail) if exit_code == 1 else []
    if missing:
        return Diagnosis(FailureKind.USER_ERROR, _clip(f"python -m: {missing[-1]}"))
    usage = _USAGE_ERROR.findall(log_tail) if exit_code == 2 else []
    if usage:
        return Diagnosis(
            FailureKind.USER_ERROR, _clip(f"its command line was refused: {usage[-1]}")
        )
    if sig is not None:
        return Diagnosis(FailureKind.KILLED, f"killed by {sig}")
    said = f"exited with code {exit_code}"
    last = last_line(log_tail)  # (`sys.exit("no data in /mnt/x")` leaves it there)
    return Diagnosis(
        FailureKind.UNKNOWN, _clip(f"{said}; the last line it wrote: {last}") if last else said
    )


def last_line(log_tail: str) -> str | None:
    """The last line with words in a worker's log tail, without torch's rank prefix."""
    return next((t for t in map(_unprefixed, reversed(log_tail.splitlines())) if t), None)


def _unprefixed(line: str) -> str:
    """`line` without torch's rank prefix (`[default0]:`), stripped."""
    return _RANK_PREFIX.sub("", line).strip()


def read_tail(path: str | None, limit: int = LOG_TAIL_BYTES) -> str:
    """The last `limit` bytes of a log file (empty if there is none), reaching back into
    the file it was rotated from (`PATH.1`) when the newest is shorter."""
    if not path:
        return ""
    tail = b""
    for part in (path, path + ".1"):
        try:
            with open(part, "rb") as f:
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(0, size - (limit - len(tail))))
                tail = f.read() + tail
        except OSError:
            break
        if len(tail) >= limit:
            break
    return tail.decode("utf-8", "replace")


def port_in_use(text: str) -> int | None:
    """The port a listening socket could not have because another process held it, as
    the newest such line in `text` names it (torch's rendezvous store, rove's TensorFlow
    server), or None."""
    found = _PORT_IN_USE.findall(text)
    return int(found[-1][0] or found[-1][1]) if found else None
