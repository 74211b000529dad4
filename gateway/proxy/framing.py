"""How a client connection reads the framing of a request (``ClientConnection`` in
``gateway.proxy.server``): the body length a head declares, the HTTP/2 preface a client
with prior knowledge opens with (and the HTTP/2 answer it gets), and the parser that
reads the body of an Upgrade request (llhttp stops at the end of its head).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import httptools

if TYPE_CHECKING:
    from gateway.proxy.server import ClientConnection


class StopParsingError(Exception):
    """Raised from a parser callback to stop reading the connection's input."""


def declared_body(headers: list[tuple[bytes, bytes]]) -> int:
    """The body a request head declares: -1 chunked, its Content-Length, or 0."""
    length = 0
    for name, value in headers:
        lower = name.lower()
        if lower == b"transfer-encoding":
            return -1  # (llhttp refuses Transfer-Encoding beside Content-Length)
        if lower == b"content-length":
            length = int(value)  # llhttp accepted it: digits only
    return length


# HTTP/2's connection preface (RFC 9113 3.4) as a client sends it; llhttp stops at "PRI".
H2_PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_H2_REASON: Final = b"HTTP/2 is not served here; use HTTP/1.1"
# An empty SETTINGS frame (the server's preface), then GOAWAY: last stream 0, error
# HTTP_1_1_REQUIRED (0xd), the reason as debug data.
H2_REFUSAL: Final = (
    b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    + len(_H2_REASON + b"\x00" * 8).to_bytes(3, "big")
    + b"\x07\x00\x00\x00\x00\x00"
    + b"\x00\x00\x00\x00\x00\x00\x00\x0d"
    + _H2_REASON
)


def h2_preface(parser: httptools.HttpRequestParser, data: bytes | memoryview) -> bool:
    """Whether the connection opened with HTTP/2's preface (llhttp refuses it)."""
    if bytes(data[:3]) == b"PRI":
        return True
    try:
        return bool(parser.get_method() == b"PRI")
    except httptools.HttpParserError:
        return False


class UpgradeBody:
    """Reads the body of an Upgrade request with a fresh llhttp parser told only its
    framing: the same strict parse (chunk sizes, lengths) as any other body, reported
    to the connection as the request's own body."""

    def __init__(self, conn: ClientConnection, framing: int) -> None:
        self.conn = conn
        self.reading = False  # llhttp has reached the end of the head
        self.done = False
        self.parser = httptools.HttpRequestParser(self)
        framing_line = (
            b"Transfer-Encoding: chunked" if framing < 0 else b"Content-Length: %d" % framing
        )
        self.parser.feed_data(b"PUT / HTTP/1.1\r\nHost: body\r\n" + framing_line + b"\r\n\r\n")

    def on_chunk_header(self) -> None:
        if not self.done:
            self.conn.on_chunk_header()

    def on_body(self, body: bytes) -> None:
        if not self.done:
            self.conn.on_body(body)

    def on_message_complete(self) -> None:
        if self.done:
            return
        self.done = True
        conn = self.conn
        conn.upgrade_body = None
        conn.on_message_complete()
        # Nothing after an Upgrade request is read: the connection closes after its answer.
        conn.dead_parser = True
        raise StopParsingError
