"""Log lines as JSON objects (``JsonLogFormatter``), and the command line's log setup."""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["JsonLogFormatter", "configure_logging"]

#: What every ``LogRecord`` has: anything else on a record came from ``extra=``.
_RECORD_FIELDS = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}


class JsonLogFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message``, each field the call passed in ``extra=`` (anarchon's own lines carry
    ``job``, ``slot_ms``, ``attempt``, ``runner`` where they speak of a run), and
    ``exception`` with the traceback when there is one::

        handler = logging.StreamHandler()
        handler.setFormatter(anarchon.JsonLogFormatter())
        logging.getLogger("anarchon").addHandler(handler)

    It is made with no arguments: the line's form is fixed (``logging.Formatter``'s
    ``fmt``, ``datefmt`` and ``style`` do not change it).
    """

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC)
            .isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS and not name.startswith("_"):
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exception"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def configure_logging(level: str, log_format: Literal["plain", "json"]) -> None:
    """The command line's logging: every logger at ``level`` to standard error, as plain
    lines or JSON objects."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
