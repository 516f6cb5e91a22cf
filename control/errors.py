"""The control plane's errors.

One root (`RoveError`); each error says whether retrying can help
(`TemporaryError`) or not (`PermanentError`), and carries a message written for
the person who must act on it: what happened and what to do.
"""

from __future__ import annotations


class RoveError(Exception):
    """Root of every error rove raises on purpose."""


class PermanentError(RoveError):
    """Retrying the same call cannot succeed; a person or a caller must change something."""


class TemporaryError(RoveError):
    """The call may succeed later (a server is electing a leader, a connection is down).

    `retry_after` says how long to wait before the next try, in seconds; 0 leaves
    it to the retry policy's backoff (`rove.control.bus.retry`).
    """

    def __init__(self, message: str, *, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ConfigError(PermanentError):
    """Bad arguments or configuration given by the user."""


class BusUnavailableError(TemporaryError):
    """The NATS server could not be reached or JetStream did not answer in time."""


class PublishDeadlineError(BusUnavailableError):
    """A publish kept failing with retryable errors until its total deadline ran out."""


class FencedError(PermanentError):
    """The server refused a master write because a newer master was elected.

    The writer has been deposed: it must stop deciding and go back to standby.
    """


class NotAuthorizedError(ConfigError):
    """The server refused the connection's credentials (missing, wrong, or revoked)."""


class PermissionDeniedError(PermanentError):
    """The server refused a publish: these credentials' role may not write that subject."""


class LostEventsError(PermanentError):
    """The event stream no longer holds events a job's snapshot depends on."""


class UnknownJobError(PermanentError):
    """No event of the named job exists on the bus."""


class InvalidEventError(PermanentError):
    """A payload could not be decoded or does not fit the subject it arrived on."""


#: what an exception whose message is empty means, in words
_WITHOUT_MESSAGE = {
    "TimeoutError": "timed out",
    "CancelledError": "cancelled",
    "EOFError": "the connection closed",
    "BrokenPipeError": "the connection closed",
    "ConnectionResetError": "the connection was reset",
    "ConnectionRefusedError": "the connection was refused",
    "ConnectionClosedError": "the connection closed",
    "NoServersError": "no server answered",
    "NoRespondersError": "nothing answered (is JetStream enabled on the server?)",
}


def plain(exc: BaseException) -> str:
    """An exception as a person reads it, never Python's repr: its message (an OS
    error's own words and the path), or what its kind means when it has none."""
    if isinstance(exc, OSError) and exc.strerror:
        path = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{path}"
    text = " ".join(str(exc).split())
    if text and text != type(exc).__name__:
        return text[:300]
    name = type(exc).__name__
    if name in _WITHOUT_MESSAGE:
        return _WITHOUT_MESSAGE[name]
    words = "".join(f" {c.lower()}" if c.isupper() else c for c in name).strip()
    return words.removesuffix(" error") or name
