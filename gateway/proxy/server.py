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

This module holds the parsing callbacks, the request cycle and the connection's
lifecycle and deadlines. Forwarding a request upstream (the relay, uploads, downloads,
tunnels) is the connection's base class, ``gateway.proxy.forwarding.Forwarding``; the
request framing helpers (declared body length, the HTTP/2 preface, an Upgrade request's
body) are ``gateway.proxy.framing``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Final, cast

import httptools

from gateway.policy.model import IdentityKind
from gateway.proxy.batched_writes import BatchedTransport
from gateway.proxy.forwarding import (
    HEAD,
    IDLE,
    RESPONSE,
    UPSTREAM,
    BodyStalledError,
    Forwarding,
    stalled,
)
from gateway.proxy.framing import (
    H2_REFUSAL,
    StopParsingError,
    UpgradeBody,
    declared_body,
    h2_preface,
)
from gateway.proxy.handler import KnownRefusal
from gateway.proxy.relay import BUFFER_BEFORE_FORWARD, WAITING
from gateway.proxy.request import Incoming
from gateway.proxy.request_id import new_request_id
from gateway.proxy.tls import peer_subject
from gateway.proxy.wire import CRLF, Answer
from gateway.ratelimit.decision import Decision
from gateway.ratelimit.ports import CounterUnavailableError

if TYPE_CHECKING:
    from gateway.proxy.plane import DataPlane

log = logging.getLogger("gateway.proxy")

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
# What a request's body may cost in bytes that are not body (chunk-size lines, chunk
# extensions, trailers; none of them is forwarded): the head's bound, and this much
# a chunk more. httptools builds a trailer field with bytes += per read, so a trailer
# without an end cost CPU quadratic in its size (hardening, third round).
FRAMING_PER_CHUNK: Final = 32
LINGER_SECONDS: Final = 2.0  # reading (and dropping) after a final answer, before closing
# What an upgrade's client may send before the upstream has answered (then reading
# pauses until the tunnel is joined, or the connection closes).
EARLY_BYTES: Final = 64 * 1024
# The longest read a connection keeps to answer its repeats without parsing (_replay):
# a flood's requests are a few hundred bytes; an idle connection holds no more than this.
MAX_REPLAYED_BYTES: Final = 4096
# The methods llhttp knows, as str, without a decode per request.
_METHODS: Final = {
    m.encode(): m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
}
perf_counter: Final = time.perf_counter


def version_in(read: bytes, method: bytes, target: bytes) -> str | None:
    """The HTTP version of the request llhttp has just parsed from the start of ``read``,
    read from its bytes ("1.1" or "1.0"), or None: ask the parser. The parser's own
    answer is a str.format, ~2,300 instructions a request; this, three comparisons.

    Why the bytes say what llhttp read: only the line ``METHOD SP target SP HTTP/1.x CRLF``
    from byte 0 is read. The method at byte 0 means no empty line was skipped; one SP
    after it and the target's first byte (never a space) next means llhttp's target
    starts there, and it is ``target`` (its bytes, as on_url gave them); one SP after it,
    the version, and CR next: strict llhttp ends the line at its first CR (one inside it
    is an error), so that is the version it parsed. HTTP/0.9 lines carry none (llhttp
    accepts them: a target that ends in "HTTP/1.1" and the line's CRLF must not read as
    one); any other spelling (runs of spaces, empty lines first) asks the parser
    (tests/unit/test_request_version.py compares the two on made-up request lines)."""
    size = len(method)
    if not read.startswith(method) or not read.startswith(target, size + 1):
        return None
    if read[size] != 32:  # SP
        return None
    end = size + len(target) + 10
    if read.startswith(b" HTTP/1.1\r\n", end - 9):
        return "1.1"
    if read.startswith(b" HTTP/1.0\r\n", end - 9):
        return "1.0"
    return None


class ClientConnection(Forwarding):
    """One client connection: parse, answer in order, relay (the forwarding half is the
    base class, ``Forwarding``; one object per connection)."""

    def __init__(self, plane: DataPlane) -> None:
        # The state both halves use, and the forwarding state, are set there.
        super().__init__(plane)
        self.loop = plane.loop
        self.clock = plane.clock
        self.identity_memo: dict[tuple[IdentityKind, str], str] = {}
        self.tls = plane.scheme == "https"  # client certificates may identify requests
        parser = self.parser = httptools.HttpRequestParser(self)
        # Its methods bound once per connection: compiled code calls a method of an
        # object it knows only by name (httptools') by looking it up on each call, five
        # times a request here (benchmarks/README.md, "Third round, twenty-first step").
        # The parser is never replaced; one that is must bind these again (as
        # UpstreamConnection._new_parser does).
        self.feed_parser = parser.feed_data
        self.parsed_method = parser.get_method
        self.parsed_version = parser.get_http_version
        self.parsed_keep_alive = parser.should_keep_alive
        self.parsed_upgrade = parser.should_upgrade
        self.current: Incoming | None = None  # being parsed
        self.deadline_kind = 0
        self.in_head = False
        self.head_bytes = 0
        self.read_size = 0  # bytes of the read being parsed
        # The read being parsed, when it started between two requests (then the first
        # request begun in it starts at its first byte, or after empty lines): None else.
        self.read_from_start: bytes | None = None
        self.url: list[bytes] = []
        self.dead_parser = False  # after an upgrade or a parse error nothing more is read
        self.draining = False
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
        # the framing (see gateway.proxy.framing.UpgradeBody).
        self.upgrade_body: UpgradeBody | None = None
        # The last read that was exactly one request refused from a known refusal, and
        # that request: a read of the same bytes is answered without parsing (_replay).
        self.repeat_bytes: bytes | None = None
        self.repeat_of: Incoming | None = None
        self.refused: Incoming | None = None  # such a request, in the read being parsed
        self.begun = 0  # requests begun in the read being parsed

    # --- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it; writes
        # wait for the end of the loop's turn (gateway.proxy.batched_writes)
        plane = self.plane
        self.transport = BatchedTransport(cast(asyncio.Transport, transport), plane.writes)
        if len(plane.connections) >= self.limits.max_connections:
            plane.refused_connection()
            self.transport.abort()
            self.lost = True
            return
        peer = transport.get_extra_info("peername")
        self.peer = self.gateway.peer(peer[0] if isinstance(peer, tuple) else None)
        # Counted under the client address as every per-client bound counts it (an IPv6
        # peer by its prefix, ipv6_prefix): otherwise one host's /64 could hold every slot.
        address = self.peer.client if self.peer.address is not None else None
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
        if data == self.repeat_bytes and self._replay():
            return
        self._feed(data)

    def _replay(self) -> bool:
        """Answer a read of the same bytes as the last refused one (``repeat_of``) the
        way parsing them would, without parsing: what llhttp and ``Gateway.begin`` made
        of those bytes is the same again, so only the refusal is checked again (the
        table, the refusal still known and in force) and the answer written. False (and
        the memo forgotten) when the bytes must be parsed after all."""
        first = self.repeat_of
        known = None if first is None else first.known_refusal
        if (
            first is None
            or not isinstance(known, KnownRefusal)
            or self.active is not None
            or self.current is not None
            or self.pipeline
            or self.paused
            or self.no_more
            or self.upgrade_body is not None
        ):
            self.repeat_bytes = self.repeat_of = None
            return False
        req = first.again(perf_counter())
        gateway = self.gateway
        try:
            answer = gateway.refuse_again(req, first, known)
        except Exception:
            log.exception("error while handling a request")
            answer = Answer.error(500, "the gateway failed on this request; see its log")
        if answer is None:
            self.repeat_bytes = self.repeat_of = None
            return False
        self.plane.replayed += 1
        self.active = req
        gateway.metrics.inflight.inc()
        self.response_started = False
        self.deadline_kind = 0
        self.deadline = 0.0
        self._answer(req, answer)
        return True

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
        self.begun = 0
        self.refused = None
        # (whether this read starts between two requests: only such a read is kept)
        cur = self.current
        at_start = cur is None
        self.read_from_start = data if at_start and isinstance(data, bytes) else None
        # The body so far of a request whose body this read continues (-1: none).
        body_before = -1 if cur is None or self.in_head else cur.body_size
        try:
            self.feed_parser(data)
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
            if self.active is None and not self.pipeline and h2_preface(self.parser, data):
                self._http2_refused()
            elif not self.no_more:  # after Connection: close llhttp refuses what follows
                self._protocol_error(exc)
            return
        if upgrade_at >= 0:
            if upgrade_at < len(data) and body is not None:
                self._feed_upgrade_body(body, data[upgrade_at:])
            return
        if body_before >= 0 and cur is not None:
            self._count_framing(cur, len(data), body_before)
        # Only a read that was that one whole request, bodiless, on a connection that
        # reads on in its ordinary state: then the same bytes again are the same request
        # again (llhttp is back at a message's start).
        refused = self._take_refused()
        if (
            refused is not None
            and at_start
            and self.begun == 1
            and len(data) <= MAX_REPLAYED_BYTES
            and self.gateway.verified is None
            and refused.body_done
            and not refused.chunked
            and not refused.content_length
            and not refused.upgrade
            and self.current is None
            and self._idle()
            and not self.pipeline
            and not self.no_more
            and not self.dead_parser
            and type(data) is bytes
            and self.plane.replay_refusals
        ):
            self.repeat_bytes = data
            self.repeat_of = refused
        if self.in_head:
            # (not while the client leaves its answers unread: the rest of this head
            # waits in the kernel because the gateway stopped reading, not because the
            # client is slow to send it; the idle deadline runs then)
            if self.active is None and self.deadline_kind != HEAD and "writing" not in self.paused:
                self._set_deadline(HEAD, self.limits.header_timeout)
            # Still inside a request head: llhttp keeps what it has not reported, so
            # the head's size is bounded here (a head never completes otherwise), also
            # for a pipelined head behind a request still being answered.
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_head_bytes:
                self._head_too_large()

    def _take_refused(self) -> Incoming | None:
        # (a method: after the assignment in _feed, type narrowing takes the attribute
        # for None, and compiled code trusts narrowing; _start sets it meanwhile)
        refused, self.refused = self.refused, None
        return refused

    def _keep_early(self, early: bytearray, data: bytes | memoryview) -> None:
        early += data
        if len(early) >= EARLY_BYTES:
            self.set_paused("upgrade", True)  # the rest waits in the kernel

    def _count_framing(self, req: Incoming, fed: int, body_before: int) -> None:
        """Count what a read that went wholly to ``req``'s body phase held besides body
        bytes; refuse the request once that exceeds FRAMING_PER_CHUNK a chunk past the
        head's bound. (A read that also ended the request or began the next one is not
        counted: at most one slice a request.)"""
        if self.current is not req or self.in_head or self.dead_parser:
            return
        got = req.body_size - body_before
        framing = fed - got
        if framing <= 0:
            return
        req.framing += framing
        # Non-body bytes since the last body bytes (trailers, one chunk's extension): at
        # most the head's bound, whatever the chunks before earned for their lines.
        run = req.framing_run = framing if got else req.framing_run + framing
        head_bound = self.limits.max_head_bytes
        allowed = head_bound + FRAMING_PER_CHUNK * req.chunks
        if run <= head_bound and req.framing <= allowed:
            return
        if run > head_bound:
            allowed = head_bound
        self.dead_parser = True
        self.plane.gateway.metrics.upstream_errors.labels(
            self.relay.upstream.name if self.relay else "-", "framing_too_large"
        ).inc()
        detail = (
            f"request framing (chunk-size lines, chunk extensions and trailers) is larger "
            f"than {allowed} bytes"
        )
        if req is self.active and not self.response_started:
            if self.relay is not None and self.relay.uconn is not None:
                self.relay.uconn.abort()
            self._answer(req, Answer.error(400, detail, req.rate_headers), keep=False)
        elif self.transport is not None:
            # Answered already, or queued behind another request: no answer of its own
            # can follow, and its body cannot be forwarded whole.
            self.transport.abort()

    def _feed_upgrade_body(self, body: UpgradeBody, data: bytes | memoryview) -> None:
        req = self.current
        body_before = -1 if req is None else req.body_size
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
        if req is not None and body_before >= 0 and not body.done:
            self._count_framing(req, len(data), body_before)

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
        # The transport closes itself when this returns False, not through the batch:
        # what this turn answered is written first (batched_writes).
        if self.transport is not None:
            self.transport.flush()
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
        # The client is not reading what it was sent: a relay stops reading its upstream,
        # and this connection stops reading (and starting) the client's next requests,
        # so its unread answers cannot pile up in memory (a client pipelining requests
        # the gateway answers itself, /ok or 429, and never reading: hardening, third
        # round). What is written past this point is bounded by one slice of input.
        if self.relay is not None:
            self.relay.client_writable(False)
        self.set_paused("writing", True)
        if self._idle() and self.deadline_kind == HEAD and not self.draining:
            # Answers are written at the end of the loop's turn (batched_writes), after
            # the head deadline of a request still arriving was set: from now on the
            # client is the one not reading, timed as idle as _drain_pipeline times it.
            self._set_deadline(IDLE, self.limits.client_idle_timeout)

    def resume_writing(self) -> None:
        if self.relay is not None:
            self.relay.client_writable(True)
        self.set_paused("writing", False)
        if self._idle() and not self.draining and not self.lost:
            self._drain_pipeline()  # (also re-arms the deadline of a head in progress)

    # --- llhttp callbacks

    def on_message_begin(self) -> None:
        if self.no_more:
            # A request said Connection: close; what follows it is not read (RFC 9112 9.6).
            self.dead_parser = True
            raise StopParsingError
        req = Incoming()
        req.started = perf_counter()
        self.current = req
        self.begun += 1
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
        self.in_head = False
        # The head's size as parsed, whatever the reads it came in (one bound).
        req.head_size = self.head_fields
        self.head_bytes = 0
        if self.head_fields > self.limits.max_head_bytes:
            self.current = None
            self._head_too_large()
            raise StopParsingError
        method = self.parsed_method()
        req.method = _METHODS.get(method) or method.decode("ascii")
        target = req.target = b"".join(self.url)
        read = self.read_from_start
        version = None
        if read is not None and self.begun == 1:  # (a read's first request only)
            version = version_in(read, method, target)
        req.version = self.parsed_version() if version is None else version
        req.keep_alive = self.parsed_keep_alive()
        req.head_only = req.method == "HEAD"
        if self.parsed_upgrade():
            req.upgrade = True
            framing = declared_body(req.headers)
            if framing:
                self.upgrade_body = UpgradeBody(self, framing)
            else:
                # (set before the request starts: its decision may be taken right here)
                self.upgrade_early = bytearray()
        if self.active is None and "writing" not in self.paused:
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
        if self._idle() and not self.pipeline and not self.dead_parser:
            # Answered before its message ended (from its head: /ok, a 429, an error;
            # or an upstream that answered before the body was read), _finish left the
            # rest of the body a read deadline; the message is whole now, so the
            # connection idles as after any other answer (else nothing closed it).
            self.body_deadline = 0.0
            if self.plane.closing and self.transport is not None:
                self.transport.close()  # (stopping: as _finish does for an idle one)
            else:
                self._set_deadline(IDLE, self.limits.client_idle_timeout)

    # --- request bodies

    def _body(self, req: Incoming, data: bytes) -> None:
        req.body_size += len(data)
        if req.body_size > self.limits.max_body_bytes:
            self._body_too_large(req)
            return
        if req is self.active or self.active is None:
            self.body_deadline = self.clock() + self.limits.body_read_timeout
        sink = req.sink
        if sink is not None:
            sink(data)
            return
        req.body.append(data)
        if req.body_size >= BUFFER_BEFORE_FORWARD:
            self.set_paused("buffer", True)
            self._body_progress(req)

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
            req.client_cert = peer_subject(self.transport.raw) if self.transport else None
        self.gateway.metrics.inflight.inc()
        self.response_started = False
        self.deadline_kind = 0
        self.deadline = 0.0
        try:
            answer = self.gateway.begin(req, self.peer, self.identity_memo)
            if answer is None:
                if not req.body_done and (req.content_length or req.chunked):
                    # (framing is known only once begin() has read the headers)
                    self.body_deadline = self.clock() + self.limits.body_read_timeout
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
        if req.known_refusal is not None and req is self.current:
            # (_feed sees whether its read can be answered again; not a request started
            # from the pipeline, whose bytes came in an earlier read)
            self.refused = req
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
            req.answered_early = True
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
                self.plane.tunnels.give_back(self._per_client(req))  # as it was taken
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
        self._drain_pipeline()

    def _drain_pipeline(self) -> None:
        """Start the requests read while others were answered, in order, while the
        connection is idle and its client reads what it is sent."""
        self.draining = True
        try:
            # (_idle() here and below, not "self.active is None": type narrowing takes
            # that for always true after the assignment in _finish, and compiled code
            # trusts narrowing, so _start setting it would be an error there)
            while self._idle() and self.pipeline and not self.lost and "writing" not in self.paused:
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
            elif self.current is None or "writing" in self.paused:
                # (answers left unread: the idle deadline, whatever is half read)
                self._set_deadline(IDLE, self.limits.client_idle_timeout)
            elif self.in_head:
                self._set_deadline(HEAD, self.limits.header_timeout)
            else:  # the rest of an answered request's body is being read and dropped
                self.deadline = 0.0
                self.body_deadline = self.clock() + self.limits.body_read_timeout

    def _idle(self) -> bool:
        return self.active is None

    def keep_alive_after(self, req: Incoming) -> bool:
        # While stopping, requests already read (pipelined) are still answered; the last
        # one says Connection: close.
        closing = self.plane.closing and not self.pipeline
        return req.keep_alive and not req.upgrade and not closing and not self.lost

    # --- used by the relay

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(data)

    def response_progress(self) -> None:
        self.deadline = self.clock() + self.limits.upstream_read_timeout

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
        self.deadline = self.clock() + seconds

    def check(self, now: float) -> None:
        if self.body_deadline and now >= self.body_deadline:
            self.body_deadline = 0.0
            self._body_stalled()
        if not self.deadline or now < self.deadline:
            return
        kind, self.deadline = self.deadline_kind, 0.0
        if kind == IDLE:
            transport = self.transport
            if self.active is None and transport is not None:
                if transport.get_write_buffer_size():
                    # Answers unread for the whole idle timeout: close() would wait
                    # for a reader that never comes, holding them.
                    transport.abort()
                else:
                    transport.close()
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
            self._answer(req, stalled(req), keep=False)
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
            current = self.current
            if current is not None and current.answered_early:
                # In the body of a request already answered: a 400 now would read as
                # the answer to a request the client has not sent. Close, no answer.
                log.info("%s: %s after the answer rid=%s", self.peer.address or "-",
                         detail, current.request_id)  # fmt: skip
                self.dead_parser = True
                self._linger_close()
                return
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
