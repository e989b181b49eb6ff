"""Structured logs: one JSON object per line on stdout.

Every record carries a UTC timestamp, the level, the event name (the log message) and any
``extra={...}`` fields given at the call site, such as model, version and request_id.

The service's own loggers (``service.*``) and its servers' (uvicorn, gunicorn) log at
``log_level``; every other library's at ``library_log_level`` (the root logger's level), so
that ``debug`` shows the service's steps and not, say, Pillow's PNG chunks; the access log
(``batchserve.access``) at info, as its own setting turns it on.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
# uvicorn adds color_message, an ANSI-coloured copy of the message.
_SKIPPED_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {
    "message",
    "asctime",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
            "logger": record.name,
        }
        for key, value in vars(record).items():
            if key not in _SKIPPED_ATTRIBUTES and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


#: The loggers that log at ``log_level``: the service's and its servers'.
SERVICE_LOGGERS = ("service", "uvicorn", "gunicorn")
ACCESS_LOGGER = "batchserve.access"


def logger_levels(level: str, library_level: str) -> dict[str, str]:
    """The level of each configured logger by name (``""`` is the root, every library's)."""
    return {
        "": library_level.upper(),
        **dict.fromkeys(SERVICE_LOGGERS, level.upper()),
        ACCESS_LOGGER: "INFO",
    }


def configure_logging(level: str = "info", library_level: str = "warning") -> None:
    """Send the service's, uvicorn's/gunicorn's and every library's logs to stdout as JSON
    lines, each at its level (``logger_levels``)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    for name, name_level in logger_levels(level, library_level).items():
        logging.getLogger(name).setLevel(name_level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "gunicorn.error"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
