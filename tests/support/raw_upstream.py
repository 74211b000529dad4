"""A recording upstream on raw TCP: what exactly did the proxy send?

Each connection is parsed with httptools (llhttp, strict: no leniencies), one HTTP/1.1
request at a time. Every complete message is recorded with its method, target, header
list, trailer list and de-chunked body, plus the raw bytes that carried it; every request
is answered ``200 OK`` with a small fixed body (none for ``HEAD``), keeping the connection
alive when the request allows it; ``Expect: 100-continue`` gets its ``100 Continue``.
Bytes the parser refuses are recorded as an error (and answered with ``400``, then the
connection is closed), so a proxy emitting something a strict parser cannot read shows up
in the test instead of vanishing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httptools

RESPONSE_BODY = b"upstream-ok\n"
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@dataclass
class ReceivedRequest:
    """One request as the upstream parsed it."""

    connection: int
    method: bytes
    target: bytes
    version: str
    headers: list[tuple[bytes, bytes]]
    trailers: list[tuple[bytes, bytes]]
    body: bytes
    chunked: bool
    raw: bytes  # the bytes received on the connection while this message was parsed
    upgrade: bool = False


@dataclass
class ParseFailure:
    connection: int
    error: str
    raw: bytes


@dataclass
class Recording:
    requests: list[ReceivedRequest] = field(default_factory=list)
    failures: list[ParseFailure] = field(default_factory=list)
    incomplete: list[bytes] = field(default_factory=list)  # connections closed mid-message

    def clear(self) -> None:
        self.requests.clear()
        self.failures.clear()
        self.incomplete.clear()


class _RecordingProtocol(asyncio.Protocol):
    """httptools callbacks for one connection (llhttp calls them synchronously)."""

    def __init__(self, server: RawUpstream, number: int) -> None:
        self._server = server
        self._number = number
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._reset_message()
        self._raw = bytearray()  # bytes since the current message began
        self._closing = False

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._server.connections += 1
        self._server._transports.add(transport)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._raw += data
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # The message was complete (and recorded) before llhttp paused; whatever follows
            # is no longer HTTP. Record it as such and close after the answer.
            tail = data[int(upgrade.args[0]) :]
            if tail:
                self._server.recording.failures.append(
                    ParseFailure(self._number, "bytes after an upgrade request", tail)
                )
            self._close()
        except httptools.HttpParserError as exc:
            self._server.recording.failures.append(
                ParseFailure(self._number, f"{type(exc).__name__}: {exc}", bytes(self._raw))
            )
            self._write(BAD_REQUEST)
            self._close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._server._transports.discard(self._transport)
        if self._in_message:
            self._server.recording.incomplete.append(bytes(self._raw))

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._reset_message()
        self._in_message = True

    def on_url(self, url: bytes) -> None:
        self._target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        (self._trailers if self._headers_done else self._headers).append((name, value))

    def on_headers_complete(self) -> None:
        self._headers_done = True
        # RFC 9110 10.1.1: an origin server answers a 100-continue expectation at once
        # (a client that waits for it would otherwise wait for ever).
        expects = [v.strip().lower() for n, v in self._headers if n.lower() == b"expect"]
        if b"100-continue" in expects and self._parser.get_http_version() == "1.1":
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_chunk_header(self) -> None:
        self._chunked = True

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        parser = self._parser
        method = parser.get_method()
        upgrade = parser.should_upgrade()
        self._server.recording.requests.append(
            ReceivedRequest(
                connection=self._number,
                method=method,
                target=bytes(self._target),
                version=parser.get_http_version(),
                headers=self._headers,
                trailers=self._trailers,
                body=bytes(self._body),
                chunked=self._chunked,
                raw=bytes(self._raw),
                upgrade=upgrade,
            )
        )
        self._raw = bytearray()
        self._in_message = False
        keep_alive = parser.should_keep_alive() and not upgrade
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n"
            % len(RESPONSE_BODY)
            + (b"Connection: keep-alive\r\n" if keep_alive else b"Connection: close\r\n")
            + b"\r\n"
        )
        self._write(head if method == b"HEAD" else head + RESPONSE_BODY)
        if not keep_alive:
            self._close()

    # helpers

    def _reset_message(self) -> None:
        self._target = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._trailers: list[tuple[bytes, bytes]] = []
        self._headers_done = False
        self._body = bytearray()
        self._chunked = False
        self._in_message = False

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _close(self) -> None:
        self._closing = True
        if self._transport is not None:
            self._transport.close()


class RawUpstream:
    """``async with running_raw_upstream() as up``: ``up.url``, ``up.recording``."""

    def __init__(self) -> None:
        self.recording = Recording()
        self.connections = 0
        self._transports: set[asyncio.Transport] = set()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        counter = iter(range(1, 1 << 62))
        self._server = await loop.create_server(
            lambda: _RecordingProtocol(self, next(counter)), "127.0.0.1", 0
        )
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for transport in list(self._transports):
                transport.close()
            await self._server.wait_closed()


@asynccontextmanager
async def running_raw_upstream() -> AsyncIterator[RawUpstream]:
    upstream = RawUpstream()
    await upstream.start()
    try:
        yield upstream
    finally:
        await upstream.stop()
