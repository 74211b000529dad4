"""Edge differential: the gateway's HTTP/1.1 edge against aiohttp's own server.

The same raw request bytes go (a) to the gateway, whose upstream is a raw recording TCP
server (``tests/support/raw_upstream.py``), and (b) to a bare ``aiohttp.web.Server`` that
records what aiohttp parsed and answers 200 (the reference). For every request:

* both must reach the same verdict, request by request for pipelined bytes: accepted (it
  reached the upstream / the handler and the client got a 2xx), rejected (a 4xx, or the
  connection closed without an answer, and nothing reached the upstream), or left hanging;
* when both accept, the upstream must receive what the reference parsed: the same method,
  target (the normalised one where the gateway normalises the path), end-to-end headers in
  the same order with the same value bytes, and the same (de-chunked) body.

The gateway is deliberately stricter than aiohttp in documented ways, and its forwarding
differs in a few harmless ones: each such difference is one row of ``KNOWN_DIFFERENCES``,
with its reason. Anything else fails with the request bytes and both outcomes.
(``AIOHTTP_PLANE_QUIRKS`` lists what the aiohttp data plane did differently, defects
included; it is tolerated only while that data plane is the one under test.)

Corpus: the named cases of ``tests/support/edge_corpus.py`` plus ``HYPOTHESIS_EXAMPLES``
hypothesis-generated mutations of valid requests; ``pytest -s`` prints the sizes.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httptools
import pytest
import pytest_asyncio
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.edge_corpus import CASES, MAX_BODY_BYTES, NAMED_CASES, Case
from tests.support.gateway import running_gateway
from tests.support.raw_upstream import RawUpstream, ReceivedRequest, running_raw_upstream

# Every async test shares the module's event loop, where the harness lives.
ON_MODULE_LOOP = pytest.mark.asyncio(loop_scope="module")

HYPOTHESIS_EXAMPLES = 150
CORPUS_SIZE = NAMED_CASES + HYPOTHESIS_EXAMPLES
READ_TIMEOUT = 5.0
PREFIX_TIMEOUT = 1.0  # re-asking the reference about a prefix that may end keep-alive
GENERATED_TIMEOUT = 2.0
# The gateway's defaults (README, Configuration) and aiohttp's own (web_protocol).
MAX_HEADERS = 100
MAX_HEADER_BYTES = 8190
AIOHTTP_MAX_LINE = 8190
MAX_PATH_BYTES = 4096

# The aiohttp data plane (web.Application, up to commit d05678f) had gateway/proxy/forward.py;
# the asyncio Protocols + httptools one does not.
AIOHTTP_DATA_PLANE = importlib.util.find_spec("gateway.proxy.forward") is not None

RULES = """\
# Differential edge test: one catch-all rule that never limits, so no limit interferes.
rules:
  - id: edge-everything
    unlimited: true
"""

Header = tuple[bytes, bytes]

# Hop-by-hop (RFC 9110 7.6.1, plus the de-facto Keep-Alive and Proxy-Connection), and the
# fields the gateway sets, replaces or drops from untrusted peers on purpose (README "How
# requests are handled", 8. and 9.): compared on neither side.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authorization", b"proxy-authenticate", b"te",
     b"trailer", b"transfer-encoding", b"upgrade", b"proxy-connection"}
)  # fmt: skip
GATEWAY_OWNED = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"via", b"x-request-id", b"forwarded",
     b"x-real-ip", b"x-forwarded-host", b"x-forwarded-port"}
)  # fmt: skip
IDENTITY_HEADERS = (b"x-api-key", b"x-user-id")


# --- what each side saw ---------------------------------------------------------------------


@dataclass(frozen=True)
class Message:
    """One request as a server parsed it, in a form both sides share."""

    method: bytes
    target: bytes
    headers: tuple[Header, ...]
    body: bytes
    version: bytes = b"1.1"

    def values(self, name: bytes) -> list[bytes]:
        return [_ows(v) for n, v in self.headers if n.lower() == name]


def _ows(value: bytes) -> bytes:
    return value.strip(b" \t")


@dataclass
class Exchange:
    """One connection: the final statuses the client read, how the connection ended, and
    the requests that reached the server behind it (the upstream, or the handler)."""

    statuses: list[int]
    ended: str  # "eof" or "timeout"
    reached: list[Message]
    reply: bytes
    upstream_errors: list[str] = field(default_factory=list)

    def verdicts(self) -> list[tuple[str, int | None]]:
        """Per request: A (2xx), R (4xx, 501, or closed without any answer), E (5xx and
        the rest), H (no answer within the read timeout), with the status. 501 is a
        refusal, not a failure: what the server does not implement (a transfer coding
        other than chunked, RFC 9112 6.1), so a request both sides refuse, one with 501
        before the body and one with 400 on the body, agrees."""
        out: list[tuple[str, int | None]] = []
        for status in self.statuses:
            refused = 400 <= status < 500 or status == 501
            kind = "A" if 200 <= status < 300 else "R" if refused else "E"
            out.append((kind, status))
        if self.ended == "timeout":
            out.append(("H", None))
        elif not self.statuses:
            out.append(("R", None))
        return out

    def describe(self) -> str:
        shown = " ".join(f"{k}{s or ''}" for k, s in self.verdicts())
        lines = [f"{shown} (connection ended by {self.ended})"]
        for n, m in enumerate(self.reached):
            lines.append(f"  reached[{n}]: {m.method!r} {_short(m.target, 160)}")
            lines.append(f"    headers: {_short(repr(list(m.headers)).encode(), 600)}")
            lines.append(f"    body: {_short(m.body)}")
        lines.extend(f"  upstream could not parse: {e}" for e in self.upstream_errors)
        lines.append(f"  reply: {_short(self.reply, 300)}")
        return "\n".join(lines)


def _short(data: bytes, limit: int = 120) -> str:
    text = repr(data[:limit])
    return text + (f"... ({len(data)} bytes)" if len(data) > limit else "")


def request_methods(data: bytes) -> list[bytes]:
    """The methods of the requests in ``data``, in order, as far as a strict parser reads."""
    methods: list[bytes] = []

    class Callbacks:
        def on_headers_complete(self) -> None:
            methods.append(parser.get_method())

    while data:
        parser = httptools.HttpRequestParser(Callbacks())
        try:
            parser.feed_data(data)
            break
        except httptools.HttpParserUpgrade as upgrade:  # CONNECT / Upgrade: parse on after it
            data = data[int(upgrade.args[0]) :]
        except httptools.HttpParserError:
            break
    return methods


class _RequestEnds:
    def __init__(self) -> None:
        self.complete = False

    def on_message_complete(self) -> None:
        self.complete = True


def request_ends(data: bytes) -> list[int]:
    """Offsets just past each complete request in ``data``, as a strict llhttp reads them."""
    ends: list[int] = []
    events = _RequestEnds()
    parser = httptools.HttpRequestParser(events)
    for pos in range(len(data)):
        try:
            parser.feed_data(data[pos : pos + 1])
        except httptools.HttpParserUpgrade:  # CONNECT / Upgrade: nothing after it is HTTP
            if events.complete:
                ends.append(pos + 1)
            break
        except httptools.HttpParserError:
            break
        if events.complete:
            events.complete = False
            ends.append(pos + 1)
    return ends


class _ResponseEvents:
    def __init__(self) -> None:
        self.headers = False
        self.complete = False

    def on_headers_complete(self) -> None:
        self.headers = True

    def on_message_complete(self) -> None:
        self.complete = True


def final_statuses(reply: bytes, methods: list[bytes]) -> list[int]:
    """Status codes of the final (non-1xx) responses in ``reply``, in order.

    Fed byte by byte, so that an answer to HEAD, or a 2xx to CONNECT, can be cut after its
    header section (they have no body whatever their Content-Length says); ``methods`` are
    the requests' methods in order.
    """
    statuses: list[int] = []
    pos = 0
    while pos < len(reply):
        events = _ResponseEvents()
        parser = httptools.HttpResponseParser(events)
        try:
            while pos < len(reply) and not events.complete:
                parser.feed_data(reply[pos : pos + 1])
                pos += 1
                if not events.headers:
                    continue
                events.headers = False
                code = parser.get_status_code()
                if code < 200:
                    continue
                method = methods[len(statuses)] if len(statuses) < len(methods) else b""
                statuses.append(code)
                if method == b"HEAD" or (method == b"CONNECT" and code < 300):
                    break  # no body: the next answer starts here
        except httptools.HttpParserError:
            break  # garbage after the last answer: the statuses before it stand
    return statuses


async def exchange(
    port: int, data: bytes, timeout: float, answers: int | None = None
) -> tuple[bytes, str]:
    """Write ``data`` on a fresh connection in one write; read until EOF or the timeout
    (or, given ``answers``, until that many final answers have arrived)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reply = bytearray()
    ended = "eof"
    methods = request_methods(data) if answers else []
    try:
        writer.write(data)
        await writer.drain()
        async with asyncio.timeout(timeout):
            while chunk := await reader.read(65536):
                reply += chunk
                if answers and len(final_statuses(bytes(reply), methods)) >= answers:
                    break
    except TimeoutError:
        ended = "timeout"
    except ConnectionError:
        pass  # reset by the server: as good as a close
    finally:
        writer.close()
    return bytes(reply), ended


# --- the intended differences ---------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One way the gateway may differ from aiohttp, and why.

    kind "refuses": the reference accepts a request the gateway answers with one of
    ``statuses``; "accepts": the reference refuses a request the gateway forwards;
    "forwards": both accept, and ``adjust`` maps (expected, upstream) -- target and
    end-to-end headers -- to what must then be equal. ``applies`` looks at the request as
    the accepting side parsed it (for "forwards", the reference's).
    """

    key: str
    kind: str
    reason: str
    applies: Callable[[Message], bool]
    statuses: frozenset[int] = frozenset()
    adjust: Callable[[Forwarded, Forwarded], tuple[Forwarded, Forwarded]] | None = None


@dataclass(frozen=True)
class Forwarded:
    """What is compared of a request both accept: its target and end-to-end headers."""

    target: bytes
    headers: tuple[Header, ...]

    def replace(self, target: bytes | None = None, headers: list[Header] | None = None):
        return Forwarded(
            self.target if target is None else target,
            self.headers if headers is None else tuple(headers),
        )


UNRESERVED = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
PATH_RAW = UNRESERVED | frozenset(b"!$&'()*+,=:@/%")  # RFC 3986 pchar and "/", less ";"
HEX = frozenset(b"0123456789abcdefABCDEF")


def refused_path(target: bytes) -> str | None:
    """Why the gateway refuses this origin-form path (README "How requests are handled" 2.,
    docs/rules.md), written from the documentation, not from the gateway's code."""
    path = target.split(b"?", 1)[0]
    if len(path) > MAX_PATH_BYTES:
        return "path over 4096 bytes"
    if b";" in path:
        return "';' path parameter"
    if set(path) - PATH_RAW:
        return "a character RFC 3986 does not allow raw in a path"
    decoded = bytearray()
    i = 0
    while i < len(path):
        if path[i] != 0x25:  # '%'
            decoded.append(path[i])
            i += 1
            continue
        pair = path[i + 1 : i + 3]
        if len(pair) != 2 or not set(pair) <= HEX:
            return "malformed percent-encoding"
        byte = int(pair, 16)
        if byte in (0x2F, 0x5C, 0x3B) or byte < 0x20 or byte == 0x7F:
            return "encoded '/', '\\', ';' or control character"
        decoded += bytes([byte]) if byte in UNRESERVED else path[i : i + 3]
        i += 3
    depth = 0
    for segment in bytes(decoded).split(b"/"):
        if segment == b"..":
            if depth == 0:
                return "'..' above the root"
            depth -= 1
        elif segment not in (b"", b"."):
            depth += 1
    return None


def _bad_identity(m: Message) -> bool:
    for name in IDENTITY_HEADERS:
        values = m.values(name)
        if len(values) > 1 or any(b < 0x20 or b > 0x7E for v in values for b in v):
            return True
    return False


def _codings(m: Message) -> list[bytes]:
    return [_ows(c).lower() for v in m.values(b"transfer-encoding") for c in v.split(b",")]


def _expectation(m: Message) -> bool:
    return any(v.lower() != b"100-continue" for v in m.values(b"expect"))


def _host_first(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    """A single Host moved to the front on both sides (its position is what differs)."""
    if [n for n, _ in ref.headers].count(b"host") != 1:
        return ref, up
    if [n for n, _ in up.headers].count(b"host") != 1:
        return ref, up

    def front(f: Forwarded) -> Forwarded:
        host = [h for h in f.headers if h[0] == b"host"]
        return f.replace(headers=host + [h for h in f.headers if h[0] != b"host"])

    return front(ref), front(up)


def _drop_added_host(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    if any(n == b"host" for n, _ in ref.headers):
        return ref, up
    return ref, up.replace(headers=[h for h in up.headers if h[0] != b"host"])


def _drop_added_length(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    if any(n == b"content-length" for n, _ in ref.headers):
        return ref, up
    return ref, up.replace(headers=[h for h in up.headers if h != (b"content-length", b"0")])


def _drop_met_expectation(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    return ref.replace(headers=[h for h in ref.headers if h[0] != b"expect"]), up


def _no_framing(m: Message) -> bool:
    return not m.values(b"content-length") and not m.values(b"transfer-encoding") and not m.body


KNOWN_DIFFERENCES: tuple[Difference, ...] = (
    # -- the gateway refuses on purpose what aiohttp accepts --
    Difference(
        "refused-method",
        "refuses",
        "CONNECT and TRACE are refused (405): the gateway is never an open proxy, and TRACE "
        "would echo credentials (README 1., SPEC 6)",
        lambda m: m.method in (b"CONNECT", b"TRACE"),
        frozenset({400, 405}),
    ),
    Difference(
        "non-origin-form-target",
        "refuses",
        "absolute-form (GET http://host/...), authority-form and asterisk-form targets are "
        "refused with 400: only origin-form paths are proxied (README 1., SPEC 6)",
        lambda m: not m.target.startswith(b"/"),
        frozenset({400, 405}),
    ),
    Difference(
        "ambiguous-path",
        "refuses",
        "spellings servers disagree about are refused with 400 so no spelling dodges a rule: "
        "%2F, %5C, ';' / %3B, encoded control characters, '..' above the root, malformed "
        "%-escapes, characters RFC 3986 does not allow raw in a path (e.g. '\"', '{', '#'), "
        "paths over 4096 bytes (README 2., docs/rules.md)",
        lambda m: m.target.startswith(b"/") and refused_path(m.target) is not None,
        frozenset({400}),
    ),
    Difference(
        "identity-header",
        "refuses",
        "a repeated x-api-key / x-user-id is refused with 400 (upstreams disagree about which "
        "copy counts), and so may be one whose bytes are not printable ASCII (SPEC 2: the "
        "identity counted is exactly the value the upstream receives)",
        _bad_identity,
        frozenset({400}),
    ),
    Difference(
        "header-count",
        "refuses",
        f"more than max_headers={MAX_HEADERS} header fields: 431 (aiohttp's own limit is 128)",
        lambda m: len(m.headers) > MAX_HEADERS,
        frozenset({400, 431}),
    ),
    Difference(
        "header-size",
        "refuses",
        f"a header field (name + value) over max_header_bytes={MAX_HEADER_BYTES}: 431",
        lambda m: any(len(n) + len(v) > MAX_HEADER_BYTES for n, v in m.headers),
        frozenset({400, 431}),
    ),
    Difference(
        "body-size",
        "refuses",
        f"a request body over max_body_bytes (started with {MAX_BODY_BYTES}): 413",
        lambda m: len(m.body) > MAX_BODY_BYTES,
        frozenset({413}),
    ),
    Difference(
        "unknown-expectation",
        "refuses",
        "an Expect other than 100-continue may be answered 417 (RFC 9110 10.1.1); aiohttp's "
        "web.Application does so, its bare Server (the reference) ignores Expect",
        _expectation,
        frozenset({417}),
    ),
    Difference(
        "transfer-coding-not-chunked",
        "refuses",
        "a transfer coding other than chunked (gzip, chunked) may be refused with 501 or "
        "400 (RFC 9112 6.1); aiohttp accepts it but never decodes it, so what the upstream "
        "would get is still gzip-coded and labelled as nothing",
        lambda m: any(c != b"chunked" for c in _codings(m)),
        frozenset({400, 501}),
    ),
    Difference(
        "transfer-encoding-in-http10",
        "refuses",
        "Transfer-Encoding in an HTTP/1.0 request may be refused with 400: RFC 9112 6.1 says "
        "to treat its framing as faulty",
        lambda m: m.version == b"1.0" and bool(m.values(b"transfer-encoding")),
        frozenset({400}),
    ),
    Difference(
        "http-version-not-1x",
        "refuses",
        "a request line without a version or with one other than HTTP/1.0 or 1.1 (llhttp takes "
        "HTTP/2.0 in a request line) may be refused with 505 or 400 (RFC 9110 15.6.6)",
        lambda m: m.version not in (b"1.0", b"1.1"),
        frozenset({400, 505}),
    ),
    # -- the gateway accepts what aiohttp's defaults refuse --
    Difference(
        "long-request-line",
        "accepts",
        "a request line over aiohttp's default 8190 bytes (a long query string) is "
        "forwarded: the gateway bounds the path (4096 bytes), each header field and the whole "
        "head (the aiohttp plane: lines up to 4 x max_header_bytes; the Protocols plane: a "
        "64 KiB head), not the query string as such. No framing issue: both parse it alike",
        lambda m: (
            len(m.method) + len(m.target) + 10 > AIOHTTP_MAX_LINE
            and len(m.target.split(b"?", 1)[0]) <= MAX_PATH_BYTES
        ),
    ),
    # -- both accept, the forwarded header section differs harmlessly --
    Difference(
        "host-first",
        "forwards",
        "Host may be moved to the front: the order of fields with different names carries "
        "no meaning (RFC 9110 5.3); the aiohttp data plane's client wrote Host first",
        lambda m: len(m.values(b"host")) == 1,
        adjust=_host_first,
    ),
    Difference(
        "expect-met-here",
        "forwards",
        "Expect: 100-continue is met by the gateway (it sends the 100 and reads the body "
        "first) and not passed on, so the upstream does not answer it a second time",
        lambda m: any(v.lower() == b"100-continue" for v in m.values(b"expect")),
        adjust=_drop_met_expectation,
    ),
    Difference(
        "host-added",
        "forwards",
        "a request without Host (HTTP/1.0) gets one: the gateway speaks HTTP/1.1 upstream, "
        "where Host is mandatory (RFC 9112 3.2; SPEC 6: Host preserved or rewritten)",
        lambda m: not m.values(b"host"),
        adjust=_drop_added_host,
    ),
    # -- checked by Harness.whole_batch_rejected, which asks the reference again --
    Difference(
        "whole-batch-rejected",
        "accepts",
        "aiohttp parses all that one read delivered before answering, and a parse error "
        "anywhere in it (or bytes after a Connection: close request) discards the complete "
        "requests before it as well; a server that answers those and then refuses or ignores "
        "the rest is as safe. Not assumed: aiohttp given only the bytes of the requests the "
        "gateway answered must accept exactly those, and they must be forwarded as it parses "
        "them",
        lambda m: False,
    ),
)


def _valid_utf8_only(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    def strip(v: bytes) -> bytes:
        return _ows(v.decode("utf-8", "ignore").encode())

    return ref.replace(headers=[(n, strip(v)) for n, v in ref.headers]), up


def _empty_query_dropped(ref: Forwarded, up: Forwarded) -> tuple[Forwarded, Forwarded]:
    if ref.target.endswith(b"?") and up.target == ref.target[:-1]:
        return ref, up.replace(target=ref.target)
    return ref, up


# What the aiohttp data plane (gateway/proxy/forward.py, before the Protocols + httptools
# one) did differently, defects included: tolerated only while it is the one under test.
AIOHTTP_PLANE_QUIRKS: tuple[Difference, ...] = (
    Difference(
        "content-length-0-added",
        "forwards",
        "harmless: a request without framing headers and without a body is forwarded "
        "with Content-Length: 0 (aiohttp's client adds it; the same empty body, stated "
        "explicitly, RFC 9110 8.6)",
        _no_framing,
        adjust=_drop_added_length,
    ),
    Difference(
        "non-utf8-header-bytes-dropped",
        "forwards",
        "DEFECT: header values are decoded as UTF-8 (surrogateescape) by aiohttp's server and "
        "re-encoded by its client, which drops every byte that is not valid UTF-8: "
        "'x-api-key: k\\xe9y' reaches the upstream as 'ky' (and obs-text in any field is "
        "lost). With identity headers this is a rate-limit bypass: a key with a stray "
        "\\xff forms no identity at the gateway but authenticates upstream as the clean key",
        lambda m: any(v != v.decode("utf-8", "ignore").encode() for _, v in m.headers),
        adjust=_valid_utf8_only,
    ),
    Difference(
        "non-utf8-expect-is-500",
        "refuses",
        "DEFECT: an Expect value that is not valid UTF-8 crashes aiohttp's default expect "
        "handler (UnicodeEncodeError building the 417): the client gets a plain-text 500, "
        "which SPEC 5 rules out",
        lambda m: any(not v.isascii() for v in m.values(b"expect")),
        frozenset({500}),
    ),
    Difference(
        "empty-query-dropped",
        "forwards",
        "minor: a target ending in an empty query ('/x?') goes out as '/x' (yarl drops the "
        "'?'); README promises the query string byte for byte",
        lambda m: b"?" in m.target,
        adjust=_empty_query_dropped,
    ),
)

WHOLE_BATCH_REJECTED = KNOWN_DIFFERENCES[-1]
ACTIVE_DIFFERENCES = KNOWN_DIFFERENCES + (AIOHTTP_PLANE_QUIRKS if AIOHTTP_DATA_PLANE else ())
USED: Counter[str] = Counter()
RUNS: Counter[str] = Counter()


# --- the comparison -------------------------------------------------------------------------


def end_to_end(m: Message, client: Message) -> list[Header]:
    """``m``'s headers (lower-case names, OWS-trimmed values) without hop-by-hop ones (incl.
    those the client's Connection names) and the gateway's own; without Content-Length when
    the client sent the body chunked (a proxy may de-chunk it)."""
    skip = set(HOP_BY_HOP | GATEWAY_OWNED)
    for value in client.values(b"connection"):
        skip.update(_ows(token).lower() for token in value.split(b","))
    if client.values(b"transfer-encoding"):
        skip.add(b"content-length")
    return [
        (n.lower(), _length(_ows(v)) if n.lower() == b"content-length" else _ows(v))
        for n, v in m.headers
        if n.lower() not in skip
    ]


def _length(value: bytes) -> bytes:
    """A Content-Length as its number: '005' and '5' are one length (RFC 9110 8.6), and
    the gateway writes the length it read, without leading zeros."""
    return str(int(value)).encode() if value.isdigit() else value


def compare_forwarded(up: Message, ref: Message, target: bytes, used: list[str]) -> list[str]:
    problems = []
    if up.method != ref.method:
        problems.append(f"method: upstream got {up.method!r}, reference parsed {ref.method!r}")
    want = Forwarded(target, tuple(end_to_end(ref, ref)))
    got = Forwarded(up.target, tuple(end_to_end(up, ref)))
    for row in ACTIVE_DIFFERENCES:  # only while they differ: a row is used when needed
        if want == got:
            break
        if row.kind == "forwards" and row.adjust is not None and row.applies(ref):
            adjusted = row.adjust(want, got)
            if adjusted != (want, got):
                want, got = adjusted
                used.append(row.key)
    if got.target != want.target:
        problems.append(
            f"target: upstream got {_short(got.target)}, expected {_short(want.target)}"
        )
    if got.headers != want.headers:
        problems.append(
            "end-to-end headers differ:\n"
            f"    upstream : {list(got.headers)!r}\n    reference: {list(want.headers)!r}"
        )
    if up.body != ref.body:
        problems.append(f"body: upstream got {_short(up.body)}, reference {_short(ref.body)}")
    return problems


def compare(
    gw: Exchange, ref: Exchange, forwarded_target: bytes | None
) -> tuple[list[str], list[str]]:
    """Problems (empty: the two agree, allowing for the table) and the table rows used."""
    problems: list[str] = []
    used: list[str] = []
    g, r = _answered(gw.verdicts()), _answered(ref.verdicts())
    for side, ex, verdicts in (("gateway", gw, g), ("reference", ref, r)):
        accepted = sum(kind == "A" for kind, _ in verdicts)
        if len(ex.reached) != accepted:
            problems.append(
                f"{side}: {len(ex.reached)} request(s) reached the server behind it but the "
                f"client saw {accepted} 2xx answer(s) (a desync)"
            )
    if gw.upstream_errors:
        problems.append(f"the upstream could not parse what the gateway sent: {gw.upstream_errors}")
    if problems:
        return problems, used
    pairs: list[tuple[Message, Message]] = []
    gi = ri = 0  # next accepted message on each side
    refused = False
    for i in range(max(len(g), len(r))):
        if i >= len(g) and refused:
            break  # the gateway closed the connection after refusing: the rest is moot
        if i >= len(g) or i >= len(r):
            problems.append(f"verdicts differ: gateway {_v(g)}, reference {_v(r)}")
            break
        (gk, gs), (rk, rs) = g[i], r[i]
        if gk == rk:
            if gk == "A":
                pairs.append((gw.reached[gi], ref.reached[ri]))
                gi, ri = gi + 1, ri + 1
            continue
        row = None
        if gk in ("R", "E") and rk == "A":
            message = ref.reached[ri]
            ri += 1
            row = _first(message, "refuses", gs)
        elif gk == "A" and rk == "R":
            message = gw.reached[gi]
            gi += 1
            row = _first(message, "accepts", gs)
        if row is None:
            problems.append(
                f"verdicts differ at request {i + 1}: gateway {gk}{gs or ''}, reference "
                f"{rk}{rs or ''} (all: gateway {_v(g)}, reference {_v(r)}); no row of "
                "KNOWN_DIFFERENCES explains it"
            )
            break
        used.append(row.key)
        refused = refused or gk != "A"
    for n, (up, rm) in enumerate(pairs):
        target = forwarded_target if forwarded_target is not None and n == 0 else rm.target
        for problem in compare_forwarded(up, rm, target, used):
            problems.append(f"request {n + 1} forwarded differently: {problem}")
    return problems, used


def _answered(verdicts: list[tuple[str, int | None]]) -> list[tuple[str, int | None]]:
    """A timeout after at least one answer is a connection kept open, idle: whether a server
    keeps it (keep-alive) or closes it after answering is its own business."""
    if len(verdicts) > 1 and verdicts[-1][0] == "H":
        return verdicts[:-1]
    return verdicts


def _first(message: Message, kind: str, status: int | None) -> Difference | None:
    for row in ACTIVE_DIFFERENCES:
        if row.kind != kind or not row.applies(message):
            continue
        if kind == "refuses" and status not in row.statuses:
            continue
        return row
    return None


def _v(verdicts: list[tuple[str, int | None]]) -> str:
    return " ".join(f"{k}{s or ''}" for k, s in verdicts)


# --- the two servers ------------------------------------------------------------------------


class Reference:
    """A bare aiohttp low-level server: records what aiohttp parsed, answers 200."""

    def __init__(self) -> None:
        self.reached: list[Message] = []
        self.port = 0

    async def handle(self, request: web.BaseRequest) -> web.Response:
        body = await request.read()
        self.reached.append(
            Message(
                method=request.method.encode(),
                target=request.raw_path.encode("utf-8", "surrogateescape"),
                headers=tuple(request.raw_headers),
                body=body,
                version=b"%d.%d" % request.version,
            )
        )
        return web.Response(text="reference-ok\n")

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Reference]:
        # auto_decompress off: like the gateway, the reference keeps bodies as they were sent.
        server = web.Server(self.handle, auto_decompress=False)
        runner = web.ServerRunner(server, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = runner.addresses[0][1]
        try:
            yield self
        finally:
            await runner.cleanup()


def _from_upstream(r: ReceivedRequest) -> Message:
    return Message(r.method, r.target, tuple(r.headers), r.body, r.version.encode())


@dataclass
class Harness:
    gateway_port: int
    upstream: RawUpstream
    reference: Reference

    async def run(self, data: bytes, timeout: float) -> tuple[Exchange, Exchange]:
        self.upstream.recording.clear()
        self.reference.reached.clear()
        (gw_reply, gw_end), (ref_reply, ref_end) = await asyncio.gather(
            exchange(self.gateway_port, data, timeout),
            exchange(self.reference.port, data, timeout),
        )
        await asyncio.sleep(0.005)  # anything forwarded late would still be caught
        recording = self.upstream.recording
        methods = request_methods(data)
        gateway = Exchange(
            final_statuses(gw_reply, methods),
            gw_end,
            [_from_upstream(r) for r in recording.requests],
            gw_reply,
            [f"{f.error} in {_short(f.raw)}" for f in recording.failures],
        )
        reference = Exchange(
            final_statuses(ref_reply, methods), ref_end, list(self.reference.reached), ref_reply
        )
        return gateway, reference

    async def check(
        self, name: str, data: bytes, timeout: float, forwarded_target: bytes | None = None
    ) -> None:
        gateway, reference = await self.run(data, timeout)
        problems, used = compare(gateway, reference, forwarded_target)
        if problems:
            explained = await self.whole_batch_rejected(data, gateway, forwarded_target)
            if explained is not None:
                problems, used = explained
        USED.update(used)
        if problems:
            pytest.fail(
                f"{name}: the gateway and aiohttp's server disagree\n"
                f"request bytes: {_short(data, 700)}\n"
                + "\n".join(f"- {p}" for p in problems)
                + f"\ngateway  : {gateway.describe()}\nreference: {reference.describe()}",
                pytrace=False,
            )

    async def whole_batch_rejected(
        self, data: bytes, gateway: Exchange, forwarded_target: bytes | None
    ) -> tuple[list[str], list[str]] | None:
        """The ``whole-batch-rejected`` row: the gateway answered the first k requests and
        refused (or ignored) the rest, where aiohttp refused everything. Explained only if
        aiohttp, given just the bytes of those k requests (as llhttp delimits them), accepts
        exactly them; then they must have been forwarded as aiohttp parses them."""
        verdicts = [kind for kind, _ in _answered(gateway.verdicts())]
        k = 0
        while k < len(verdicts) and verdicts[k] == "A":
            k += 1
        if k == 0 or set(verdicts[k:]) - {"R"} or len(gateway.reached) != k:
            return None
        ends = request_ends(data)
        if len(ends) < k or ends[k - 1] >= len(data):
            return None  # those bytes are all there is: aiohttp refused them, full stop
        prefix = data[: ends[k - 1]]
        self.reference.reached.clear()
        reply, ended = await exchange(self.reference.port, prefix, PREFIX_TIMEOUT, answers=k)
        alone = Exchange(
            final_statuses(reply, request_methods(prefix)),
            ended,
            list(self.reference.reached),
            reply,
        )
        if [kind for kind, _ in alone.verdicts()][:k] != ["A"] * k or len(alone.reached) != k:
            return None
        used = [WHOLE_BATCH_REJECTED.key]
        problems = []
        for n in range(k):
            target = forwarded_target if forwarded_target is not None and n == 0 else None
            ref = alone.reached[n]
            for problem in compare_forwarded(gateway.reached[n], ref, target or ref.target, used):
                problems.append(f"request {n + 1} forwarded differently: {problem}")
        return problems, used


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def harness(tmp_path_factory) -> AsyncIterator[Harness]:
    rules = tmp_path_factory.mktemp("edge-rules") / "edge.yaml"
    rules.write_text(RULES)
    async with (
        running_raw_upstream() as upstream,
        running_gateway(upstream.url, rules=[str(rules)], max_body_bytes=MAX_BODY_BYTES) as gw,
        Reference().running() as reference,
    ):
        yield Harness(int(gw.url.rsplit(":", 1)[1]), upstream, reference)


# --- the tests ------------------------------------------------------------------------------


def test_corpus_size() -> None:
    print(
        f"\nedge differential corpus: {NAMED_CASES} named cases + {HYPOTHESIS_EXAMPLES} "
        f"hypothesis examples = {CORPUS_SIZE} requests "
        f"({'aiohttp' if AIOHTTP_DATA_PLANE else 'new'} data plane under test)"
    )
    assert NAMED_CASES >= 80


@ON_MODULE_LOOP
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_named_case(harness: Harness, case: Case) -> None:
    RUNS["named"] += 1
    await harness.check(case.name, case.data, case.timeout or READ_TIMEOUT, case.forwarded_target)


# Hypothesis: mutations of a valid request. Each example starts valid and mutates some of
# its header names, header values and framing (each about one time in three): names and
# values from legal and illegal bytes; every combination of Content-Length and
# Transfer-Encoding spellings; random chunk sizes (some off by one or misspelled),
# extensions, trailers and bodies. Content-Length values never exceed the bytes sent and
# chunk sizes are off by at most one, so no request leaves a server waiting for bytes that
# never come (that would only cost the timeout).

TCHAR = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
NAME_ILLEGAL = b' \t\x00\x01\x7f\x80\xff()<>@,;\\"/[]?={}'
VALUE_LEGAL = bytes(range(0x20, 0x7F)) + b"\t" + bytes(range(0x80, 0x100))  # VCHAR SP HTAB obs-text
VALUE_ILLEGAL = b"\x00\x01\x08\x0b\x0c\x1b\x1f\x7f\r\n"
KNOWN_NAMES = (
    b"Accept", b"Cookie", b"X-Api-Key", b"x-user-id", b"Content-Type", b"Content-Encoding",
    b"Expect", b"TE", b"Trailer", b"Keep-Alive", b"Connection", b"Via", b"X-Forwarded-For",
    b"Forwarded", b"X-Request-Id", b"Proxy-Authorization", b"Authorization", b"User-Agent",
    b"Range", b"Cache-Control", b"Host", b"X-Custom",
)  # fmt: skip
PATHS = (b"/edge/gen", b"/edge/a/b", b"/edge/x.json", b"/edge/~u/-_.", b"/edge/a!$'()*+,=:@")
QUERY_PARTS = (b"a=1", b"b=%20", b"c=%zz", b"d=%E2%9C%93", b"e=", b"f=a+b", b"g=%2F", b"h=/?")
VALID_TE = (b"chunked", b"Chunked", b"gzip, chunked", b" chunked ")
ODD_TE = (
    b"CHUNKED", b"chunked, gzip", b"identity", b"gzip", b"xchunked", b"chunked,",
    b"deflate,chunked", b"chunked;q=1", b"identity, chunked", b"chunked chunked", b"",
)  # fmt: skip


def _bytes_from(alphabet: bytes, min_size: int, max_size: int) -> st.SearchStrategy[bytes]:
    return st.lists(st.sampled_from(alphabet), min_size=min_size, max_size=max_size).map(bytes)


one_in_three = st.integers(0, 2).map(lambda n: n == 0)
legal_names = st.one_of(st.sampled_from(KNOWN_NAMES), _bytes_from(TCHAR, 1, 12))
mutated_names = _bytes_from(TCHAR + NAME_ILLEGAL, 1, 12)
legal_values = st.one_of(_bytes_from(b"abcXYZ019 -_.,;=/", 0, 24), _bytes_from(VALUE_LEGAL, 0, 24))
mutated_values = _bytes_from(VALUE_LEGAL + VALUE_ILLEGAL, 1, 24)


def content_lengths(n: int, mutate: bool) -> st.SearchStrategy[bytes]:
    if not mutate:
        return st.sampled_from([b"%d" % n, b"00%d" % n, b" %d " % n])
    spellings = [b"+%d" % n, b"-%d" % n, b"0x%x" % n, b"%d, %d" % (n, n), b"%d 1" % n, b"",
                 b"0", b"%d" % n, b"1e1", b"%d\x0b" % n]  # fmt: skip
    if n:
        spellings.append(b"%d" % (n - 1))  # the rest of the body becomes the next request
    return st.sampled_from(spellings)


@st.composite
def chunked_bodies(draw: st.DrawFn, payload: bytes, mutate: bool) -> bytes:
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)], strict=True)]
    out = bytearray()
    spellings = [b"%x", b"%X", b"000%x", b"%x;ext=1", b'%x;a="q";b']
    for piece in (p for p in pieces if p):
        size = draw(st.sampled_from(spellings)) % len(piece)
        if mutate:
            n = len(piece)
            wrong = [b"%x" % (n + 1), b"%x" % (n - 1), b"zz", b"-1", b"0x%x" % n, b"%x " % n,
                     b" %x" % n, b"%x ;a" % n]  # fmt: skip
            size = draw(st.sampled_from([size, *wrong]))
        end = b"\r\n"
        if mutate:  # a bare LF or nothing after the chunk data, now and then
            end = draw(st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b""]))
        out += size + b"\r\n" + piece + end
    out += draw(st.sampled_from([b"0\r\n", b"0;end\r\n", b"00\r\n"]))
    out += draw(st.sampled_from([b"", b"X-Trailer: t\r\n", b"X-T: a\r\nX-U: b\r\n"]))
    return bytes(out + b"\r\n")


@st.composite
def generated_requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from([b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS"]))
    target = draw(st.sampled_from(PATHS))
    query = draw(st.lists(st.sampled_from(QUERY_PARTS), max_size=3))
    if query:
        target += b"?" + b"&".join(query)
    mutate_names, mutate_values, mutate_framing = (draw(one_in_three) for _ in range(3))
    names = st.one_of(legal_names, mutated_names) if mutate_names else legal_names
    values = st.one_of(legal_values, mutated_values) if mutate_values else legal_values
    headers = [b"Accept: */*"]
    headers += [n + b": " + v for n, v in draw(st.lists(st.tuples(names, values), max_size=5))]
    payload = draw(st.binary(max_size=64))
    framings = ["length", "chunked", "none"]
    if mutate_framing:
        framings += ["chunked+length", "chunk-syntax-as-length", "odd-coding"]
    framing = draw(st.sampled_from(framings))
    body = b""
    if framing == "length":
        body = payload
        count = 2 if mutate_framing and draw(st.booleans()) else 1
        for _ in range(count):
            headers.append(b"Content-Length: " + draw(content_lengths(len(body), mutate_framing)))
    elif framing in ("chunked", "chunked+length", "odd-coding"):
        body = draw(chunked_bodies(payload, mutate_framing))
        coding = st.sampled_from(VALID_TE if framing == "chunked" else VALID_TE + ODD_TE)
        for value in draw(st.lists(coding, min_size=1, max_size=2 if mutate_framing else 1)):
            headers.append(b"Transfer-Encoding: " + value)
        if framing == "chunked+length":
            headers.append(b"Content-Length: " + draw(content_lengths(len(body), True)))
    elif framing == "chunk-syntax-as-length":  # chunk syntax in a Content-Length body: bytes
        body = draw(chunked_bodies(payload, False))
        headers.append(b"Content-Length: %d" % len(body))
    headers = draw(st.permutations([b"Host: edge.test", *headers]))
    start = method + b" " + target + b" HTTP/1.1"
    lines = [start, *headers, b"Connection: close"]
    return b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


@ON_MODULE_LOOP
@settings(
    max_examples=HYPOTHESIS_EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(data=generated_requests())
async def test_generated_variants(harness: Harness, data: bytes) -> None:
    RUNS["generated"] += 1
    await harness.check("generated", data, GENERATED_TIMEOUT)


def test_report_differences_used() -> None:
    """Which rows of the table the run needed (``pytest -s`` shows them)."""
    print(f"\nrequests compared: {dict(RUNS)}")
    for row in ACTIVE_DIFFERENCES:
        print(f"  {USED[row.key]:4d}  {row.key}")
