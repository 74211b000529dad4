"""Where logs go: the access log to its own destination, nothing but access lines (one
JSON object a line with ``--access-log json``, what Fluent Bit, Vector and Loki read),
and the application's own logs to stderr, as text or as JSON lines (``log_format``).

The access log's file is reopened when it was rotated away (``logging``'s
WatchedFileHandler checks before each write) and on SIGUSR1 (``reopen_access_log``), so
logrotate may move it or copy-truncate it."""

from __future__ import annotations

import datetime as dt
import json
import logging
import logging.handlers
import sys
from typing import Final

ACCESS_LOGGER: Final = "gateway.access"
STDOUT: Final = "-"


class JsonFormatter(logging.Formatter):
    """One JSON object a record: time (UTC, ms), level, logger, message (and the
    exception's text when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        when = dt.datetime.fromtimestamp(record.created, dt.UTC)
        payload: dict[str, object] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            payload["exception"] = self.formatException(record.exc_info)
        return json.dumps(payload, ensure_ascii=False)


def configure_logging(level: str, log_format: str = "text", access_log_file: str = STDOUT) -> None:
    """Application logs to stderr; access lines, bare, to ``access_log_file`` (``-``:
    stdout)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_gateway", False):
            root.removeHandler(handler)
    app_handler = logging.StreamHandler(sys.stderr)
    app_handler.setFormatter(
        JsonFormatter()
        if log_format == "json"
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    app_handler._gateway = True  # type: ignore[attr-defined]
    root.addHandler(app_handler)
    root.setLevel(level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    for handler in list(access.handlers):
        access.removeHandler(handler)
        handler.close()
    access_handler: logging.Handler
    if access_log_file == STDOUT:
        access_handler = logging.StreamHandler(sys.stdout)
    else:
        access_handler = logging.handlers.WatchedFileHandler(access_log_file, encoding="utf-8")
    access_handler.setFormatter(logging.Formatter("%(message)s"))  # the line as it is
    access.addHandler(access_handler)
    access.setLevel(logging.INFO)
    access.propagate = False  # nothing but access lines there, and none on stderr


def reopen_access_log() -> None:
    """SIGUSR1: the access log's file is opened again at its path (after a rotation)."""
    for handler in logging.getLogger(ACCESS_LOGGER).handlers:
        if isinstance(handler, logging.FileHandler):
            handler.acquire()
            try:
                if handler.stream is not None:
                    handler.stream.close()
                handler.stream = handler._open()
            finally:
                handler.release()
