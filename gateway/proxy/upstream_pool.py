"""Keep-alive HTTP/1.1 connections to upstreams, on asyncio Protocols with llhttp.

One connection carries one exchange at a time (no pipelining to upstreams). Response
bytes are parsed by httptools' response parser in strict mode and handed, as callbacks,
to the exchange that owns the connection (``gateway.proxy.relay``): no client objects,
no per-request timers. This replaced aiohttp's ``ClientSession`` on the proxy path, about
a quarter of the proxied profile (benchmarks/README.md, "Data plane").

A connection keeps the last response it read whole in one read; a read that repeats its
head byte for byte with a body of the same length (an upstream's usual answer, again) is
handed on without running the parser: about a tenth of a proxied request's instructions
(benchmarks/README.md, "twenty-fourth step").
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, cast
from urllib.parse import urlsplit

import httptools

from gateway.proxy.batched_writes import BatchedTransport, write_batch

if TYPE_CHECKING:
    from gateway.proxy.relay import Relay

# The clock, bound once: a module attribute is a dict lookup on every call.
_monotonic: Final = time.monotonic

IDLE_SECONDS: Final = 30.0  # an idle upstream connection is closed after this long

# A response head longer than this, or of more fields, is never kept for
# ``UpstreamConnection``'s fast path: what a connection keeps is one head's bytes and its
# field list, bounded by both (8 KiB of only empty fields would be ~1,600 of them).
MAX_KEPT_RESPONSE_HEAD: Final = 8192
MAX_KEPT_RESPONSE_FIELDS: Final = 64


def response_head_bytes(read: bytes) -> bytes | None:
    """The response head's bytes at the start of ``read``, from the status line to the
    blank line, or None: not whole within MAX_KEPT_RESPONSE_HEAD bytes, or after empty
    lines (llhttp skips those before a response; a kept "head" of none but them would
    match any read that starts with empty lines, whatever head follows). Strict llhttp
    ends a head at its first blank line, so these are the bytes it parsed as the head."""
    if not read.startswith(b"HTTP/"):
        return None
    end = read.find(b"\r\n\r\n", 0, MAX_KEPT_RESPONSE_HEAD)
    return read[: end + 4] if end >= 0 else None


@dataclass(frozen=True, slots=True)
class Upstream:
    """A named upstream: ``base_url`` is scheme://host:port with an optional path prefix."""

    name: str
    base_url: str
    preserve_host: bool = True
    # A client's Upgrade (WebSocket ...) is passed on and, after a 101, the connections are
    # joined (gateway.proxy.tunnel); otherwise Upgrade is dropped and the request is HTTP.
    upgrade: bool = False

    def address(self) -> tuple[str, int, bool, str]:
        """(host, port, tls, path prefix)."""
        parts = urlsplit(self.base_url)
        tls = parts.scheme == "https"
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if tls else 80)
        return host, port, tls, parts.path.rstrip("/")

    def host_header(self) -> str:
        """``host:port``, the Host header it gets when it does not keep the client's (an
        IPv6 address in brackets, as RFC 9110's uri-host writes it, without a zone id,
        which RFC 6874 has a client remove before sending; it is kept for connecting)."""
        host, port, _, _ = self.address()
        if ":" in host:
            return f"[{host.partition('%')[0]}]:{port}"
        return f"{host}:{port}"


class _KeptResponse:
    """A response that came whole in one read (its head from the read's first byte, its
    body framed by Content-Length, nothing after it) and what llhttp made of its head.
    A later read of the same length that starts with the same head bytes is the same
    head with a body of the same length, whole: llhttp parses a message from its first
    byte the same way each time (no state carries over from the message before), so its
    callbacks are known without running it (``UpstreamConnection._answer_kept``)."""

    __slots__ = ("head", "headers", "reason", "status", "total")

    def __init__(
        self,
        head: bytes,
        total: int,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> None:
        self.head = head
        self.total = total  # the whole read: head and body
        self.status = status
        self.reason = reason
        self.headers = headers  # (never changed after: each parse makes a new list)


class UpstreamConnection(asyncio.Protocol):
    """One keep-alive connection; parses responses and reports them to its sink, the
    ``Relay`` of the request it carries (its "response side" methods). Compiled, the sink
    must be a ``Relay`` itself: a test's stand-in is refused with ``TypeError``."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int, bool]) -> None:
        self.pool = pool
        self.key = key
        self.transport: BatchedTransport | None = None
        # Typed by the class, not by a Protocol: mypyc then calls the relay's methods
        # directly, where a Protocol-typed call looks each method up by name (four a
        # request; benchmarks/README.md, "Third round, twenty-first step").
        self.sink: Relay | None = None
        self.reusable = True
        self.used = 0  # exchanges carried, for "a reused connection went stale" retries
        self.idle_since = 0.0
        self.received = False  # any response byte arrived for the current exchange
        self.head_only = False  # the current request is HEAD: the response has no body
        self.upgrade_asked = False  # the current request asks to switch protocols
        self._new_parser()
        self._headers: list[tuple[bytes, bytes]] = []
        self._reason = b""
        self._in_body = False
        self._finished = False  # the response is complete; reported after the read
        self._junk = False  # parsing a response nobody asked for (never reused)
        self._lost = False
        # The read being parsed when it starts with the response's first byte (the first
        # read of an exchange), else None: the response head's bytes for Relay.
        self._first_read: bytes | None = None
        # The last response this connection read whole in one read (see _KeptResponse),
        # and while a read is parsed, whether its response may become it: its head began
        # the read and it is a keep-alive response with a body to a request not HEAD and
        # not asking to switch protocols; ``_body_seen`` counts its body's bytes.
        self._kept: _KeptResponse | None = None
        self._keepable = False
        self._keepable_status = 0
        self._body_seen = 0

    def _new_parser(self) -> None:
        """A parser for the next response, its methods bound once (compiled code looks a
        method of httptools' up by name on each call: three a request here)."""
        parser = httptools.HttpResponseParser(self)  # (kept alive by its bound methods)
        self._feed_parser = parser.feed_data
        self._status_code = parser.get_status_code
        self._keep_alive = parser.should_keep_alive

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it; writes
        # wait for the end of the loop's turn (gateway.proxy.batched_writes)
        self.transport = BatchedTransport(
            cast(asyncio.Transport, transport), write_batch(asyncio.get_running_loop())
        )

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is None:
            # Bytes on an idle connection answer nothing we asked: never parse them into
            # the next exchange; the connection is not used again.
            self.reusable = False
            if self.transport is not None:
                self.transport.abort()
            return
        first = not self.received
        if first:
            self.received = True
            kept = self._kept
            if (
                kept is not None
                and len(data) == kept.total
                and not self.head_only
                and not self.upgrade_asked
                and data.startswith(kept.head)
            ):
                self._answer_kept(sink, kept, data)
                return
            self._first_read = data
            self._keepable = False
        try:
            self._feed_parser(data)
        except httptools.HttpParserUpgrade as exc:
            if self.upgrade_asked and not self._finished and self._status_code() == 101:
                # The asked-for switch: this connection leaves the pool for good and is
                # joined to the client's (gateway.proxy.tunnel).
                at = int(exc.args[0]) if exc.args else len(data)
                self.reusable = False
                self.sink = None
                self.pool.forget(self)
                sink.response_switched(self._reason, self._headers, bytes(data[at:]))
                return
            # A 101 nobody asked for (Upgrade is dropped where not offered): not HTTP now.
            if self._finished:
                self._stray()
            else:
                self._broken(ConnectionError("the upstream switched protocols unasked"))
        except httptools.HttpParserError as exc:
            if self._finished:
                self._stray()
            else:
                self._broken(exc)
        self._first_read = None
        if self._finished:
            if first and self._keepable:
                self._keep(data)
            # The exchange ends only now, outside llhttp: ending it inside a callback
            # would start the next exchange while this read is still being parsed.
            self._finished = False
            self._complete()
        sink.flush()

    def _keep(self, read: bytes) -> None:
        """Keep the response just parsed, whole in ``read``, when its head is the read's
        start up to the first blank line and the body llhttp found is the rest: then
        Content-Length framed it (a chunked body's framing is more than its bytes, and a
        body read to the connection's end is never whole in a read)."""
        head = response_head_bytes(read) if self.reusable else None  # (not after stray bytes)
        if (
            head is None
            or len(head) + self._body_seen != len(read)
            or len(self._headers) > MAX_KEPT_RESPONSE_FIELDS
        ):
            return
        self._kept = _KeptResponse(
            head, len(read), self._keepable_status, self._reason, list(self._headers)
        )

    def _answer_kept(self, sink: Relay, kept: _KeptResponse, data: bytes) -> None:
        """``data_received`` for a read that holds the kept response's head and a body of
        its length: the callbacks llhttp would make, in its order, without llhttp (the
        parser stays at a message's start, where it is between exchanges)."""
        try:
            sink.response_head(kept.status, kept.reason, kept.headers, True, data)
            size = len(kept.head)
            if size < len(data) and self.sink is not None:
                self.sink.response_body(data[size:])
        except BaseException as exc:
            # As a callback's failure inside llhttp ends: httptools turns any exception a
            # callback raises (a cancellation too) into HttpParserCallbackError, and the
            # exchange breaks (the connection aborted, the relay told).
            error = httptools.HttpParserCallbackError("a response callback failed")
            error.__context__ = exc
            self._broken(error)
            sink.flush()
            return
        self._complete()
        sink.flush()

    def eof_received(self) -> bool | None:
        if self.transport is not None:
            self.transport.flush()  # (it closes itself, not through the batch)
        return None  # close the transport; connection_lost reports the end

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.reusable = False
        self.pool.forget(self)
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.upstream_lost(exc)

    def pause_writing(self) -> None:
        if self.sink is not None:
            self.sink.upstream_writable(False)

    def resume_writing(self) -> None:
        if self.sink is not None:
            self.sink.upstream_writable(True)

    # --- llhttp callbacks

    def on_message_begin(self) -> None:
        if self._finished or self.sink is None:
            self._stray()  # a second response in one read: never anyone's answer
            self._junk = True
            return
        self._headers = []
        self._reason = b""
        self._in_body = False
        self._body_seen = 0

    def on_status(self, reason: bytes) -> None:
        if not self._junk:
            self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        # Trailers are not passed on; nor is anything after a HEAD, 204 or 304 response's
        # head (the head was handed on: its list is not changed after that).
        if not self._in_body and not self._junk and not self._finished:
            self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self._junk:
            return
        status = self._status_code()
        read, self._first_read = self._first_read, None  # (a head after it starts later)
        if 100 <= status < 200:
            return  # interim responses (100 Continue, 103) are not relayed; the final one is
        self._in_body = True
        keep_alive = self._keep_alive()
        if not keep_alive:
            self.reusable = False
        # (A head after a 1xx one starts no read; a response to HEAD has no body.)
        self._keepable = (
            read is not None
            and keep_alive
            and not self.head_only
            and not self.upgrade_asked
            and status != 204
            and status != 304
        )
        self._keepable_status = status
        if self.sink is not None:
            self.sink.response_head(status, self._reason, self._headers, keep_alive, read)
        if self.head_only or status in (204, 304):
            # llhttp cannot be told the request was HEAD: the message ends here, and a
            # fresh parser takes the next exchange. Whatever else the old parser still
            # finds in this read (a body sent after all) is stray.
            self._new_parser()
            self._in_body = False
            self._finished = True

    def on_body(self, body: bytes) -> None:
        if self._finished or self._junk:
            self._stray()
        else:
            self._body_seen += len(body)
            if self.sink is not None:
                self.sink.response_body(body)

    def on_message_complete(self) -> None:
        if self._in_body and not self._junk:
            self._in_body = False
            self._finished = True

    def _stray(self) -> None:
        """Bytes no request asked for: the connection is not used again."""
        self.reusable = False

    # ---

    def _complete(self) -> None:
        self._in_body = False
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.response_end()

    def _broken(self, exc: Exception) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.upstream_lost(exc)

    @property
    def closed(self) -> bool:
        return self._lost or self.transport is None or self.transport.is_closing()

    def start(self, sink: Relay, data: bytes, head_only: bool) -> None:
        """Begin an exchange: write the request head (and any body bytes already known)."""
        self.sink = sink
        self.received = False
        self.head_only = head_only
        if self.upgrade_asked:
            # Declined (an answer other than 101) or not: never reused after asking.
            self.reusable = False
        self.used += 1
        assert self.transport is not None
        self.transport.write(data)

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self._lost:
            self.transport.write(data)

    def pause_reading(self) -> None:
        if self.transport is not None and not self._lost:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self._lost:
            self.transport.resume_reading()

    def abort(self) -> None:
        self.reusable = False
        self.sink = None
        if self.transport is not None:
            self.transport.abort()


class UpstreamPool:
    """Idle connections per (host, port, tls), and a cap on connections open at once.

    ``acquire`` waits for a free slot when the cap is reached (the caller's deadline
    bounds the wait); idle connections are reused newest first and closed after
    ``IDLE_SECONDS``.
    """

    def __init__(self, limit: int, connect_timeout: float) -> None:
        self.limit = limit
        self.connect_timeout = connect_timeout
        self.open = 0
        self._idle: dict[tuple[str, int, bool], deque[UpstreamConnection]] = {}
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._all: set[UpstreamConnection] = set()
        self._tls: ssl.SSLContext | None = None

    def take_idle(self, host: str, port: int, tls: bool) -> UpstreamConnection | None:
        """An idle connection to reuse now, newest first (None: ``acquire`` one)."""
        idle = self._idle.get((host, port, tls))
        if not idle:
            return None
        now = _monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > IDLE_SECONDS:
                conn.abort()
                continue
            return conn
        return None

    async def acquire(self, host: str, port: int, tls: bool) -> UpstreamConnection:
        key = (host, port, tls)
        found = self.take_idle(host, port, tls)
        if found is not None:
            return found
        while self.open >= self.limit:
            self._close_one_idle()  # its slot frees when it has closed, and wakes us
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if not waiter.done():
                    waiter.cancel()
            idle = self._idle.get(key)
            while idle:
                conn = idle.pop()
                if not conn.closed:
                    return conn
        self.open += 1
        try:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.connect_timeout):
                _, protocol = await loop.create_connection(
                    lambda: UpstreamConnection(self, key),
                    host,
                    port,
                    ssl=self._ssl() if tls else None,
                    server_hostname=host if tls else None,
                )
        except BaseException:
            self.open -= 1
            self._wake()
            raise
        self._all.add(protocol)
        return protocol

    def release(self, conn: UpstreamConnection) -> None:
        """Give a connection back after an exchange ended (closed unless reusable)."""
        if conn.reusable and not conn.closed and conn.sink is None:
            conn.idle_since = _monotonic()
            # (not setdefault: its default deque would be made, and freed, every time)
            idle = self._idle.get(conn.key)
            if idle is None:
                idle = self._idle[conn.key] = deque()
            idle.append(conn)
            self._wake()
        else:
            conn.abort()

    def forget(self, conn: UpstreamConnection) -> None:
        """A connection closed (called once, from ``connection_lost``)."""
        if conn in self._all:
            self._all.discard(conn)
            self.open -= 1
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
            self._wake()

    def sweep(self) -> None:
        """Close connections idle for longer than ``IDLE_SECONDS``."""
        cutoff = _monotonic() - IDLE_SECONDS
        for idle in self._idle.values():
            while idle and idle[0].idle_since < cutoff:
                idle.popleft().abort()

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()

    def _close_one_idle(self) -> None:
        for idle in self._idle.values():
            if idle:
                idle.popleft().abort()  # connection_lost frees its slot later
                return

    def _wake(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _ssl(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls
