"""structlog configuration shared by every rove process.

Logs go to stderr as readable lines (colored on a terminal), or as JSON lines
with `ROVE_LOG_FORMAT=json`. `ROVE_LOG_LEVEL` sets the level (default info).
Loggers are bound with the entity they speak for: job, node, rank, round, step.

A job's launcher (`rove run`) keeps the console for people (`to_job_log`): its
structured log goes to a file in the job's folder, and the console gets short
sentences, the lines logged with `say=True` (a round formed, a failure and its
diagnosis, training again after one) and every warning and error, each as
`rove: <what happened>`. `-v` (`ROVE_VERBOSE=1`) puts the whole log on the console
as well.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, TextIO

import stamina.instrumentation
import structlog

from rove.control.errors import plain

#: How many items of a long list a readable line shows (`--json` shows them all).
SHOWN = 8


def some(names: list[str], most: int = SHOWN) -> str:
    """`a, b, c`, or the first `most` and how many more: a list in a line that does not
    grow with the cluster (a log line, `rove status`)."""
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[:most])} and {len(names) - most:,} more"


#: Levels whose lines a job's console always gets.
_LOUD = frozenset({"warning", "error", "critical"})

#: Whether rove configured structlog in this process (its daemons, commands and
#: launcher). Elsewhere, in a user's process (a worker), rove's modules log through
#: their own pipeline (`get`) and leave the process's structlog as its user set it.
_CONFIGURED = False


def to_dev_null(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null: every holder of it (Python's exit
    flush, a library's handler, a raw write) then writes where nothing fails. Its reader
    went away (`| head`), or its disk refused it."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)
    except (OSError, ValueError):
        pass


class SurvivingConsole:
    """sys.stderr of a long-lived rove process (`rove run`, the daemons): once the
    console goes away (the reader of its pipe exited: `rove run ... 2>&1 | head`; a
    redirect's disk filled), its descriptor is pointed at /dev/null and what is said
    after is dropped. The job goes on, its log keeps everything, and the workers'
    output is still kept in the job's folder (`rove logs`). (A write raised
    BrokenPipeError in whichever line came next: a supervised task died of it, its
    supervisor's line about that died too, and the node hung, deaf to SIGTERM.)"""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BlockingIOError:  # a full non-blocking pipe: this line is lost, not the rest
            return len(text)
        except (OSError, ValueError):
            self._went()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            self._went()

    def _went(self) -> None:
        if self.gone:
            return
        self.gone = True
        to_dev_null(self.stream)
        try:  # what the stream still holds goes there too
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class KeptLog:
    """The job's log file (`to_job_log`). A line the disk refuses (full, gone) is
    dropped, said once on the console, and the next lines try again: the job goes on.
    (The error came out of the log call: the agent's task died of it, so did the node,
    and a full log disk ended a job that could have trained on.)"""

    def __init__(self, stream: TextIO, path: Path) -> None:
        self.stream = stream
        self.path = path
        self.refused = False  # the disk refused a line (said once till one reaches it)

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError) as exc:
            self._refused(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError) as exc:
            self._refused(exc)
        else:
            self.refused = False

    def _refused(self, exc: BaseException) -> None:
        if self.refused:
            return
        self.refused = True
        print(
            f"rove: cannot write rove's log {self.path} ({plain(exc)}): its lines are dropped "
            "until it can be written again; the job goes on",
            file=sys.stderr,
            flush=True,
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def survive_the_console() -> None:
    """Make this process's stderr a `SurvivingConsole` (idempotent), before logging is
    configured: structlog's printer keeps the stream it is given."""
    if not isinstance(sys.stderr, SurvivingConsole):
        sys.stderr = SurvivingConsole(sys.stderr)


def configure(level: str | None = None, fmt: str | None = None) -> None:
    """Every line to stderr (the daemons and one-shot commands)."""
    _configure(level, fmt, sys.stderr, console=None)


def verbose() -> bool:
    """Whether `ROVE_VERBOSE` asks for the whole log on the console."""
    return os.environ.get("ROVE_VERBOSE", "").strip().lower() not in ("", "0", "false", "no")


def to_job_log(path: Path, *, everything: bool = False) -> Path:
    """A job's launcher: the structured log to `path` (appended; JSON lines unless
    `ROVE_LOG_FORMAT` says otherwise), short sentences on the console, or with
    `everything` every line on the console too. Returns the path.

    Raises:
        OSError: the file cannot be opened.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    out = KeptLog(path.open("a", buffering=1, encoding="utf-8"), path)
    _configure(None, os.environ.get("ROVE_LOG_FORMAT") or "json", out, console=everything)  # type: ignore[arg-type]
    return path


def _configure(level: str | None, fmt: str | None, out: TextIO, console: bool | None) -> None:
    """`console`: None, every line goes to `out` alone; False, `out` gets every line and
    stderr the short ones; True, both get every line."""
    level_name = (os.environ.get("ROVE_LOG_LEVEL") or level or "info").strip().upper()
    fmt = (fmt or os.environ.get("ROVE_LOG_FORMAT") or "console").strip().lower()
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=False),
        structlog.processors.StackInfoRenderer(),
    ]
    if console is not None:
        processors.append(_Console(everything=console))
    else:
        processors.append(_drop_say)
    processors += [
        structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
        renderer,
    ]
    global _CONFIGURED
    _CONFIGURED = True
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
    # rove logs its retries itself, with the entity (rove.control.bus.retry, the outboxes)
    stamina.instrumentation.set_on_retry_hooks([])


def _drop_say(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event.pop("say", None)
    return event


class _Console:
    """The console's share of a line that goes to the job's log."""

    def __init__(self, *, everything: bool) -> None:
        self.everything = everything
        self.render = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())

    def __call__(
        self, logger: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        said = bool(event.pop("say", False))
        if self.everything:
            line = self.render(logger, method, dict(event))
            print(line, file=sys.stderr, flush=True)
        elif said or event.get("level") in _LOUD:
            print(f"rove: {short(event)}", file=sys.stderr, flush=True)
        return event


def short(event: Mapping[str, Any]) -> str:
    """A log line as one sentence for a person: what happened, and the error if any
    (the traceback stays in the job's log)."""
    text = str(event.get("event", ""))
    error = event.get("error")
    if error and str(error) not in text:
        text = f"{text}: {error}"
    exc = event.get("exc_info")
    if isinstance(exc, BaseException):
        text = f"{text}: {type(exc).__name__}: {exc}"
    return text


def silent(name: str) -> logging.Logger:
    """A logger that drops what it is given: for a library's own chatter that rove
    reports better itself (librdkafka retrying a connection every second)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger


class RoveLogger:
    """The logger of a rove module that may run in a user's process (the bus, the data
    client, the checkpointers): structlog's, as configured, in rove's own processes;
    in any other process rove's own pipeline (`_in_users_process`), so that a worker's
    stdout and its user's structlog configuration stay the user's. Resolved at each
    call: a module imported before its process configured logging follows it."""

    __slots__ = ("_bound", "_name", "_ours", "_users")

    def __init__(self, name: str, bound: Mapping[str, Any] | None = None) -> None:
        self._name = name
        self._bound = dict(bound or {})
        self._ours: Any = None
        self._users: Any = None

    def bind(self, **values: Any) -> RoveLogger:
        return RoveLogger(self._name, {**self._bound, **values})

    def _target(self) -> Any:
        if _CONFIGURED:
            if self._ours is None:  # (structlog's lazy proxy: follows reconfiguration)
                self._ours = structlog.get_logger(self._name, **self._bound)
            return self._ours
        if self._users is None:
            self._users = _in_users_process().bind(**self._bound)
        return self._users

    def __getattr__(self, method: str) -> Any:
        return getattr(self._target(), method)


def get(name: str) -> RoveLogger:
    """A rove module's logger (`RoveLogger`): `log = logs.get("rove.data")`."""
    return RoveLogger(name)


_USERS: Any = None


def _in_users_process() -> Any:
    """rove's pipeline in a process rove did not configure: warnings and errors (or
    `ROVE_LOG_LEVEL`) to stderr as `rove: rank N: what happened`, never to stdout, and
    stamina's own retry lines off where nobody chose stamina's hooks (rove logs its
    retries itself, with what it retried)."""
    global _USERS
    if _USERS is None:
        level = (os.environ.get("ROVE_LOG_LEVEL") or "warning").upper()
        rank = os.environ.get("RANK")
        _USERS = structlog.wrap_logger(
            structlog.PrintLogger(sys.stderr),
            processors=[
                structlog.contextvars.merge_contextvars,
                structlog.processors.add_log_level,
                _Short(f"rove: rank {rank}: " if rank else "rove: "),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(
                logging.getLevelNamesMapping().get(level, logging.WARNING)
            ),
            cache_logger_on_first_use=True,
        )
        _quiet_stamina_unless_chosen()
    return _USERS


#: Keys a worker's line does not repeat as `key=value` (`short` says them, or they say
#: nothing to a person).
_SAID = frozenset({"event", "error", "exc_info", "level", "say", "timestamp"})


class _Short:
    """A user's process's line: one sentence (`short`), then the line's other fields as
    `key=value` (the step a warning names), its traceback after it."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, _: Any, __: str, event: MutableMapping[str, Any]) -> str:
        exc = event.get("exc_info")
        line = self.prefix + short(event)
        for key, value in event.items():
            if key not in _SAID:
                shown = repr(value) if isinstance(value, str) and " " in value else value
                line += f" {key}={shown}"
        if exc is True or isinstance(exc, BaseException):
            err = sys.exc_info()[1] if exc is True else exc
            if err is not None:
                line += "\n" + "".join(traceback.format_exception(err)).rstrip()
        return line


def _quiet_stamina_unless_chosen() -> None:
    """stamina's default hooks log every retry as a warning through the process's
    structlog: in a worker, during a NATS outage, lines on the user's stdout that say
    less than rove's own. Turned off only where nobody set stamina's hooks (stamina's
    private `CONFIG._on_retry` is None then; checked by tests/test_logs.py)."""
    from stamina import _config

    config = getattr(_config, "CONFIG", None)
    if config is not None and getattr(config, "_on_retry", "set") is None:
        stamina.instrumentation.set_on_retry_hooks([])
