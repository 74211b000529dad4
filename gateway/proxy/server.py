"""One client connection of the proxy port: HTTP/1.1 on an asyncio Protocol, parsed by
llhttp (httptools); the port as a whole is ``gateway.proxy.plane.DataPlane``.

What this saves, against aiohttp's web layer (benchmarks/README.md, "Data plane"): no
request/response objects, router, middleware, multidicts or URL objects per request;
answers the gateway gives itself (429, 404, /ok, errors) are written from the parser
callback with no task and no await; one sweep timer per process enforces every
connection's deadlines instead of timers armed and cancelled per request.

Per connection, requests are answered strictly in order (pipelining); each has one of
these deadlines at a time, checked by the sweep: the head must arrive within
``header_timeout`` (else 408), a keep-alive connection idles at most
``client_idle_timeout``, the upstream must answer within ``upstream_timeout`` (504),
a request body may be silent at most ``body_read_timeout`` (408) and a response body
``upstream_read_timeout``. The number of open client connections is capped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Final, cast

import httptools

from gateway.policy.model import IdentityKind
from gateway.proxy.handler import Peer
from gateway.proxy.relay import (
    BUFFER_BEFORE_FORWARD,
    WAITING,
    Relay,
    request_head,
    stale_connection,
)
from gateway.proxy.request import Incoming
from gateway.proxy.request_id import new_request_id
from gateway.proxy.tls import peer_subject
from gateway.proxy.tunnel import Tunnel
from gateway.proxy.upstream_pool import Upstream, UpstreamConnection
from gateway.proxy.wire import CONTINUE_100, CRLF, Answer
from gateway.ratelimit.decision import Decision
from gateway.ratelimit.ports import CounterUnavailableError

if TYPE_CHECKING:
    from gateway.proxy.plane import DataPlane

log = logging.getLogger("gateway.proxy")

# Deadline kinds (one at a time per connection, besides the request body's own).
IDLE: Final = 1
HEAD: Final = 2
UPSTREAM: Final = 3
RESPONSE: Final = 4
MAX_PIPELINED: Final = 32  # queued requests after which reading pauses
# A read larger than this is parsed a slice at a time, the loop turning between slices
# (with reading paused): whatever the bytes hold (tiny chunks, tiny pipelined requests),
# one read never holds the event loop for more than about a millisecond.
FEED_SLICE: Final = 16 * 1024
# A chunked body may have at most this many chunks before its chunks must average at
# least MIN_MEAN_CHUNK bytes: llhttp calls back once per chunk, so the gateway's CPU
# per body byte would otherwise be the client's choice (hardening, second round, 2).
FREE_CHUNKS: Final = 1024
MIN_MEAN_CHUNK: Final = 64
LINGER_SECONDS: Final = 2.0  # reading (and dropping) after a final answer, before closing
NO_PEER: Final = Peer(None, False, "unknown")
# The methods llhttp knows, as str, without a decode per request.
_METHODS: Final = {
    m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
}
perf_counter: Final = time.perf_counter


class StopParsingError(Exception):
    """Raised from a parser callback to stop reading the connection's input."""


class BodyStalledError(Exception):
    """The client stopped sending its request body for longer than allowed."""


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, answer in order, relay."""

    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane
        self.gateway = plane.gateway
        self.limits = plane.limits
        self.loop = plane.loop
        self.transport: asyncio.Transport | None = None
        self.peer = NO_PEER
        self.identity_memo: dict[tuple[IdentityKind, str], str] = {}
        self.tls = plane.scheme == "https"  # client certificates may identify requests
        self.parser = httptools.HttpRequestParser(self)
        self.current: Incoming | None = None  # being parsed
        self.active: Incoming | None = None  # being answered
        self.pipeline: deque[Incoming] = deque()
        self.relay: Relay | None = None
        self.upstream: Upstream | None = None  # where the active request is forwarded
        self.upstream_address: tuple[str, int, bool, str] = ("", 0, False, "")  # its address
        self.attempt = 0
        self.forward_started = 0.0
        self.waiting_body = False  # a small body is read whole before forwarding
        self.paused: set[str] = set()
        self.reading_paused = False
        self.deadline = 0.0
        self.deadline_kind = 0
        self.body_deadline = 0.0
        self.in_head = False
        self.head_bytes = 0
        self.read_size = 0  # bytes of the read being parsed
        self.url: list[bytes] = []
        self.dead_parser = False  # after an upgrade or a parse error nothing more is read
        self.lost = False
        self.draining = False
        self.response_started = False
        self.pending_error: tuple[int, str] | None = None
        self.no_more = False  # a request said Connection: close: nothing after it is read
        self.head_fields = 0  # bytes of the head being parsed (target, names, values)
        self.got_bytes = False  # anything read at all (a silent socket is closed quietly)
        self.counted_address: str | None = None  # counted in plane.per_address
        # Bytes read but not parsed yet (a large read is parsed in slices), and where
        # the next slice starts.
        self.backlog: memoryview | None = None
        self.backlog_at = 0
        self.feed_scheduled = False
        # The body of an Upgrade request: llhttp (as httptools drives it) stops at the end
        # of an Upgrade request's head, so the body is read by a second parser told only
        # the framing (see _UpgradeBody).
        self.upgrade_body: _UpgradeBody | None = None
        # Once the upstream has switched protocols, the joined connections (the protocol
        # of this connection's transport is then the tunnel's: see gateway.proxy.tunnel).
        self.tunnel: Tunnel | None = None
        # Bytes that came after an Upgrade request's head (without a body), kept until
        # the upstream has answered: a tunnel passes them on (bounded; then reading pauses).
        self.upgrade_early: bytearray | None = None

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        plane = self.plane
        if len(plane.connections) >= self.limits.max_connections:
            plane.refused_connection()
            self.transport.abort()
            self.lost = True
            return
        peer = transport.get_extra_info("peername")
        self.peer = self.gateway.peer(peer[0] if isinstance(peer, tuple) else None)
        address = self.peer.address
        if address is not None and not self.peer.trusted:
            # One address may not hold every connection slot (a trusted proxy carries
            # many clients: its connections are not capped here).
            if not plane.connection_opened(address):
                plane.refused_connection(address)
                self.transport.abort()
                self.lost = True
                return
            self.counted_address = address
        plane.connections.add(self)
        # The head deadline runs from accept: a socket that never sends a byte holds a
        # connection slot for header_timeout, not client_idle_timeout.
        self._set_deadline(HEAD, self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.backlog = None
        self.plane.connection_closed(self)
        address, self.counted_address = self.counted_address, None
        if address is not None:
            self.plane.address_closed(address)
        if self.relay is not None:
            self.relay.client_lost()
        req = self.active
        if req is not None and self.relay is None:
            # Waiting for a decision or for the body: the request ends here (its task
            # sees it is no longer active). A relay ends its own request (499).
            if req.record is not None and req.record.status == 0:
                req.record.status = 499
            self._finish(req, keep=False)

    def data_received(self, data: bytes) -> None:
        if self.dead_parser or self.lost:
            early = self.upgrade_early
            if early is not None and not self.lost:
                self._keep_early(early, data)
            return
        self.got_bytes = True
        if self.backlog is not None or len(data) > FEED_SLICE:
            backlog = self.backlog
            if backlog is not None:  # (reading is paused: rare) keep the order
                data = bytes(backlog[self.backlog_at :]) + data
            self.backlog = memoryview(data)
            self.backlog_at = 0
            self.set_paused("backlog", True)
            if not self.feed_scheduled:
                self._feed_backlog()
            return
        self._feed(data)

    def _feed_backlog(self) -> None:
        """Parse the next slice of a large read; the rest after the loop has turned."""
        self.feed_scheduled = False
        backlog = self.backlog
        if backlog is None:
            return
        if self.dead_parser or self.lost:
            self.backlog = None
            return
        if len(self.paused) > 1:
            return  # held back (a body waits for its upstream...): set_paused resumes it
        start = self.backlog_at
        end = start + FEED_SLICE
        if end >= len(backlog):
            self.backlog = None
            self._feed(backlog[start:])
            if self.backlog is None:
                self.set_paused("backlog", False)
            return
        self.backlog_at = end
        self._feed(backlog[start:end])
        if self.backlog is not None and not self.feed_scheduled:
            self.feed_scheduled = True
            self.loop.call_soon(self._feed_backlog)

    def _feed(self, data: bytes | memoryview) -> None:
        if self.dead_parser or self.lost:
            return
        self.read_size = len(data)
        body = self.upgrade_body
        if body is not None:
            self._feed_upgrade_body(body, data)
            return
        upgrade_at = -1
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            # llhttp stops at the end of an Upgrade request's head. Upgrade is not
            # offered (the header is hop-by-hop and stripped): the request is answered
            # as plain HTTP and the connection closes after it. Its body, if it declared
            # one, is read whole first (never forwarded without it: request smuggling).
            body = self.upgrade_body
            upgrade_at = int(exc.args[0]) if exc.args else len(data)
            if body is None:
                # Nothing more is parsed; what follows may be the upgraded protocol's
                # first bytes, kept for a tunnel (see _forward).
                self.dead_parser = True
                early = self.upgrade_early
                if early is not None and upgrade_at < len(data):
                    self._keep_early(early, data[upgrade_at:])
                return
            # (the body is parsed after this except block: an error raised in it would
            # carry the upgrade as its context instead of its own cause)
        except httptools.HttpParserCallbackError as exc:
            self._callback_failed(exc)
            return
        except httptools.HttpParserError as exc:
            self.dead_parser = True
            if self.active is None and not self.pipeline and _h2_preface(self.parser, data):
                self._http2_refused()
            elif not self.no_more:  # after Connection: close llhttp refuses what follows
                self._protocol_error(exc)
            return
        if upgrade_at >= 0:
            if upgrade_at < len(data) and body is not None:
                self._feed_upgrade_body(body, data[upgrade_at:])
            return
        if self.in_head:
            if self.active is None and self.deadline_kind != HEAD:
                self._set_deadline(HEAD, self.limits.header_timeout)
            # Still inside a request head: llhttp keeps what it has not reported, so
            # the head's size is bounded here (a head never completes otherwise), also
            # for a pipelined head behind a request still being answered.
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_head_bytes:
                self._head_too_large()

    def _keep_early(self, early: bytearray, data: bytes | memoryview) -> None:
        early += data
        if len(early) >= EARLY_BYTES:
            self.set_paused("upgrade", True)  # the rest waits in the kernel

    def _feed_upgrade_body(self, body: _UpgradeBody, data: bytes | memoryview) -> None:
        try:
            body.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            self._callback_failed(exc)
            return
        except httptools.HttpParserError as exc:
            if not body.done:
                self.upgrade_body = None
                self.dead_parser = True
                self._protocol_error(exc)
            return

    def _callback_failed(self, exc: httptools.HttpParserCallbackError) -> None:
        """A parser callback raised: StopParsingError is ours (stop reading this input);
        anything else is a bug of ours, not the client's: drop the connection, say where."""
        if not isinstance(exc.__context__, StopParsingError):
            log.error("request parser callback failed", exc_info=exc.__context__)
            self.dead_parser = True
            if self.transport is not None:
                self.transport.abort()

    def _head_too_large(self) -> None:
        detail = f"request head is larger than {self.limits.max_head_bytes} bytes"
        if self.active is None:
            self._fatal(431, detail)
        else:
            self.dead_parser = True  # nothing more is read or kept
            self._after_active(431, detail)

    def eof_received(self) -> bool | None:
        # A half-closed client may still read its answers: keep the transport while a
        # request is being answered, close once it is done. A request whose head or
        # body was cut off can never complete: close (connection_lost ends it).
        if self.active is None and not self.pipeline:
            return False
        if self.current is not None or (self.active is not None and not self.active.body_done):
            return False
        for req in (self.active, *self.pipeline):
            if req is not None:
                req.keep_alive = False
        return True

    def pause_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_writable(False)

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_writable(True)

    # --- llhttp callbacks

    def on_message_begin(self) -> None:
        if self.no_more:
            # A request said Connection: close; what follows it is not read (RFC 9112 9.6).
            self.dead_parser = True
            raise StopParsingError
        req = Incoming()
        req.started = perf_counter()
        self.current = req
        self.url = []
        self.in_head = True
        self.head_fields = 0
        # The header-read deadline (HEAD) is set by data_received only if this head is
        # still incomplete when the read is parsed: most heads arrive in one read.

    def on_url(self, url: bytes) -> None:
        self.url.append(url)
        self.head_fields += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.current
        if self.in_head and req is not None:  # not trailers
            # RFC 9110 5.5: trailing SP / HTAB are not part of a field value (llhttp
            # drops the leading ones). Trimmed here, once, every header the gateway
            # reads (identities, Host, request id ...) and the one it forwards are the
            # value every conforming upstream reads: "K " is "K", not a fresh quota.
            size = len(value)  # (a native int: no truth test of the bytes object)
            if size:
                last = value[size - 1]
                if last == 32 or last == 9:
                    value = value.rstrip(b" \t")
                    size = len(value)
            self.head_fields += len(name) + size + 4  # ": " and CRLF
            req.headers.append((name, value))

    def on_chunk_header(self) -> None:
        req = self.current
        if req is None:
            return
        chunks = req.chunks = req.chunks + 1
        # (body_size holds the chunks before this one)
        if chunks > FREE_CHUNKS and (chunks - 1) * MIN_MEAN_CHUNK > req.body_size:
            self._refuse_body(
                req,
                Answer.error(
                    400,
                    f"chunked body of {chunks} chunks averaging under {MIN_MEAN_CHUNK} "
                    "bytes; send larger chunks",
                    req.rate_headers,
                ),
                "tiny_chunks",
            )

    def on_headers_complete(self) -> None:
        req = self.current
        assert req is not None
        parser = self.parser
        self.in_head = False
        # The head's size as parsed, whatever the reads it came in (one bound).
        req.head_size = self.head_fields
        self.head_bytes = 0
        if self.head_fields > self.limits.max_head_bytes:
            self.current = None
            self._head_too_large()
            raise StopParsingError
        method = parser.get_method()
        req.method = _METHODS.get(method) or method.decode("ascii")
        req.version = parser.get_http_version()
        req.keep_alive = parser.should_keep_alive()
        req.head_only = req.method == "HEAD"
        req.target = b"".join(self.url)
        if parser.should_upgrade():
            req.upgrade = True
            framing = declared_body(req.headers)
            if framing:
                self.upgrade_body = _UpgradeBody(self, framing)
            else:
                # (set before the request starts: its decision may be taken right here)
                self.upgrade_early = bytearray()
        if self.active is None:
            self._start(req)
        else:
            self.pipeline.append(req)
            if len(self.pipeline) >= MAX_PIPELINED:
                self.set_paused("pipeline", True)

    def on_body(self, body: bytes) -> None:
        req = self.current
        if req is not None:
            self._body(req, body)

    def on_message_complete(self) -> None:
        if self.upgrade_body is not None and not self.upgrade_body.reading:
            # llhttp's end of an Upgrade request's head: its body is still to come.
            self.upgrade_body.reading = True
            return
        req = self.current
        self.current = None
        if req is None:
            return
        req.body_done = True
        if not req.keep_alive:
            self.no_more = True
        if req is self.active:
            self.body_deadline = 0.0
        if req.upload_client is not None:
            self._end_upload(req)
        sink = req.sink
        if sink is not None:
            sink(b"")
            relay = self.relay
            if req is self.active and relay is not None and relay.phase == WAITING:
                self._set_deadline(UPSTREAM, self.limits.upstream_timeout)
        elif self.waiting_body:
            self._body_progress(req)

    # --- request bodies

    def _body(self, req: Incoming, data: bytes) -> None:
        req.body_size += len(data)
        if req.body_size > self.limits.max_body_bytes:
            self._body_too_large(req)
            return
        if req is self.active or self.active is None:
            self.body_deadline = self.loop.time() + self.limits.body_read_timeout
        sink = req.sink
        if sink is not None:
            sink(data)
            return
        req.body.append(data)
        if req.body_size >= BUFFER_BEFORE_FORWARD:
            self.set_paused("buffer", True)
            self._body_progress(req)

    def _discard(self, data: bytes) -> None:
        """Sink for the body of a request that was answered without reading it."""

    def body_sink_ready(self) -> None:
        self.set_paused("buffer", False)

    def _body_too_large(self, req: Incoming) -> None:
        self._refuse_body(req, self._too_large(req), "body_too_large")

    def _refuse_body(self, req: Incoming, answer: Answer, reason: str) -> None:
        """Refuse a request whose body cannot be read on: answer (if nothing of the
        response has been written yet) and close; the upstream connection is dropped."""
        self.plane.gateway.metrics.upstream_errors.labels(
            self.relay.upstream.name if self.relay else "-", reason
        ).inc()
        self.dead_parser = True
        if req is self.active and not self.response_started:
            if self.relay is not None and self.relay.uconn is not None:
                self.relay.uconn.abort()
            self._answer(req, answer, keep=False)
        elif self.transport is not None:
            self.transport.abort()
        raise StopParsingError  # the rest of this read is not looked at

    # --- the request cycle

    def _start(self, req: Incoming) -> None:
        self.active = req
        if self.tls:
            # (read per request: the TLS port tells a connection about itself before its
            # handshake; the subject is parsed once per connection and kept there)
            req.client_cert = peer_subject(self.transport) if self.transport else None
        self.gateway.metrics.inflight.inc()
        self.response_started = False
        self.deadline_kind = 0
        self.deadline = 0.0
        try:
            answer = self.gateway.begin(req, self.peer, self.identity_memo)
            if answer is None:
                if not req.body_done and (req.content_length or req.chunked):
                    # (framing is known only once begin() has read the headers)
                    self.body_deadline = self.loop.time() + self.limits.body_read_timeout
                decision = req.decision
                if decision is None:
                    if not self.gateway.decide_later(req, lambda got: self._decided(req, got)):
                        self.plane.spawn(self._decide(req))
                    return
                self._go(req, decision)
                return
        except Exception:
            log.exception("error while handling a request")
            answer = Answer.error(500, "the gateway failed on this request; see its log")
        self._answer(req, answer)

    def _go(self, req: Incoming, decision: Decision) -> None:
        step = self.gateway.after_decision(req, decision)
        if isinstance(step, Answer):
            self._answer(req, step)
        elif step is None:
            self.plane.spawn(self._info(req))
        else:
            self._forward(req, step)

    async def _decide(self, req: Incoming) -> None:
        try:
            decision: Decision | Exception = await self.gateway.decide(req)
        except Exception as exc:
            decision = exc
        self._decided(req, decision)

    def _decided(self, req: Incoming, decision: Decision | Exception) -> None:
        """Go on with ``req`` once the counter store has answered (by callback, or at
        the end of ``_decide``); never raises, since it runs inside the store's reply."""
        try:
            if isinstance(decision, CounterUnavailableError):
                if self.active is req:
                    self._answer(req, self.gateway.unavailable(req))
                return
            if isinstance(decision, Exception):
                log.error("error while deciding about a request", exc_info=decision)
                if self.active is req:
                    self._answer(req, Answer.error(500, "the gateway failed on this request"))
                return
            if self.active is not req or self.lost:
                return
            self._go(req, decision)
        except Exception:
            log.exception("error while handling a request")
            if self.active is req and not self.lost:
                self._answer(req, Answer.error(500, "the gateway failed on this request"))

    async def _info(self, req: Incoming) -> None:
        answer = await self.gateway.info_answer(req)
        if self.active is req and not self.lost:
            self._answer(req, answer)

    def _answer(self, req: Incoming, answer: Answer, keep: bool = True) -> None:
        """Write one of the gateway's own answers and end the request."""
        keep = keep and self.keep_alive_after(req)
        if not req.body_done and req.expect_continue:
            keep = False  # the body may never come: the connection cannot be reused
        if self.transport is not None and not self.lost:
            extra = b"X-Request-Id: " + req.request_id.encode() + CRLF
            self.transport.write(
                answer.encode(keep_alive=keep, head_only=req.head_only, extra=extra)
            )
        if req.record is not None:
            req.record.status = answer.status
        if not req.body_done:
            req.body = []
            req.sink = self._discard
        self._finish(req, keep)

    def _finish(self, req: Incoming, keep: bool) -> None:
        if self.active is not req:
            return
        self.active = None
        self.gateway.metrics.inflight.dec()
        if req.upgrade:
            self.upgrade_early = None  # no tunnel follows: the connection closes
            if req.tunnel:  # reserved, never joined (declined, failed, answered otherwise)
                req.tunnel = False
                self.plane.tunnels.give_back(None if req.trusted_peer else req.client_ip)
        self._release_slots(req)
        self.waiting_body = False
        self.response_started = False
        self.body_deadline = 0.0
        if req.record is not None:
            self.gateway.finished(req.record, req.started)
        if not keep or self.lost:
            self.dead_parser = True
            self.pipeline.clear()
            if self.pending_error is not None:
                self._fatal(*self.pending_error)
            elif not req.body_done or self.current is not None:
                self._linger_close()  # the client may still be sending
            elif self.transport is not None:
                self.transport.close()  # after what is buffered has been written
            return
        if self.draining:
            return
        self.draining = True
        try:
            # (_idle() here and below, not "self.active is None": type narrowing takes
            # that for always true after the assignment above, and compiled code trusts
            # narrowing, so _start setting it would be an error there)
            while self._idle() and self.pipeline and not self.lost:
                self._start(self.pipeline.popleft())
                if "pipeline" in self.paused and len(self.pipeline) < MAX_PIPELINED:
                    self.set_paused("pipeline", False)
        finally:
            self.draining = False
        if self._idle():
            if self.paused:
                # Pauses that belonged to the request just answered end with it.
                self.paused.discard("buffer")
                self.paused.discard("upstream")
                self.set_paused("pipeline", len(self.pipeline) >= MAX_PIPELINED)
            if self.plane.closing and self.current is None and self.transport is not None:
                self.transport.close()
            elif self.current is None:
                self._set_deadline(IDLE, self.limits.client_idle_timeout)
            elif self.in_head:
                self._set_deadline(HEAD, self.limits.header_timeout)
            else:  # the rest of an answered request's body is being read and dropped
                self.deadline = 0.0
                self.body_deadline = self.loop.time() + self.limits.body_read_timeout

    def _release_slots(self, req: Incoming) -> None:
        """What an ended request held: its upload and download slots, its relay."""
        if req.upload_client is not None:
            self._end_upload(req)
        if req.download_client is not None:
            self.plane.end_download(req.download_client)
            req.download_client = None
        self.relay = None
        self.upstream = None

    def _idle(self) -> bool:
        return self.active is None

    def keep_alive_after(self, req: Incoming) -> bool:
        # While stopping, requests already read (pipelined) are still answered; the last
        # one says Connection: close.
        closing = self.plane.closing and not self.pipeline
        return req.keep_alive and not req.upgrade and not closing and not self.lost

    # --- forwarding

    def _forward(self, req: Incoming, upstream: Upstream) -> None:
        """Start forwarding ``req``: by callbacks from here on, no task unless a new
        upstream connection must be opened."""
        if req.content_length is not None and req.content_length > self.limits.max_body_bytes:
            self._answer(req, self._too_large(req), keep=False)
            return
        if req.upgrade and upstream.upgrade and not self._take_tunnel(req):
            return
        if req.expect_continue and not req.body_done and self.transport is not None:
            self.transport.write(CONTINUE_100)
        self.upstream = upstream
        self.attempt = 0
        if not req.body_done and req.body_size < BUFFER_BEFORE_FORWARD:
            # A small body is read whole first: a trickling client holds no upstream.
            self.waiting_body = True
            return
        self._connect(req)

    def _take_tunnel(self, req: Incoming) -> bool:
        """An Upgrade to an upstream that takes upgrades: pass it on, with a tunnel slot
        reserved (False: answered 429 / 503 instead). Not passed on (the request is plain
        HTTP, as it is where upgrades are not offered): h2c, which this data plane does
        not speak, and an Upgrade request with a body (forwarded whole as HTTP)."""
        value = b", ".join(v for n, v in req.headers if n.lower() == b"upgrade")
        if (
            not value
            or self.upgrade_early is None  # a body was declared: read as HTTP
            or b"h2c" in {t.strip().lower() for t in value.split(b",")}
        ):
            return True
        refused = self.plane.tunnels.take(None if req.trusted_peer else req.client_ip)
        if refused:
            limits = self.limits.tunnels
            if refused == 429:
                reason = "tunnels_per_client"
                detail = (
                    f"too many upgraded connections open from this client (at most "
                    f"{limits.max_tunnels_per_client}); close one and retry"
                )
            else:
                reason = "tunnels_total"
                detail = (
                    f"every upgraded connection slot ({limits.max_tunnels}) is in use; "
                    "retry shortly"
                )
            self.gateway.metrics.upstream_errors.labels("-", reason).inc()
            headers = [*req.rate_headers, ("Retry-After", "1")]
            self._answer(req, Answer.error(refused, detail, headers), keep=False)
            return False
        req.tunnel = True
        req.upgrade_value = value
        return True

    def tunnel_open(self, relay: Relay, rest: bytes) -> None:
        """The upstream switched protocols: end the HTTP request (logged, 101) and join
        the two connections (``gateway.proxy.tunnel``)."""
        req = relay.req
        uconn = relay.uconn
        client = self.transport
        upstream = None if uconn is None else uconn.transport
        if self.active is not req or not req.tunnel:
            if upstream is not None:
                upstream.abort()
            return
        latency = perf_counter() - self.forward_started
        metrics = self.gateway.metrics
        metrics.child(metrics.upstream_latency, relay.upstream.name).observe(latency)
        record = req.record
        if record is not None:
            record.status = 101
            record.upstream_ms = int(latency * 1e6) / 1000
        if self.lost or client is None or upstream is None or upstream.is_closing():
            if upstream is not None:
                upstream.abort()
            if record is not None:
                record.status = 502 if not self.lost else 499
            self._finish(req, keep=False)
            return
        early = bytes(self.upgrade_early or b"")
        self.upgrade_early = None
        req.tunnel = False  # the reservation becomes the tunnel
        address = None if req.trusted_peer else req.client_ip
        tunnel = self.tunnel = Tunnel(
            self.plane.tunnels, client, upstream, address, self._tunnel_client_lost
        )
        self.plane.tunnels.opened(tunnel)
        metrics.child(metrics.tunnels_opened).inc()
        # The HTTP request ends here (metrics, access log); the connection goes on as the
        # tunnel, its deadlines now the tunnel's.
        self.active = None
        metrics.inflight.dec()
        self._release_slots(req)
        self.deadline = self.body_deadline = 0.0
        self.pipeline.clear()
        self.paused.clear()
        self.reading_paused = False
        if record is not None:
            self.gateway.finished(record, req.started)
        tunnel.join(rest, early)

    def _tunnel_client_lost(self) -> None:
        self.connection_lost(None)

    def _take_upload(self, req: Incoming) -> bool:
        """A body that streams holds an upstream connection while it arrives: at most
        ``max_uploads_per_client`` per client, half the pool in all (else 429 / 503)."""
        refused = self.plane.take_upload(req.client_ip)
        if not refused:
            req.upload_client = req.client_ip
            return True
        upstream = self.upstream
        limits = self.limits
        if refused == 429:
            reason = "uploads_per_client"
            detail = (
                f"too many uploads in progress from this client (at most "
                f"{limits.max_uploads_per_client} at once); retry when one has finished"
            )
        else:
            reason = "uploads_total"
            detail = (
                f"the upstream connections set aside for uploads ({limits.max_uploads}) "
                "are all in use; retry shortly"
            )
        self.gateway.metrics.upstream_errors.labels(
            upstream.name if upstream else "-", reason
        ).inc()
        headers = [*req.rate_headers, ("Retry-After", "1")]
        self._answer(req, Answer.error(refused, detail, headers), keep=False)
        return False

    def _too_many_downloads(self, req: Incoming, upstream: Upstream) -> None:
        self.gateway.metrics.upstream_errors.labels(upstream.name, "downloads_per_client").inc()
        detail = (
            f"too many answers still streaming to this client (at most "
            f"{self.limits.max_downloads_per_client} at once); read them, or retry when "
            "one has finished"
        )
        headers = [*req.rate_headers, ("Retry-After", "1")]
        self._answer(req, Answer.error(429, detail, headers))

    def download_started(self, relay: Relay) -> None:
        """An answer outlasted the read its head came in: it holds its upstream
        connection until the client has read it, counted per client address."""
        req = relay.req
        # Only a slot taken is released (in _finish): answers that started together past
        # the cap (the check in _connect came before any of them streamed) are not
        # counted, rather than releasing slots other answers hold.
        if (
            req is self.active
            and req.download_client is None
            and self.plane.take_download(req.client_ip)
        ):
            req.download_client = req.client_ip

    def _end_upload(self, req: Incoming) -> None:
        client, req.upload_client = req.upload_client, None
        if client is not None:
            self.plane.end_upload(client)

    def _body_progress(self, req: Incoming) -> None:
        if (
            self.waiting_body
            and req is self.active
            and (req.body_done or req.body_size >= BUFFER_BEFORE_FORWARD)
        ):
            self.waiting_body = False
            self._connect(req)

    def _connect(self, req: Incoming) -> None:
        upstream = self.upstream
        assert upstream is not None
        if not req.body_done and req.upload_client is None and not self._take_upload(req):
            return
        if self.plane.downloads and self.plane.downloads_full(req.client_ip):
            self._too_many_downloads(req, upstream)
            return
        self.attempt += 1
        if self.attempt == 1:
            self.forward_started = perf_counter()
            self._set_deadline(UPSTREAM, self.limits.upstream_timeout)
        address = self.upstream_address = self.plane.address(upstream)
        host, port, tls, _ = address
        uconn = self.plane.pool.take_idle(host, port, tls)
        if uconn is not None:
            self._send(req, uconn)
        else:
            self.plane.spawn(self._open_and_send(req, host, port, tls))

    async def _open_and_send(self, req: Incoming, host: str, port: int, tls: bool) -> None:
        upstream = self.upstream
        if upstream is None or self.active is not req:
            return  # answered meanwhile (a refused body, a lost client)
        try:
            uconn = await self.plane.pool.acquire(host, port, tls)
        except TimeoutError:
            self._forward_error(req, self._upstream_timeout(req, upstream))
            return
        except OSError as exc:
            self._forward_error(req, self._unreachable(req, upstream, exc))
            return
        if self.lost or self.active is not req:
            self.plane.pool.release(uconn)
            return
        self._send(req, uconn)

    def _send(self, req: Incoming, uconn: UpstreamConnection) -> None:
        upstream = self.upstream
        assert upstream is not None
        host, port, _, prefix = self.upstream_address
        head = req.upstream_head
        if head is None:
            head = req.upstream_head = request_head(
                req, upstream, prefix, f"{host}:{port}", self.peer.address or "",
                self.plane.scheme == "https",
            )  # fmt: skip
        relay = self.relay = Relay(self, req, upstream, self.gateway.metrics)
        relay.send(uconn, head)
        if not req.body_done:
            # While the body streams, its silence is what is bounded (body_read_timeout);
            # the wait for the answer (upstream_timeout) starts once all of it is sent.
            self.deadline = 0.0

    def _forward_error(self, req: Incoming, answer: Answer) -> None:
        if self.active is req and not self.lost:
            self.relay = None
            self._answer(req, answer, keep=False)

    # --- relay callbacks

    def forward_failed(self, relay: Relay, exc: BaseException) -> None:
        """The upstream did not answer: retry a stale keep-alive connection once, else
        answer 504 / 408 / 502."""
        req = relay.req
        upstream = relay.upstream
        if self.active is not req or self.lost:
            return
        if isinstance(exc, TimeoutError):
            answer = self._upstream_timeout(req, upstream)
        elif isinstance(exc, BodyStalledError):
            answer = _stalled(req)
        elif self.attempt == 1 and stale_connection(relay):
            self.relay = None
            self._connect(req)
            return
        else:
            answer = self._unreachable(req, upstream, exc)
        self._forward_error(req, answer)

    def forward_head(self, relay: Relay) -> None:
        """The response head is on its way to the client."""
        latency = perf_counter() - self.forward_started
        metrics = self.gateway.metrics
        metrics.child(metrics.upstream_latency, relay.upstream.name).observe(latency)
        record = relay.req.record
        if record is not None:
            record.upstream_ms = int(latency * 1e6) / 1000  # whole µs, as duration_ms
        self.response_started = True
        self._set_deadline(RESPONSE, self.limits.upstream_read_timeout)

    def forward_done(self, relay: Relay, outcome: int) -> None:
        """The response ended: ``outcome`` is its status, or -502 (the upstream broke the
        stream) / -499 (the client went away)."""
        req = relay.req
        if self.active is not req:
            return
        record = req.record
        if record is not None:
            record.status = relay.status if outcome > 0 else -outcome
        uconn = relay.uconn
        if outcome < 0:
            if uconn is not None:
                uconn.abort()
            if self.transport is not None:
                self.transport.abort()
            self._finish(req, keep=False)
            return
        if not req.body_done:
            # The upstream answered before the whole body arrived: its connection is
            # mid-request and cannot be reused; the rest of the body is read and dropped
            # so the client's connection stays usable (bounded by max_body_bytes).
            req.sink = self._discard
            if uconn is not None:
                uconn.abort()
        elif not relay.forwarded_whole():
            # What went upstream is not the whole message that was parsed: the upstream
            # may read the next request as the rest of this one (request smuggling).
            # Neither connection is used again.
            log.error("request %s was not forwarded whole: both connections closed",
                      req.request_id)  # fmt: skip
            if uconn is not None:
                uconn.abort()
            self._finish(req, keep=False)
            return
        elif uconn is not None:
            self.plane.pool.release(uconn)
        self._finish(req, keep=not relay.close_after)

    def _too_large(self, req: Incoming) -> Answer:
        limit = self.limits.max_body_bytes
        detail = f"request body is larger than the {limit} bytes this gateway accepts"
        return Answer.error(413, detail, req.rate_headers)

    def _upstream_timeout(self, req: Incoming, upstream: Upstream) -> Answer:
        self.gateway.metrics.upstream_errors.labels(upstream.name, "timeout").inc()
        detail = f"upstream {repr(upstream.name)} did not answer in time"
        return Answer.error(504, detail, req.rate_headers)

    def _unreachable(self, req: Incoming, upstream: Upstream, exc: BaseException) -> Answer:
        self.gateway.metrics.upstream_errors.labels(upstream.name, "unreachable").inc()
        log.warning("upstream %s unreachable: %s", upstream.name, type(exc).__name__)
        return Answer.error(502, f"upstream {repr(upstream.name)} is unreachable", req.rate_headers)

    # --- used by the relay

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(data)

    def response_progress(self) -> None:
        self.deadline = self.loop.time() + self.limits.upstream_read_timeout

    def set_paused(self, reason: str, paused: bool) -> None:
        if paused:
            self.paused.add(reason)
        else:
            self.paused.discard(reason)
            if (
                self.backlog is not None
                and len(self.paused) == 1
                and not self.feed_scheduled
                and reason != "backlog"
            ):
                # only the backlog holds reading now: go on parsing it
                self.feed_scheduled = True
                self.loop.call_soon(self._feed_backlog)
        want = bool(self.paused)
        if want != self.reading_paused and self.transport is not None and not self.lost:
            self.reading_paused = want
            if want:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()

    # --- deadlines (checked by DataPlane's sweep)

    def _set_deadline(self, kind: int, seconds: float) -> None:
        self.deadline_kind = kind
        self.deadline = self.loop.time() + seconds

    def check(self, now: float) -> None:
        if self.body_deadline and now >= self.body_deadline:
            self.body_deadline = 0.0
            self._body_stalled()
        if not self.deadline or now < self.deadline:
            return
        kind, self.deadline = self.deadline_kind, 0.0
        if kind == IDLE:
            if self.active is None and self.transport is not None:
                self.transport.close()
        elif kind == HEAD:
            if self.active is None:
                if not self.got_bytes and self.transport is not None:
                    self.transport.close()  # never said a word: nothing to answer
                    return
                self._fatal(408, "the request headers did not arrive in time")
        elif kind == UPSTREAM:
            relay = self.relay
            if relay is not None:
                relay.fail(TimeoutError())
            elif self.active is not None and self.upstream is not None:
                # still opening a connection
                self._forward_error(self.active, self._upstream_timeout(self.active, self.upstream))
        elif kind == RESPONSE:
            relay = self.relay
            if relay is not None:
                relay.upstream_lost(TimeoutError("the upstream went silent"))

    def _body_stalled(self) -> None:
        req = self.active
        if req is None:
            if self.current is not None and not self.in_head and self.transport is not None:
                self.transport.abort()  # a dropped body went silent: already answered
            return
        if req.body_done:
            return
        if self.waiting_body:
            self.waiting_body = False
            self._answer(req, _stalled(req), keep=False)
            return
        relay = self.relay
        if relay is not None and relay.phase == WAITING:
            relay.fail(BodyStalledError())
            return
        if self.transport is not None:
            self.transport.abort()

    def _http2_refused(self) -> None:
        """A client speaking HTTP/2 with prior knowledge: answered in HTTP/2, which it
        reads (an HTTP/1.1 400 would be garbage to it): the server's SETTINGS, then
        GOAWAY with HTTP_1_1_REQUIRED and a reason, then close (RFC 9113 3.4, 6.8)."""
        if self.transport is None or self.lost:
            return
        self.transport.write(H2_REFUSAL)
        self._linger_close()
        log.info("%s: HTTP/2 prior knowledge refused (GOAWAY HTTP_1_1_REQUIRED)",
                 self.peer.address or "-")  # fmt: skip

    def _fatal(self, status: int, detail: str) -> None:
        """Answer a connection-level problem (no request to attach it to) and close."""
        self.dead_parser = True
        if self.transport is None or self.lost:
            return
        answer = Answer.error(status, detail)
        request_id = new_request_id()
        extra = b"X-Request-Id: " + request_id.encode() + CRLF
        self.transport.write(answer.encode(keep_alive=False, head_only=False, extra=extra))
        self._linger_close()
        self.plane.gateway.metrics.child(
            self.plane.gateway.metrics.responses, self.gateway.regions.default, f"{status // 100}xx"
        ).inc()
        log.info("%s: %d %s rid=%s", self.peer.address or "-", status, detail, request_id)

    def _linger_close(self) -> None:
        """Close after an answer while the client may still be sending: closing with
        unread bytes makes the kernel send a reset that can destroy the answer before
        the client reads it. So: no more writes, read and drop for a moment, close."""
        transport = self.transport
        if transport is None or self.lost:
            return
        self.dead_parser = True
        if transport.can_write_eof():
            transport.write_eof()
            self.lost = True  # nothing more may be written (write() would raise)
        self.set_paused("linger", False)
        self.paused.clear()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        self.loop.call_later(LINGER_SECONDS, transport.close)

    def _protocol_error(self, exc: Exception) -> None:
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            reason = "unknown or malformed method"
        detail = f"malformed HTTP request: {reason}"
        req = self.active
        if req is None:
            self._fatal(400, detail)
        elif not req.body_done:
            # The error is in this request's own body: it cannot be forwarded whole.
            if self.response_started:
                if self.transport is not None:
                    self.transport.abort()
                return
            if self.relay is not None and self.relay.uconn is not None:
                self.relay.uconn.abort()
            self._answer(req, Answer.error(400, detail, req.rate_headers), keep=False)
        else:
            # A later request is malformed: what came before it is answered first, then
            # the 400, then the connection closes.
            self._after_active(400, detail)

    def _after_active(self, status: int, detail: str) -> None:
        """Answer ``status`` once the requests already read are answered, then close."""
        self.pending_error = (status, detail)
        req = self.pipeline[-1] if self.pipeline else self.active
        if req is not None:
            req.keep_alive = False


def _stalled(req: Incoming) -> Answer:
    return Answer.error(408, "the request body stalled", req.rate_headers)


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


def _h2_preface(parser: httptools.HttpRequestParser, data: bytes | memoryview) -> bool:
    """Whether the connection opened with HTTP/2's preface (llhttp refuses it)."""
    if bytes(data[:3]) == b"PRI":
        return True
    try:
        return bool(parser.get_method() == b"PRI")
    except httptools.HttpParserError:
        return False


# What an upgrade's client may send before the upstream has answered (then reading
# pauses until the tunnel is joined, or the connection closes).
EARLY_BYTES: Final = 64 * 1024


class _UpgradeBody:
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
