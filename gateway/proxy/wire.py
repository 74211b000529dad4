"""Bytes on the wire: response heads, the gateway's own JSON answers, chunk framing.

The data plane writes HTTP/1.1 by hand-assembling a few ``bytes`` joins: no response
objects, no multidicts (the framework's per-response machinery was ~25% of a deny-flood
profile; see benchmarks/README.md, "Data plane"). Parsing is never done here: llhttp
(httptools) parses both directions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

REASONS: Final[dict[int, bytes]] = {s.value: s.phrase.encode() for s in HTTPStatus}
CRLF: Final = b"\r\n"
CONTINUE_100: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
CHUNKED_END: Final = b"0\r\n\r\n"
JSON_TYPE: Final = b"Content-Type: application/json\r\n"
CLOSE: Final = b"Connection: close\r\n"
KEEP_ALIVE: Final = b"Connection: keep-alive\r\n"


class _DateLine:
    """The ``Date`` line and the second it is for (an instance's attributes: compiled
    code reads a module global through a dict)."""

    def __init__(self) -> None:
        self.second = 0
        self.line = b""


_DATE: Final = _DateLine()
_time: Final = time.time


def date_line() -> bytes:
    """``Date: ...\\r\\n``, formatted once per second, not once per response."""
    date = _DATE
    now = int(_time())
    if now != date.second:
        date.second = now
        date.line = b"Date: " + formatdate(now, usegmt=True).encode() + CRLF
    return date.line


def status_line(status: int, reason: bytes | None = None) -> bytes:
    if reason is None:
        reason = REASONS.get(status, b"Unknown")
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """``Name: value\\r\\n`` lines; values come from the gateway (ASCII by construction)."""
    return b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in headers)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def json_body(detail: str) -> bytes:
    return json.dumps({"detail": detail}).encode()


class Answer:
    """One of the gateway's own responses, ready to write but for the connection-level
    fields (``Date``, ``Connection``) that depend on the moment and the connection."""

    __slots__ = ("body", "head", "status")

    def __init__(self, status: int, head: bytes, body: bytes) -> None:
        self.status = status
        self.head = head  # status line + headers, without Date/Connection and the blank line
        self.body = body

    @classmethod
    def json(cls, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> Answer:
        head = (
            status_line(status)
            + JSON_TYPE
            + b"Content-Length: %d\r\n" % len(body)
            + header_lines(headers)
        )
        return cls(status, head, body)

    @classmethod
    def error(cls, status: int, detail: str, headers: Iterable[tuple[str, str]] = ()) -> Answer:
        return cls.json(status, json_body(detail), headers)

    def encode(self, *, keep_alive: bool, head_only: bool, extra: bytes = b"") -> bytes:
        """The whole response; ``extra`` is pre-encoded header lines (X-Request-Id)."""
        connection = KEEP_ALIVE if keep_alive else CLOSE
        # (one join: each + copied everything before it again)
        if head_only:
            return b"".join((self.head, extra, date_line(), connection, CRLF))
        return b"".join((self.head, extra, date_line(), connection, CRLF, self.body))
