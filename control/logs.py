"""structlog configuration shared by every rove process.

Logs go to stderr as readable lines (colored on a terminal), or as JSON lines
with `ROVE_LOG_FORMAT=json`. `ROVE_LOG_LEVEL` sets the level (default info).
Loggers are bound with the entity they speak for: job, node, rank, round, step.
"""

from __future__ import annotations

import logging
import os
import sys

import stamina.instrumentation
import structlog


def configure(level: str | None = None, fmt: str | None = None) -> None:
    level_name = (os.environ.get("ROVE_LOG_LEVEL") or level or "info").upper()
    fmt = fmt or os.environ.get("ROVE_LOG_FORMAT") or "console"
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info if fmt == "json" else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    # rove logs its retries itself, with the entity (rove.control.retry, the outboxes)
    stamina.instrumentation.set_on_retry_hooks([])


def silent(name: str) -> logging.Logger:
    """A logger that drops what it is given: for a library's own chatter that rove
    reports better itself (librdkafka retrying a connection every second)."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    logger.propagate = False
    return logger
