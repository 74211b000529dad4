"""Named raw HTTP/1.1 requests for the edge differential test.

Every case is the exact bytes a client writes on a fresh connection, in one write. The
corpus covers ordinary requests of every common shape, malformed ones, and the classic
request-smuggling framings. Cases are data only: what each side does with them is decided
by ``tests/integration/test_edge_differential.py``.

Conventions: the last request of every case asks for ``Connection: close`` (or is HTTP/1.0
without keep-alive), so a server that accepts it closes the connection after answering; paths
are under ``/edge`` and already in the gateway's canonical form unless the case says which
form the gateway forwards (``forwarded_target``).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BODY_BYTES = 65536  # the gateway under test is started with this request body limit
HOST = b"Host: edge.test"
CLOSE = b"Connection: close"
HANG = 1.5  # read timeout of the cases where both servers are expected to keep waiting


@dataclass(frozen=True)
class Case:
    name: str
    data: bytes
    # The target the gateway forwards when it normalises the path (README "How requests are
    # handled", 2.); None: the target goes out exactly as the client wrote it.
    forwarded_target: bytes | None = None
    # Read timeout for this case; only cases that are meant to hang set a short one.
    timeout: float | None = None
    note: str = ""


def message(*lines: bytes, body: bytes = b"") -> bytes:
    """A request from its start line and header lines, CRLF-terminated, then ``body``."""
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


def simple(
    method: bytes = b"GET",
    target: bytes = b"/edge/x",
    *headers: bytes,
    body: bytes = b"",
    version: bytes = b"HTTP/1.1",
    close: bool = True,
) -> bytes:
    """Host first, then ``headers``, then ``Connection: close`` (unless ``close=False``)."""
    lines = [method + b" " + target + b" " + version, HOST, *headers]
    if close:
        lines.append(CLOSE)
    return message(*lines, body=body)


def with_length(method: bytes, target: bytes, body: bytes, *headers: bytes) -> bytes:
    return simple(method, target, *headers, b"Content-Length: %d" % len(body), body=body)


def chunks(*parts: bytes, trailers: tuple[bytes, ...] = ()) -> bytes:
    """A valid chunked body: one chunk per part, the last chunk, trailers, final CRLF."""
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p)
    return out + b"0\r\n" + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"


def chunked(method: bytes, target: bytes, body: bytes, *headers: bytes) -> bytes:
    return simple(method, target, *headers, b"Transfer-Encoding: chunked", body=body)


ALL_BYTES = bytes(range(256))
TCHAR_NAME = b"X-!#$%&'*+-.^_`|~09azAZ"
ODD_LEGAL_VALUE = b"a\tb  c !\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~ \x80\xa0\xc3\xa9\xff end"


def _cases() -> list[Case]:
    c: list[Case] = []

    def add(name: str, data: bytes, **kw: object) -> None:
        c.append(Case(name, data, **kw))  # type: ignore[arg-type]

    # --- valid: methods, bodies ---------------------------------------------------------
    add("get", simple())
    add("get-query-encoded", simple(b"GET", b"/edge/search?q=%E2%9C%93&x=%zz&y=a+b&z=%2F&&e="))
    add("get-query-only-question-mark", simple(b"GET", b"/edge/x?"))
    add("head", simple(b"HEAD"))
    add("options", simple(b"OPTIONS", b"/edge/resource"))
    add("delete", simple(b"DELETE", b"/edge/items/42"))
    add("post-content-length", with_length(b"POST", b"/edge/x", b"hello world"))
    add(
        "put-json",
        with_length(b"PUT", b"/edge/doc", b'{"a": [1, 2, 3]}', b"Content-Type: application/json"),
    )
    add("patch", with_length(b"PATCH", b"/edge/doc", b"op=replace"))
    add("delete-with-body", with_length(b"DELETE", b"/edge/items", b"ids=1,2"))
    add("get-with-body", with_length(b"GET", b"/edge/x", b"a body on a GET"))
    add("options-with-body", with_length(b"OPTIONS", b"/edge/x", b"x"))
    add("head-with-body", with_length(b"HEAD", b"/edge/x", b"a body on a HEAD"))
    add("get-chunked-body", chunked(b"GET", b"/edge/x", chunks(b"chunked", b" GET body")))
    add("post-empty-content-length-0", with_length(b"POST", b"/edge/x", b""))
    add("post-without-framing", simple(b"POST"), note="no Content-Length, no body")
    add("put-without-framing", simple(b"PUT"))
    add("post-binary-all-bytes", with_length(b"POST", b"/edge/bin", ALL_BYTES * 4))
    add(
        "post-gzip-content-encoding",
        with_length(
            b"POST", b"/edge/gz", b"\x1f\x8b\x08\x00" + ALL_BYTES[::7], b"Content-Encoding: gzip"
        ),
    )
    add("post-body-near-limit", with_length(b"POST", b"/edge/big", b"b" * (MAX_BODY_BYTES - 1)))
    add("post-body-over-limit", with_length(b"POST", b"/edge/big", b"o" * (MAX_BODY_BYTES + 4000)))
    add(
        "post-content-length-leading-zeros",
        simple(b"POST", b"/edge/x", b"Content-Length: 005", body=b"hello"),
    )
    add(
        "post-content-length-ows",
        simple(b"POST", b"/edge/x", b"Content-Length: \t5 \t", body=b"hello"),
    )
    add("purge-method", simple(b"PURGE", b"/edge/cache"))
    add("report-method", with_length(b"REPORT", b"/edge/cal", b"<x/>"))

    # --- valid: chunked ------------------------------------------------------------------
    add("chunked", chunked(b"POST", b"/edge/x", chunks(b"hello", b" world")))
    add(
        "chunked-extensions",
        chunked(
            b"POST",
            b"/edge/x",
            b'5;name=value\r\nhello\r\n6;a;b="q s"\r\n world\r\n0;last=1\r\n\r\n',
        ),
    )
    add(
        "chunked-trailers",
        chunked(
            b"POST",
            b"/edge/x",
            chunks(b"data", trailers=(b"X-Checksum: abc", b"X-Other: 1")),
            b"Trailer: X-Checksum, X-Other",
        ),
    )
    add("chunked-uppercase-hex", chunked(b"POST", b"/edge/x", b"A\r\n0123456789\r\n0\r\n\r\n"))
    add("chunked-leading-zeros", chunked(b"POST", b"/edge/x", b"0005\r\nhello\r\n000\r\n\r\n"))
    add("chunked-empty", chunked(b"POST", b"/edge/x", chunks()))
    add(
        "chunked-many-small",
        chunked(b"PUT", b"/edge/x", chunks(*[bytes([65 + i % 26]) for i in range(60)])),
    )
    add("chunked-binary", chunked(b"POST", b"/edge/x", chunks(ALL_BYTES, b"\r\n0\r\n\r\n")))
    add("chunked-over-limit", chunked(b"POST", b"/edge/x", chunks(*[b"c" * 8000] * 9)))
    add(
        "chunked-te-case",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: Chunked", body=chunks(b"hi")),
    )

    # --- valid: headers ------------------------------------------------------------------
    add(
        "many-headers-under-limit",
        simple(b"GET", b"/edge/x", *[b"X-H%d: v%d" % (n, n) for n in range(90)]),
    )
    add(
        "repeated-non-identity-headers",
        simple(
            b"GET",
            b"/edge/x",
            b"Accept: text/html",
            b"X-Multi: 1",
            b"Accept: */*",
            b"X-Multi: 2",
            b"Cookie: a=1",
            b"Cookie: b=2",
            b"X-Multi: 3",
        ),
    )
    add("odd-legal-header-value", simple(b"GET", b"/edge/x", b"X-Odd: " + ODD_LEGAL_VALUE))
    add("obs-text-header-value", simple(b"GET", b"/edge/x", b"X-Latin1: caf\xe9 \xff\xfe"))
    add("utf8-header-value", simple(b"GET", b"/edge/x", "X-Utf8: café ✓".encode()))
    add("empty-header-value", simple(b"GET", b"/edge/x", b"X-Empty:", b"X-Empty2: "))
    add("header-value-ows", simple(b"GET", b"/edge/x", b"X-Ows: \t  padded value \t "))
    add("header-name-all-tchars", simple(b"GET", b"/edge/x", TCHAR_NAME + b": v"))
    add("header-name-mixed-case", simple(b"GET", b"/edge/x", b"x-MiXeD-CaSe: V", b"ACCEPT: a"))
    add("long-header-under-limit", simple(b"GET", b"/edge/x", b"X-Long: " + b"l" * 8000))
    add("host-not-first", message(b"GET /edge/x HTTP/1.1", b"Accept: */*", b"X-A: 1", HOST, CLOSE))
    add("http10", message(b"GET /edge/x HTTP/1.0", HOST))
    add("http10-no-host", message(b"GET /edge/x HTTP/1.0", b"X-A: 1"))
    add("http10-post", message(b"POST /edge/x HTTP/1.0", HOST, b"Content-Length: 3", body=b"abc"))
    add("http11-no-host", message(b"GET /edge/x HTTP/1.1", CLOSE))
    add(
        "connection-names-a-header",
        simple(b"GET", b"/edge/x", b"X-Drop: hop", b"Connection: X-Drop", b"X-Keep: e2e"),
    )
    add(
        "hop-by-hop-headers",
        simple(
            b"GET",
            b"/edge/x",
            b"Keep-Alive: timeout=5",
            b"TE: trailers",
            b"Proxy-Authorization: Basic eDp5",
            b"Proxy-Connection: keep-alive",
            b"X-After: 1",
        ),
    )
    add(
        "forwarding-headers-from-client",
        simple(
            b"GET",
            b"/edge/x",
            b"X-Forwarded-For: 6.6.6.6",
            b"Forwarded: for=6.6.6.6",
            b"X-Real-IP: 6.6.6.6",
            b"X-Forwarded-Host: evil",
            b"X-Forwarded-Port: 1",
            b"X-Forwarded-Proto: https",
            b"Via: 1.1 elsewhere",
            b"X-Request-Id: rid-1",
            b"X-After: 1",
        ),
    )
    add("identity-headers", simple(b"GET", b"/edge/x", b"x-api-key: key-1", b"x-user-id: u-1"))
    add("identity-api-key-with-tab", simple(b"GET", b"/edge/x", b"x-api-key: a\tb"))
    add("identity-api-key-obs-text", simple(b"GET", b"/edge/x", b"x-api-key: k\xe9y"))
    add("identity-user-id-over-256", simple(b"GET", b"/edge/x", b"x-user-id: " + b"u" * 300))
    add("identity-api-key-repeated", simple(b"GET", b"/edge/x", b"x-api-key: k1", b"X-Api-Key: k2"))
    add("identity-user-id-repeated", simple(b"GET", b"/edge/x", b"x-user-id: u1", b"x-user-id: u1"))
    add(
        "expect-100-continue",
        simple(b"POST", b"/edge/x", b"Expect: 100-continue", b"Content-Length: 4", body=b"data"),
    )
    add(
        "expect-100-continue-chunked",
        chunked(b"PUT", b"/edge/x", chunks(b"after ", b"continue"), b"Expect: 100-Continue"),
    )
    add("expect-unknown", simple(b"GET", b"/edge/x", b"Expect: something-else"))
    add(
        "upgrade-websocket",
        simple(
            b"GET",
            b"/edge/ws",
            b"Upgrade: websocket",
            b"Connection: Upgrade",
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            b"Sec-WebSocket-Version: 13",
            close=False,
        ),
        timeout=HANG,
        note="after the answer the connection counts as upgraded: both keep it open",
    )
    add(
        "upgrade-h2c",
        simple(
            b"GET",
            b"/edge/x",
            b"Upgrade: h2c",
            b"HTTP2-Settings: AAMAAABkAAQAAP__",
            b"Connection: Upgrade, HTTP2-Settings, close",
        ),
    )
    # An Upgrade request with a body (llhttp's "Upgrade POST request" vector): the body
    # is part of the request, forwarded whole, never left for the next request to meet
    # (hardening, second round, finding 0: request smuggling).
    smuggled = b"GET /edge/smuggled HTTP/1.1\r\nHost: edge.test\r\n\r\n"
    for kind in (b"websocket", b"h2c", b"anything"):
        add(
            f"upgrade-{kind.decode()}-post-content-length",
            with_length(
                b"POST", b"/edge/up", smuggled, b"Upgrade: " + kind, b"Connection: Upgrade"
            ),
        )
        add(
            f"upgrade-{kind.decode()}-post-chunked",
            chunked(
                b"POST", b"/edge/up", chunks(smuggled, b"tail"), b"Upgrade: " + kind,
                b"Connection: Upgrade",
            ),
        )  # fmt: skip
    add("long-query-under-line-limit", simple(b"GET", b"/edge/q?" + b"a=1&" * 1900))

    # --- pipelining ----------------------------------------------------------------------
    add(
        "pipelined-two-gets",
        simple(b"GET", b"/edge/one", close=False) + simple(b"GET", b"/edge/two"),
    )
    add(
        "pipelined-post-then-get",
        simple(b"POST", b"/edge/one", b"Content-Length: 3", body=b"abc", close=False)
        + simple(b"GET", b"/edge/two"),
    )
    add(
        "pipelined-chunked-then-get",
        simple(
            b"POST", b"/edge/one", b"Transfer-Encoding: chunked", body=chunks(b"xyz"), close=False
        )
        + simple(b"GET", b"/edge/two"),
    )
    add(
        "pipelined-three-mixed",
        simple(b"DELETE", b"/edge/1", close=False)
        + simple(b"PUT", b"/edge/2", b"Content-Length: 2", body=b"ok", close=False)
        + simple(b"GET", b"/edge/3?x=1"),
    )
    add(
        "body-looks-like-a-request",
        with_length(b"POST", b"/edge/x", simple(b"GET", b"/edge/smuggled")),
    )
    add(
        "pipelined-after-content-length-0",
        simple(b"POST", b"/edge/x", b"Content-Length: 0", close=False)
        + simple(b"GET", b"/edge/second"),
        note="the second request is a request for both: a canary for body/next confusion",
    )
    add(
        "pipelined-after-close",
        simple(b"GET", b"/edge/one") + simple(b"GET", b"/edge/never"),
        note="nothing after a Connection: close request may be served",
    )
    add(
        "pipelined-then-malformed",
        simple(b"GET", b"/edge/one", close=False) + b"GET /edge/two HTTP/1.1\r\nBad Header\r\n\r\n",
    )

    # --- paths the gateway normalises ----------------------------------------------------
    add(
        "path-dot-segments",
        simple(b"GET", b"/edge//a/./b/../c/?k=v"),
        forwarded_target=b"/edge/a/c?k=v",
    )
    add(
        "path-encoded-unreserved",
        simple(b"GET", b"/edge/%7Euser/%41%2d"),
        forwarded_target=b"/edge/~user/A-",
    )
    add(
        "path-encoded-lowercase-kept",
        simple(b"GET", b"/edge/%e2%9c%93/a%20b"),
        forwarded_target=b"/edge/%E2%9C%93/a%20b",
    )
    add(
        "path-encoded-dot-segment",
        simple(b"GET", b"/edge/%2e/x/%2E%2E/y"),
        forwarded_target=b"/edge/y",
    )
    add("path-sub-delims", simple(b"GET", b"/edge/a!$&'()*+,=:@b"))

    # --- refused on purpose by the gateway (see the differences table) ---------------------
    add("absolute-form", simple(b"GET", b"http://example.com/edge/x"))
    add("absolute-form-https-port", simple(b"GET", b"https://example.com:8443/edge/x?q=1"))
    add("asterisk-form", simple(b"OPTIONS", b"*"))
    add(
        "connect",
        simple(b"CONNECT", b"example.com:443", close=False),
        timeout=HANG,
        note="aiohttp treats CONNECT as an upgrade: the connection stays open after the answer",
    )
    add(
        "connect-then-request",
        simple(b"CONNECT", b"example.com:443", close=False) + simple(b"GET", b"/edge/tunnel"),
        timeout=HANG,
        note="what follows CONNECT is tunnel data, never a second request",
    )
    add("trace", simple(b"TRACE", b"/edge/x"))
    add("path-encoded-slash", simple(b"GET", b"/edge/a%2Fb"))
    add("path-encoded-backslash", simple(b"GET", b"/edge/a%5cb"))
    add("path-semicolon", simple(b"GET", b"/edge/a;jsessionid=1"))
    add("path-encoded-semicolon", simple(b"GET", b"/edge/a%3Bb"))
    add("path-dotdot-above-root", simple(b"GET", b"/../edge/x"))
    add("path-encoded-nul", simple(b"GET", b"/edge/a%00b"))
    add("path-malformed-percent", simple(b"GET", b"/edge/a%zzb"))
    add("path-raw-backslash", simple(b"GET", b"/edge/a\\b"))
    add("path-raw-quote-and-braces", simple(b"GET", b'/edge/"a"{b}|c^'))
    add("path-over-4096", simple(b"GET", b"/edge/" + b"p" * 4200))
    add("headers-101-to-128", simple(b"GET", b"/edge/x", *[b"X-H%d: v" % n for n in range(110)]))

    # --- framing: Content-Length ---------------------------------------------------------
    add(
        "cl-then-te",
        simple(
            b"POST",
            b"/edge/x",
            b"Content-Length: 4",
            b"Transfer-Encoding: chunked",
            body=chunks(b"smuggle"),
        ),
    )
    add(
        "te-then-cl",
        simple(
            b"POST",
            b"/edge/x",
            b"Transfer-Encoding: chunked",
            b"Content-Length: 4",
            body=chunks(b"smuggle"),
        ),
    )
    add(
        "cl-te-smuggle-pipeline",
        simple(
            b"POST",
            b"/edge/x",
            b"Content-Length: 6",
            b"Transfer-Encoding: chunked",
            body=b"0\r\n\r\nG",
            close=False,
        )
        + simple(b"GET", b"/edge/y"),
    )
    add(
        "cl-twice-equal",
        simple(b"POST", b"/edge/x", b"Content-Length: 5", b"Content-Length: 5", body=b"hello"),
    )
    add(
        "cl-twice-different",
        simple(b"POST", b"/edge/x", b"Content-Length: 5", b"Content-Length: 3", body=b"hello"),
    )
    add(
        "cl-list-in-one-header", simple(b"POST", b"/edge/x", b"Content-Length: 5, 5", body=b"hello")
    )
    add("cl-plus-sign", simple(b"POST", b"/edge/x", b"Content-Length: +5", body=b"hello"))
    add("cl-negative", simple(b"POST", b"/edge/x", b"Content-Length: -5", body=b"hello"))
    add("cl-inner-space", simple(b"POST", b"/edge/x", b"Content-Length: 1 1", body=b"h" * 11))
    add("cl-hex", simple(b"POST", b"/edge/x", b"Content-Length: 0x5", body=b"hello"))
    add(
        "cl-overflow",
        simple(b"POST", b"/edge/x", b"Content-Length: 99999999999999999999999", body=b"hello"),
    )
    add("cl-empty", simple(b"POST", b"/edge/x", b"Content-Length:", body=b"hello"))
    add("cl-letters", simple(b"POST", b"/edge/x", b"Content-Length: five", body=b"hello"))
    add(
        "cl-shorter-than-body-leftover",
        simple(
            b"POST",
            b"/edge/x",
            b"Content-Length: 2",
            body=b"heGET /edge/y HTTP/1.1\r\nHost: edge.test\r\n\r\n",
        ),
    )
    add(
        "cl-longer-than-body",
        simple(b"POST", b"/edge/x", b"Content-Length: 50", body=b"short"),
        timeout=HANG,
        note="both sides wait for the rest of the body",
    )

    # --- framing: Transfer-Encoding ------------------------------------------------------
    add(
        "te-gzip-chunked",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: gzip, chunked", body=chunks(b"zz")),
    )
    add(  # both refuse: the gateway at the head (501), aiohttp on the bad chunk (400)
        "te-gzip-chunked-bad-chunk",
        simple(
            b"GET", b"/edge/gen", b"Transfer-Encoding: gzip, chunked", body=b"1\r\n\x00\n0\r\n\r\n"
        ),
    )
    add(
        "te-chunked-gzip",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: chunked, gzip", body=chunks(b"zz")),
    )
    add("te-identity", simple(b"POST", b"/edge/x", b"Transfer-Encoding: identity", body=b"abc"))
    add(
        "te-identity-with-cl",
        simple(
            b"POST", b"/edge/x", b"Transfer-Encoding: identity", b"Content-Length: 3", body=b"abc"
        ),
    )
    add("te-gzip-only", simple(b"POST", b"/edge/x", b"Transfer-Encoding: gzip", body=b"abc"))
    add(
        "te-twice-chunked",
        simple(
            b"POST",
            b"/edge/x",
            b"Transfer-Encoding: chunked",
            b"Transfer-Encoding: chunked",
            body=chunks(b"abc"),
        ),
    )
    add(
        "te-split-gzip-then-chunked",
        simple(
            b"POST",
            b"/edge/x",
            b"Transfer-Encoding: gzip",
            b"Transfer-Encoding: chunked",
            body=chunks(b"abc"),
        ),
    )
    add(
        "te-xchunked",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: xchunked", body=chunks(b"abc")),
    )
    add(
        "te-chunked-trailing-comma",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: chunked,", body=chunks(b"abc")),
    )
    add(
        "te-chunked-vertical-tab",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding: \x0bchunked", body=chunks(b"abc")),
    )
    add(
        "te-in-http10",
        message(b"POST /edge/x HTTP/1.0", HOST, b"Transfer-Encoding: chunked", body=chunks(b"abc")),
    )
    add(
        "te-obs-fold",
        simple(b"POST", b"/edge/x", b"Transfer-Encoding:", b" chunked", body=chunks(b"abc")),
    )

    # --- framing: bad chunks -------------------------------------------------------------
    add("chunk-size-not-hex", chunked(b"POST", b"/edge/x", b"zz\r\nhello\r\n0\r\n\r\n"))
    add("chunk-size-negative", chunked(b"POST", b"/edge/x", b"-5\r\nhello\r\n0\r\n\r\n"))
    add(
        "chunk-size-overflow",
        chunked(b"POST", b"/edge/x", b"fffffffffffffffff1\r\nhello\r\n0\r\n\r\n"),
    )
    add("chunk-size-0x-prefix", chunked(b"POST", b"/edge/x", b"0x5\r\nhello\r\n0\r\n\r\n"))
    add("chunk-missing-crlf-after-data", chunked(b"POST", b"/edge/x", b"5\r\nhello0\r\n\r\n"))
    add("chunk-data-longer-than-size", chunked(b"POST", b"/edge/x", b"3\r\nhello\r\n0\r\n\r\n"))
    add("chunk-size-space-before-crlf", chunked(b"POST", b"/edge/x", b"5 \r\nhello\r\n0\r\n\r\n"))
    add("chunk-size-bare-lf", chunked(b"POST", b"/edge/x", b"5\nhello\r\n0\r\n\r\n"))
    add("chunk-extension-bare-lf", chunked(b"POST", b"/edge/x", b"5;a\nhello\r\n0\r\n\r\n"))
    add("chunk-extension-bare-cr", chunked(b"POST", b"/edge/x", b"5;a\rb\r\nhello\r\n0\r\n\r\n"))
    add(
        "chunk-trailer-obs-fold",
        chunked(b"POST", b"/edge/x", b"3\r\nabc\r\n0\r\nX-T: a\r\n b\r\n\r\n"),
    )

    # --- malformed header section --------------------------------------------------------
    add("obs-fold", simple(b"GET", b"/edge/x", b"X-Folded: first", b" continued"))
    add("obs-fold-tab", simple(b"GET", b"/edge/x", b"X-Folded: first", b"\tcontinued"))
    add("bare-lf-everywhere", b"GET /edge/x HTTP/1.1\nHost: edge.test\nConnection: close\n\n")
    add(
        "bare-lf-one-header",
        b"GET /edge/x HTTP/1.1\r\nHost: edge.test\r\nX-A: 1\nConnection: close\r\n\r\n",
    )
    add("bare-cr-in-header-value", simple(b"GET", b"/edge/x", b"X-A: a\rb"))
    add("bare-cr-line-ending", b"GET /edge/x HTTP/1.1\rHost: edge.test\rConnection: close\r\r")
    add("nul-in-header-value", simple(b"GET", b"/edge/x", b"X-A: a\x00b"))
    add("nul-in-header-name", simple(b"GET", b"/edge/x", b"X-\x00A: b"))
    add("nul-in-target", simple(b"GET", b"/edge/a\x00b"))
    add("control-char-in-header-value", simple(b"GET", b"/edge/x", b"X-A: a\x01b\x7fc"))
    add("space-before-colon", simple(b"GET", b"/edge/x", b"X-A : b"))
    add("tab-before-colon", simple(b"GET", b"/edge/x", b"X-A\t: b"))
    add("space-in-header-name", simple(b"GET", b"/edge/x", b"X A: b"))
    add("invalid-char-in-header-name", simple(b"GET", b"/edge/x", b"X(A): b", b"X@B: c"))
    add("non-ascii-header-name", simple(b"GET", b"/edge/x", b"X-\xc3\xa9: b"))
    add("header-without-colon", simple(b"GET", b"/edge/x", b"X-No-Colon"))
    add("header-empty-name", simple(b"GET", b"/edge/x", b": value"))
    add(
        "leading-whitespace-first-header", message(b"GET /edge/x HTTP/1.1", b" X-A: 1", HOST, CLOSE)
    )
    add("host-twice", message(b"GET /edge/x HTTP/1.1", HOST, b"Host: other.test", CLOSE))
    add("huge-header-over-8190", simple(b"GET", b"/edge/x", b"X-Huge: " + b"h" * 9000))
    add(
        "header-name-plus-value-over-8190",
        simple(b"GET", b"/edge/x", b"X-Big: " + b"v" * 8186),
        note="the value alone is within aiohttp's 8190; name + value is over the gateway's",
    )
    add("huge-identity-header", simple(b"GET", b"/edge/x", b"x-api-key: " + b"k" * 9000))
    add("too-many-headers", simple(b"GET", b"/edge/x", *[b"X-H%d: v" % n for n in range(150)]))

    # --- malformed request line ----------------------------------------------------------
    add("version-http2-in-http1", simple(b"GET", b"/edge/x", version=b"HTTP/2.0"))
    add("version-http12", simple(b"GET", b"/edge/x", version=b"HTTP/1.2"))
    add("version-lowercase", simple(b"GET", b"/edge/x", version=b"http/1.1"))
    add("version-http3", simple(b"GET", b"/edge/x", version=b"HTTP/3.0"))
    add("version-missing", b"GET /edge/x\r\nHost: edge.test\r\nConnection: close\r\n\r\n")
    add("version-two-digits", simple(b"GET", b"/edge/x", version=b"HTTP/1.10"))
    add("method-lowercase", simple(b"get", b"/edge/x"))
    add("method-unknown-token", simple(b"FROB", b"/edge/x"))
    add("method-with-invalid-char", simple(b"GE(T", b"/edge/x"))
    add("target-non-ascii-utf8", simple(b"GET", "/edge/café".encode()))
    add("target-non-ascii-byte", simple(b"GET", b"/edge/\xff"))
    add("target-space", b"GET /edge/a b HTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n")
    add("target-tab", b"GET /edge/a\tb HTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n")
    add("target-fragment", simple(b"GET", b"/edge/x#frag"))
    add(
        "request-line-double-space",
        b"GET  /edge/x HTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n",
    )
    add(
        "request-line-trailing-space",
        b"GET /edge/x HTTP/1.1 \r\nHost: edge.test\r\nConnection: close\r\n\r\n",
    )
    add(
        "request-line-tab-separator",
        b"GET\t/edge/x\tHTTP/1.1\r\nHost: edge.test\r\nConnection: close\r\n\r\n",
    )
    add("leading-empty-line", b"\r\n" + simple())
    add("request-line-over-8190", simple(b"GET", b"/edge/q?" + b"a" * 9000))
    return c


CASES: tuple[Case, ...] = tuple(_cases())
NAMED_CASES = len(CASES)
assert len({case.name for case in CASES}) == NAMED_CASES, "case names must be unique"
