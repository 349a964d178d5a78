"""The one error hierarchy of anarchon. Every error has a stable ``code``."""

import re
from typing import ClassVar

__all__ = [
    "AnarchonError",
    "ConnectionFailedError",
    "InvalidJobError",
    "InvalidOptionError",
    "InvalidScheduleError",
    "LeaseLostError",
    "RunOverlapError",
    "SchedulerStateError",
    "ServerReplyError",
    "StoreFormatError",
    "TransportError",
    "UnsupportedClientError",
    "UnsupportedServerError",
    "reason",
]


class AnarchonError(Exception):
    """Base class of every error anarchon raises on purpose.

    ``code`` is stable across releases, so code that handles errors can match
    on it instead of on the message::

        try:
            async with scheduler:
                ...
        except AnarchonError as exc:
            if exc.code == "ANARCHON_STORE_FORMAT":
                ...

    An error is made with its message, as any exception (``InvalidOptionError("...")``);
    ``str(exc)`` is the code, a colon and the message. Each subclass has its own code
    (the table is on the Errors page).

    Attributes:
        code: The error's stable code, such as ``"ANARCHON_STORE_FORMAT"``: a class
            attribute, the same for every error of the class.
    """

    code: ClassVar[str] = "ANARCHON_ERROR"

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    @property
    def message(self) -> str:
        """The message without the code."""
        return super().__str__()


class StoreFormatError(AnarchonError):
    """The prefix's store cannot be used: it holds a format newer than this anarchon reads,
    its format key holds another program's data, or the server's ACL refuses it."""

    code = "ANARCHON_STORE_FORMAT"


class UnsupportedServerError(AnarchonError):
    """The server lacks something the chosen strategy needs."""

    code = "ANARCHON_UNSUPPORTED_SERVER"


class InvalidScheduleError(AnarchonError, ValueError):
    """A cron expression, interval or time zone that cannot be used."""

    code = "ANARCHON_INVALID_SCHEDULE"


class InvalidJobError(AnarchonError, ValueError):
    """A job definition that cannot be used (its name, its handler's signature, or a
    second job of that name)."""

    code = "ANARCHON_INVALID_JOB"


class InvalidOptionError(AnarchonError, ValueError):
    """An option of the scheduler, a backend or a job with a value that cannot work."""

    code = "ANARCHON_INVALID_OPTION"


class UnsupportedClientError(AnarchonError, TypeError):
    """A client object anarchon cannot talk through, or not under this event loop."""

    code = "ANARCHON_UNSUPPORTED_CLIENT"


class ConnectionFailedError(AnarchonError):
    """The server could not be reached."""

    code = "ANARCHON_CONNECTION"


class SchedulerStateError(AnarchonError, RuntimeError):
    """A call that does not fit the scheduler's current state (e.g. starting it twice)."""

    code = "ANARCHON_SCHEDULER_STATE"


class RunOverlapError(AnarchonError):
    """``run_now()`` was refused: another run of the job is unsettled (it holds a live
    lease, waits for its retry, or is orphaned) and the job does not allow overlapping
    runs, or the job's runs in the fleet hold every permit of its
    ``max_concurrent_fleet``, or its runs reached its ``max_runs`` (it is finished)."""

    code = "ANARCHON_OVERLAP"


class LeaseLostError(AnarchonError):
    """Raised by ``run.raise_if_lost()`` in a handler whose attempt no longer holds its
    lease (it was refused by the store, or the scheduler is stopping). Let it propagate:
    the attempt is recorded as cancelled and, with attempts left, released for a retry."""

    code = "ANARCHON_LEASE_LOST"


def reason(exc: BaseException | str) -> str:
    """What went wrong, for a message of anarchon's that wraps it: an anarchon error's
    message without its code (the wrapping error has its own), any other's text, without
    a closing period (the message goes on)."""
    text = exc.message if isinstance(exc, AnarchonError) else str(exc)
    return text.rstrip(". ")


_SCRIPT_INNER_CODE = re.compile(r"Error running script.*?: -([A-Z]{2,}) ")


class ServerReplyError(AnarchonError):
    """The server answered a command with an error reply (``ERR ...``, ``NOSCRIPT ...``,
    ``NOPERM ...``).

    Args:
        message: The error reply's text, as the server sent it.
        kind: The reply's own error code, for adapters whose library strips it from
            the message. None: the message's first word if it is in capitals, else
            ``"ERR"``.

    Attributes:
        kind: The reply's own error code, such as ``"NOSCRIPT"``, ``"NOPERM"`` or
            ``"ERR"`` (for a script's error on Redis before 7, the code of the command
            that failed inside it, such as ``"OOM"``).
    """

    code = "ANARCHON_SERVER_REPLY"

    def __init__(self, message: str, kind: str | None = None) -> None:
        super().__init__(message)
        if kind is None:
            word = message.split(" ", 1)[0]
            kind = word if word.isupper() else "ERR"
        if kind == "ERR":
            # Redis before 7 wraps the error of a command inside a script:
            # "ERR Error running script (...): ... -OOM command not allowed ...".
            inner = _SCRIPT_INNER_CODE.search(message)
            if inner:
                kind = inner.group(1)
        self.kind = kind


class TransportError(AnarchonError):
    """The command may not have reached the server, or its reply was lost (a reset or
    refused connection, a timeout)."""

    code = "ANARCHON_TRANSPORT"
