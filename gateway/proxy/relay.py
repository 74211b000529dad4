"""One request forwarded to an upstream and its response streamed back, by callbacks.

Bytes move between the two transports inside the protocol callbacks (no await per
chunk); backpressure is the transports' own: a full write buffer on one side pauses
reading on the other. The only awaits are for an upstream connection and for the
response head. Replaces aiohttp's client and ``StreamResponse`` on the proxy path
(benchmarks/README.md, "Data plane", the proxied rows).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final, Protocol

from gateway.proxy.request import Incoming
from gateway.proxy.upstream_pool import UpstreamConnection, response_head_bytes
from gateway.proxy.wire import CHUNKED_END, CLOSE, CRLF, chunk, date_line, status_line

if TYPE_CHECKING:
    from gateway.metrics import Metrics
    from gateway.proxy.upstream_pool import Upstream

log = logging.getLogger("gateway.proxy")

HOP_BY_HOP: Final = frozenset(
    {
        b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
        b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection",
    }
)  # fmt: skip
# Headers that name the client, its scheme, host, path or certificate as a proxy saw
# them: frameworks and libraries believe them (Express's and request-ip's client address,
# Rails', Spring's and Tornado's scheme, host and prefix, ingress-nginx's originals, nginx
# auth_request's and Traefik forward-auth's URI, Envoy's client certificate, CDNs' client
# headers), so from an untrusted peer they are dropped, never passed on as if a proxy
# had set them; a trusted proxy's pass on. The gateway itself reads X-Forwarded-For and
# X-Forwarded-Proto only (and replaces both for an untrusted peer).
UNTRUSTED_FORWARDING: Final = frozenset(
    {
        b"forwarded", b"forwarded-for", b"x-forwarded", b"x-real-ip",
        b"x-forwarded-host", b"x-forwarded-port", b"x-forwarded-server",
        b"x-forwarded-prefix", b"x-forwarded-scheme", b"x-forwarded-ssl",
        b"x-forwarded-protocol", b"x-url-scheme", b"front-end-https",
        b"x-original-forwarded-for", b"x-original-host", b"x-host",
        b"x-client-ip", b"true-client-ip", b"cf-connecting-ip", b"cf-connecting-ipv6",
        b"cf-pseudo-ipv4", b"fastly-client-ip", b"x-cluster-client-ip",
        b"x-appengine-user-ip", b"x-proxyuser-ip", b"x-azure-clientip",
        b"x-azure-socketip", b"x-envoy-external-address", b"x-envoy-internal",
        b"x-scheme", b"x-original-proto", b"x-real-port", b"x-forwarded-client-cert",
        b"x-original-uri", b"x-forwarded-uri",
    }
)  # fmt: skip
# The gateway sets these on the request itself.
_REQUEST_OWNED: Final = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"via", b"x-request-id"}
)
VIA: Final = b"1.1 ratelimit-gateway"
_RATE_NAMES: Final = frozenset({b"ratelimit", b"ratelimit-policy"})
# With rate_limit_headers legacy or both, the gateway's X-RateLimit-* replace the upstream's.
_LEGACY_RATE_NAMES: Final = frozenset(
    {b"x-ratelimit-limit", b"x-ratelimit-remaining", b"x-ratelimit-reset"}
)
# A body up to this size is read whole before an upstream connection is taken, so a
# client trickling a small body holds no upstream connection (slow-body starvation);
# anything larger streams once this much has arrived.
BUFFER_BEFORE_FORWARD: Final = 64 * 1024
RETRY_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
# Relay phases: waiting for the response head, streaming the body, ended.
WAITING: Final = 0
STREAMING: Final = 1
DONE: Final = 2


# Method overrides: an upstream (or framework) that honours one would apply a method other
# than the one the rule was chosen by. Dropped unless the keep_method_override setting is
# on (then the rule is chosen by the overridden method).
METHOD_OVERRIDES: Final = frozenset(
    {b"x-http-method-override", b"x-http-method", b"x-method-override"}
)
# Path overrides: IIS's URL Rewrite and older Symfony and Zend releases route by these
# instead of the request target, so the rule would be chosen by one path and another run.
# No client has a reason to send them through a gateway: always dropped.
PATH_OVERRIDES: Final = frozenset({b"x-original-url", b"x-rewrite-url"})
# The gateway meets a request's "Expect: 100-continue" itself (it sends the 100 and reads
# the body before forwarding): passed on, the upstream would answer it a second time.
_MET_HERE: Final = frozenset({b"expect"})
# Request header names the loop below looks at; everything else is copied as it came.
_REQUEST_SPECIAL = (
    HOP_BY_HOP | _REQUEST_OWNED | UNTRUSTED_FORWARDING | _MET_HERE | METHOD_OVERRIDES
    | PATH_OVERRIDES | {b"host", b"content-length", b"x-user-id"}
)  # fmt: skip


# Text that repeats from request to request, kept (bounded) instead of encoded each
# time: the request line's start per (method, prefix, path), and the forwarding fields
# of a request that brought none of its own, per peer (benchmarks/README.md, "Data
# plane", the proxied rows).
_LINE_STARTS: Final[dict[tuple[str, str, str], bytes]] = {}
_PLAIN_FORWARDING: Final[dict[str, bytes]] = {}
_PLAIN_FORWARDING_TLS: Final[dict[str, bytes]] = {}  # the same, for the TLS port
MAX_KEPT: Final = 4096
# What one kept request-line start may hold: a longer path is encoded each time, so the
# cache is bounded in bytes too (4,096 starts of 4 KiB paths held ~34 MB a process: review,
# seventeenth session), as the path and access-log caches are (256).
MAX_KEPT_PATH: Final = 256


def _line_start(method: str, prefix: str, path: str) -> bytes:
    key = (method, prefix, path)
    found = _LINE_STARTS.get(key)
    if found is None:
        found = b"%s %s%s" % (method.encode(), prefix.encode(), path.encode())
        if len(path) + len(prefix) <= MAX_KEPT_PATH:
            if len(_LINE_STARTS) >= MAX_KEPT:
                _LINE_STARTS.clear()
            _LINE_STARTS[key] = found
    return found


def _plain_forwarding(peer: str, https: bool) -> bytes:
    kept = _PLAIN_FORWARDING_TLS if https else _PLAIN_FORWARDING
    found = kept.get(peer)
    if found is None:
        found = (
            b"X-Forwarded-For: " + peer.encode() + CRLF
            + b"X-Forwarded-Proto: " + (b"https" if https else b"http") + CRLF
            + b"Via: " + VIA + CRLF
        )  # fmt: skip
        if len(kept) >= MAX_KEPT:
            kept.clear()
        kept[peer] = found
    return found


def request_head(
    req: Incoming, upstream: Upstream, prefix: str, host: str, peer: str, https: bool = False
) -> bytes:
    """The request head sent upstream: the client's end-to-end headers as they came,
    hop-by-hop ones removed, forwarding headers set (``https``: the client came in on
    the TLS port, which X-Forwarded-Proto says)."""
    tokens = req.connection_tokens
    trusted = req.trusted_peer
    lines = [_line_start(req.method, prefix, req.path) + req.query + b" HTTP/1.1\r\n"]
    append = lines.append
    via: list[bytes] = []
    has_host = False
    for name, value in req.headers:
        lower = name.lower()
        if lower in _REQUEST_SPECIAL:
            if lower == b"host":
                if not upstream.preserve_host:
                    continue
                has_host = True
            elif lower == b"via":
                via.append(value)
                continue
            elif lower == b"content-length":
                # Framing, kept whatever Connection names (the body follows it), and
                # written as the gateway read it: '007' is 7 here, and an upstream that
                # read leading zeros otherwise (octal) would frame the body differently.
                append(b"Content-Length: %d\r\n" % (req.content_length or 0))
                continue
            elif trusted and lower in UNTRUSTED_FORWARDING and lower not in tokens:
                pass  # a trusted proxy's own forwarding headers pass on
            elif req.keep_override and lower in METHOD_OVERRIDES and lower not in tokens:
                pass
            elif lower == b"x-user-id":
                if req.drop_user_header:
                    continue  # believed only from trusted proxies: not passed on either
                if tokens and lower in tokens:
                    continue
            else:
                continue
        elif tokens and lower in tokens:
            continue
        # (One concatenated line a header: four appends instead counted ~400 instructions
        # more a request, the join's per-piece cost above the concatenations'.)
        append(name + b": " + value + CRLF)
    if not has_host:
        append(b"Host: " + host.encode() + CRLF)
    chain = req.forwarded_for
    if not via and not (trusted and (chain or req.forwarded_proto is not None)):
        append(_plain_forwarding(peer, https))  # the common case: nothing to carry on
    else:
        peer_bytes = peer.encode()
        joined = b", ".join(chain)
        if trusted and joined:
            append(b"X-Forwarded-For: " + joined + b", " + peer_bytes + CRLF)
        else:
            append(b"X-Forwarded-For: " + peer_bytes + CRLF)
        if trusted and req.forwarded_proto is not None:
            append(b"X-Forwarded-Proto: " + req.forwarded_proto + CRLF)
        else:
            append(b"X-Forwarded-Proto: https\r\n" if https else b"X-Forwarded-Proto: http\r\n")
        via.append(VIA)
        append(b"Via: " + b", ".join(via) + CRLF)
    append(b"X-Request-Id: " + req.request_id.encode() + CRLF)
    if req.tunnel:  # hop-by-hop, dropped above; asked of this upstream on purpose
        append(b"Connection: Upgrade\r\nUpgrade: " + req.upgrade_value + CRLF)
    elif req.close_upstream:  # content the upstream may not read: nothing may follow it
        append(b"Connection: close\r\n")
    if req.chunked:
        if req.body_done:  # all of it is here: send it with a length
            append(b"Content-Length: %d\r\n" % req.body_size)
        else:
            append(b"Transfer-Encoding: chunked\r\n")
    append(CRLF)
    return b"".join(lines)


# What ``Relay.response_head`` does with a response header, by name: write it as it came
# (0), or one of the few special cases.
_KEEP: Final = 0
_CONNECTION: Final = 1
_TRANSFER: Final = 2
_VIA: Final = 3
_LENGTH: Final = 4
_DATE: Final = 5
_DROP: Final = 6
_RATE: Final = 7
_LEGACY_RATE: Final = 8
# Dropped outright (the gateway writes its own framing and X-Request-Id).
_DROPPED = (HOP_BY_HOP - {b"connection", b"transfer-encoding"}) | {b"x-request-id"}
# Not passed on with a 101: hop-by-hop fields (the gateway writes Connection and Upgrade
# itself), framing (none follows a 101) and the gateway's own.
_DROPPED_101: Final = HOP_BY_HOP | {b"content-length", b"x-request-id", b"via"}
_SPECIAL_ACTIONS: Final = {
    b"connection": _CONNECTION, b"transfer-encoding": _TRANSFER, b"via": _VIA,
    b"content-length": _LENGTH, b"date": _DATE,
    **{name: _DROP for name in _DROPPED}, **{name: _RATE for name in _RATE_NAMES},
    **{name: _LEGACY_RATE for name in _LEGACY_RATE_NAMES},
}  # fmt: skip
# The action per name as upstreams spell it ("Content-Length"), so a header costs one dict
# lookup and no lower(); bounded, since an upstream may send any names.
_ACTIONS: Final[dict[bytes, int]] = {}


def _action(name: bytes) -> int:
    action = _SPECIAL_ACTIONS.get(name.lower(), _KEEP)
    if len(_ACTIONS) < 1024:
        _ACTIONS[name] = action
    return action


VIA_LINE: Final = b"Via: " + VIA + CRLF
# The Connection values nearly every upstream sends: they name nothing that is written, so
# no token parsing and no filtering pass.
_PLAIN_CONNECTION: Final = frozenset({b"keep-alive", b"Keep-Alive", b"close", b"Close"})
_STATUS_LINES: Final[dict[tuple[int, bytes], bytes]] = {}


def _status_line(status: int, reason: bytes) -> bytes:
    """The status line, built once per (status, reason) an upstream uses."""
    found = _STATUS_LINES.get((status, reason))
    if found is None:
        found = status_line(status, reason or None)
        if len(_STATUS_LINES) < 256 and len(reason) <= 64:  # bounded: reasons are free text
            _STATUS_LINES[(status, reason)] = found
    return found


def _line_name(line: bytes) -> bytes:
    return line.split(b":", 1)[0].lower()


class _PassedHead:
    """What ``Relay.response_head``'s pass over an upstream's header fields made of
    them: the fields written as they came (one bytes), and the few it handles itself.
    A function of the fields (and of whether the gateway's own rate-limit fields replace
    the upstream's) only."""

    __slots__ = ("chunked_in", "fields", "has_date", "head", "kept", "legacy", "length",
                 "rate", "via_line")  # fmt: skip

    def __init__(
        self,
        fields: list[tuple[bytes, bytes]],
        rate: bool,
        legacy: bool,
        kept: bytes,
        length: bytes | None,
        chunked_in: bool,
        has_date: bool,
        via_line: bytes,
    ) -> None:
        self.fields = fields
        self.rate = rate
        self.legacy = legacy
        self.kept = kept
        self.length = length
        self.chunked_in = chunked_in
        self.has_date = has_date
        self.via_line = via_line
        # The head's bytes as the upstream sent them, from the status line to the blank
        # line, when they came whole at the start of a read (``Relay.response_head``).
        self.head: bytes | None = None


def _pass_fields(fields: list[tuple[bytes, bytes]], rate: bool, legacy: bool) -> _PassedHead:
    """One pass over an upstream's header fields: every field the gateway does not own
    is written as it came (one concatenation each); only the few special names take a
    branch."""
    lines: list[bytes] = []
    append = lines.append
    tokens: set[bytes] | None = None
    via: list[bytes] | None = None
    length: bytes | None = None
    chunked_in = has_date = False
    actions = _ACTIONS
    for name, value in fields:
        action = actions.get(name)
        if action is None:
            action = _action(name)
        if action:
            if action == _CONNECTION:
                if value in _PLAIN_CONNECTION:
                    continue  # names nothing that is written anyway
                names = {t.strip().lower() for t in value.split(b",")}
                tokens = names if tokens is None else tokens | names
                continue
            if action == _LENGTH:
                length = value
                continue
            if action == _DATE:
                has_date = True
            elif action == _TRANSFER:
                chunked_in = True
                continue
            elif action == _VIA:
                if via is None:
                    via = []
                via.append(value)
                continue
            elif (
                action == _DROP or (action == _RATE and rate) or (action == _LEGACY_RATE and legacy)
            ):
                continue  # (RateLimit fields: the gateway's own replace the upstream's)
        append(name + b": " + value + CRLF)
    if tokens:
        # Rare: names listed in Connection are hop-by-hop for this response.
        lines = [ln for ln in lines if _line_name(ln) not in tokens]
        has_date = has_date and b"date" not in tokens  # (then the gateway writes its own)
    via_line = VIA_LINE if via is None else b"Via: " + b", ".join([*via, VIA]) + CRLF
    return _PassedHead(
        fields, rate, legacy, b"".join(lines), length, chunked_in, has_date, via_line
    )


class _LastHead:
    """The last pass made (one, for the whole process): an upstream answers with the
    same fields response after response (all but Date, which changes once a second), so
    a head equal to the last one takes its pass as it is. Equal: byte for byte, where
    both heads' bytes are known (a read that starts with a whole head); else field for
    field. The same bytes are the same fields: llhttp parses a head from its first byte
    the same way each time (tests/unit/test_response_head.py compares the two ways)."""

    def __init__(self) -> None:
        self.passed: _PassedHead | None = None


_LAST_HEAD: Final = _LastHead()
# Heads with more fields or bytes than this are passed each time (the kept one stays
# small).
MAX_KEPT_FIELDS: Final = 32
MAX_KEPT_HEAD_BYTES: Final = 4096
# (A head's bytes are kept when it ends within upstream_pool.MAX_KEPT_RESPONSE_HEAD bytes
# of its read: ``response_head_bytes``, the same bytes the upstream connection keeps.)


class ClientSide(Protocol):
    """What a Relay asks of the client connection it answers (``ClientConnection``)."""

    def write(self, data: bytes) -> None: ...
    def set_paused(self, reason: str, paused: bool) -> None: ...
    def body_sink_ready(self) -> None: ...
    def keep_alive_after(self, req: Incoming) -> bool: ...
    def forward_head(self, relay: Relay) -> None: ...
    def response_progress(self) -> None: ...
    def forward_done(self, relay: Relay, outcome: int) -> None: ...
    def download_started(self, relay: Relay) -> None: ...
    def forward_failed(self, relay: Relay, exc: BaseException) -> None: ...
    def tunnel_open(self, relay: Relay, rest: bytes) -> None: ...


class Relay:
    """The response side of one forwarded request (an upstream connection's sink).

    Defaults live on the class (one Relay is built per forwarded request; as with
    ``Incoming``, setting every field in ``__init__`` costs more than it needs to)."""

    uconn: UpstreamConnection | None = None
    phase = WAITING
    body_whole_at_send = False
    status = 0
    chunked_out = False
    close_after = False
    until_close = False
    body_chunked_up = False
    # What of the request body went upstream: an upstream connection is reused only
    # after the whole parsed message went out (ClientConnection.forward_done).
    body_sent = 0
    body_ended = False
    download = False  # the answer outlasted one upstream read (counted per client)

    def __init__(
        self,
        conn: ClientSide,
        req: Incoming,
        upstream: Upstream,
        metrics: Metrics,
    ) -> None:
        self.conn = conn
        self.req = req
        self.upstream = upstream
        self.metrics = metrics
        self.out: list[bytes] = []

    # --- request side

    def send(self, uconn: UpstreamConnection, head: bytes) -> None:
        """Write the head and the buffered body; stream the rest as it arrives."""
        self.uconn = uconn
        req = self.req
        self.body_whole_at_send = req.body_done
        chunked = req.chunked and not req.body_done
        self.body_chunked_up = chunked
        body = req.body
        if not body:
            data = head
        elif chunked:
            data = head + b"".join(chunk(c) for c in body if c)
        else:
            data = head + b"".join(body)
        self.body_sent = req.body_size  # everything read so far is in req.body
        self.body_ended = req.body_done
        if not req.body_done:
            req.body = []  # from now on the body streams; a complete one is kept for a retry
        uconn.upgrade_asked = req.tunnel
        uconn.start(self, data, req.head_only)
        if not req.body_done:
            req.sink = self._body_chunk
            self.conn.body_sink_ready()

    def _body_chunk(self, data: bytes) -> None:
        uconn = self.uconn
        if uconn is None:
            return
        if not data:  # the end of the client's body
            self.body_ended = True
            if self.body_chunked_up:
                uconn.write(CHUNKED_END)
            return
        self.body_sent += len(data)
        uconn.write(chunk(data) if self.body_chunked_up else data)

    def forwarded_whole(self) -> bool:
        """Did the whole parsed request go upstream: every body byte, its end, and
        exactly the length its head declared?"""
        length = self.req.content_length
        return self.body_ended and (length is None or self.body_sent == length)

    def upstream_writable(self, writable: bool) -> None:
        self.conn.set_paused("upstream", not writable)

    # --- response side (what UpstreamConnection reports to its sink)

    def response_head(
        self,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        read: bytes | None = None,
    ) -> None:
        """The upstream's response head: ``read``, when given, is the read it came in,
        from the head's first byte (the head may be whole in it, or not)."""
        req = self.req
        conn = self.conn
        self.status = status
        rate_lines = req.rate_lines
        rate = bool(rate_lines)
        legacy = req.legacy_rate
        last = _LAST_HEAD.passed
        same = False
        kept_head: bytes | None = None
        if last is not None and last.rate == rate and last.legacy == legacy:
            kept_head = last.head
            if read is not None and kept_head is not None:
                # (the kept head starts with its status line and ends at its first
                # blank line: a read that starts with it holds this same head, whatever
                # follows)
                same = read.startswith(kept_head)
            else:
                same = headers == last.fields  # (two lists of pairs: ~2,000 instructions)
        if same and last is not None:
            passed = last
            if kept_head is None and read is not None:
                passed.head = response_head_bytes(read)  # (kept by fields: its bytes from now on)
        else:
            passed = _pass_fields(headers, rate, legacy)
            if len(headers) <= MAX_KEPT_FIELDS and (
                sum([len(name) + len(value) for name, value in headers]) <= MAX_KEPT_HEAD_BYTES
            ):
                # (a copy: the list is the upstream connection's, kept apart from it)
                passed.fields = list(headers)
                if read is not None:
                    passed.head = response_head_bytes(read)
                _LAST_HEAD.passed = passed
        length = passed.length
        chunked_in = passed.chunked_in
        lines = [_status_line(status, reason), passed.kept, passed.via_line]
        append = lines.append
        if rate_lines:
            append(rate_lines)
        append(b"X-Request-Id: " + req.request_id.encode() + CRLF)
        bodiless = req.head_only or status == 204 or status == 304
        if length is not None and not chunked_in:
            append(b"Content-Length: " + length + CRLF)
        elif bodiless:
            pass
        elif req.version == "1.1":
            self.chunked_out = True
            append(b"Transfer-Encoding: chunked\r\n")
        else:
            self.close_after = True  # an HTTP/1.0 client reads to the end of the connection
        # No length and not chunked: the response ends when the upstream closes.
        self.until_close = length is None and not chunked_in and not bodiless
        if self.close_after or not conn.keep_alive_after(req):
            self.close_after = True
            append(CLOSE)
        if not passed.has_date:
            append(date_line())
        append(CRLF)
        self.out.append(b"".join(lines))
        if self.phase == WAITING:
            self.phase = STREAMING
            conn.forward_head(self)

    def response_switched(
        self, reason: bytes, headers: list[tuple[bytes, bytes]], rest: bytes
    ) -> None:
        """The upstream answered an asked-for upgrade with 101: write the 101 (with the
        protocol it switched to) and join the connections; ``rest``: what came after it."""
        req = self.req
        lines = [_status_line(101, reason)]
        upgrade = req.upgrade_value
        rate_lines = req.rate_lines
        for name, value in headers:
            lower = name.lower()
            if lower == b"upgrade":
                upgrade = value
            elif lower in _DROPPED_101 or (lower in _RATE_NAMES and rate_lines):
                continue
            else:
                lines.append(name + b": " + value + CRLF)
        lines.append(b"Connection: Upgrade\r\nUpgrade: " + upgrade + CRLF + VIA_LINE)
        if rate_lines:
            lines.append(rate_lines)
        lines.append(b"X-Request-Id: " + req.request_id.encode() + CRLF + CRLF)
        self.status = 101
        self.phase = DONE
        self.conn.write(b"".join(lines))
        self.conn.tunnel_open(self, rest)

    def response_body(self, data: bytes) -> None:
        self.out.append(chunk(data) if self.chunked_out else data)
        self.conn.response_progress()

    def flush(self) -> None:
        """Write what one read from the upstream produced, as one write: a small
        response's head and body leave in one syscall."""
        out = self.out
        if out:
            self.conn.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        if self.phase == STREAMING and not self.download:
            # The answer goes on after this read: it holds its upstream connection until
            # the client has read it (counted per client address, the downloads cap).
            self.download = True
            self.conn.download_started(self)

    def response_end(self) -> None:
        if self.chunked_out:
            self.out.append(CHUNKED_END)
        out = self.out
        if out:
            self.conn.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        self._end(self.status)

    def _end(self, outcome: int) -> None:
        if self.phase != DONE:
            self.phase = DONE
            self.conn.forward_done(self, outcome)

    def fail(self, exc: BaseException) -> None:
        """The exchange cannot go on before a response head arrived (the caller answers)."""
        if self.phase == WAITING:
            self.phase = DONE
            if self.uconn is not None:
                self.uconn.abort()
            self.conn.forward_failed(self, exc)

    def upstream_lost(self, exc: Exception | None) -> None:
        if self.phase == WAITING:
            self.fail(exc or ConnectionError("the upstream closed the connection"))
            return
        if self.phase == DONE:
            return
        if self.until_close and exc is None:
            self.response_end()
            return
        self.metrics.upstream_errors.labels(self.upstream.name, "broken_stream").inc()
        log.warning("upstream %s broke the response stream: %s", self.upstream.name,
                    type(exc).__name__ if exc else "closed early")  # fmt: skip
        self.flush()
        self._end(-502)

    def client_lost(self) -> None:
        """The client went away: drop the upstream connection (it may be mid-response)."""
        if self.uconn is not None:
            self.uconn.abort()
        self._end(-499)

    def client_writable(self, writable: bool) -> None:
        if self.uconn is None:
            return
        if writable:
            self.uconn.resume_reading()
        else:
            self.uconn.pause_reading()


def stale_connection(relay: Relay) -> bool:
    """A reused keep-alive connection that the upstream closed before answering: the
    request most likely never reached it, so a safe request (GET, HEAD, OPTIONS) whose
    whole body was at hand when sent goes again on a new connection. Anything else
    could be applied twice, or resent without its body: 502."""
    uconn = relay.uconn
    return (
        uconn is not None
        and uconn.used > 1
        and not uconn.received
        and relay.body_whole_at_send
        and relay.req.method in RETRY_METHODS
    )
