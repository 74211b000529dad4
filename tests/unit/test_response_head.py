"""The response head the data plane writes to the client (``Relay.response_head``): which
upstream fields pass, which are replaced, which are dropped, whatever their spelling."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics import Metrics
from gateway.proxy import relay as relay_module
from gateway.proxy.batched_writes import BatchedTransport, WriteBatch
from gateway.proxy.relay import Relay
from gateway.proxy.request import Incoming
from gateway.proxy.upstream_pool import Upstream

RATE = b'RateLimit-Policy: "r";q=10;w=60\r\nRateLimit: "r";r=9;t=60\r\n'


class Client:
    """The two things a Relay asks of its client connection here."""

    def keep_alive_after(self, req: Incoming) -> bool:
        return True

    def forward_head(self, relay: Relay) -> None:
        pass


def head(
    headers: list[tuple[bytes, bytes]], rate: bytes = RATE, status: int = 200, legacy: bool = False
) -> list[str]:
    req = Incoming()
    req.rate_lines = rate
    req.legacy_rate = legacy
    req.request_id = "rid-1"
    upstream = Upstream("default", "http://127.0.0.1:9")
    relay = Relay(Client(), req, upstream, Metrics())
    relay.response_head(status, b"OK", headers, True)
    text = b"".join(relay.out).decode()
    assert text.endswith("\r\n\r\n")
    return text.split("\r\n")[:-2]


def names(lines: list[str]) -> list[str]:
    return [line.split(":", 1)[0].lower() for line in lines[1:]]


@pytest.mark.parametrize("spelling", [str.title, str.lower, str.upper])
def test_fields_are_kept_replaced_or_dropped_whatever_their_spelling(spelling: Any) -> None:
    def h(name: str, value: str) -> tuple[bytes, bytes]:
        return spelling(name).encode(), value.encode()

    lines = head([
        h("server", "up"), h("date", "Mon, 23 Nov 2026 15:00:00 GMT"),
        h("content-length", "5"), h("connection", "keep-alive, x-hop"), h("x-hop", "1"),
        h("keep-alive", "timeout=5"), h("x-request-id", "upstream-id"),
        h("ratelimit", "forged"), h("ratelimit-policy", "forged"), h("via", "1.0 cache"),
        h("x-kept", "yes"),
    ])  # fmt: skip
    assert lines[0] == "HTTP/1.1 200 OK"
    got = names(lines)
    assert got.count("date") == 1 and "server" in got and "x-kept" in got
    assert "x-hop" not in got and "keep-alive" not in got and "connection" not in got
    assert ("X-Request-Id: rid-1" in lines) and got.count("x-request-id") == 1
    assert "forged" not in "".join(lines)
    assert got.count("ratelimit") == 1 and got.count("ratelimit-policy") == 1
    assert "Via: 1.0 cache, 1.1 ratelimit-gateway" in lines
    assert "Content-Length: 5" in lines


def test_upstream_rate_fields_pass_when_the_gateway_has_none() -> None:
    lines = head([(b"RateLimit", b"upstream's"), (b"Content-Length", b"0")], rate=b"")
    assert "RateLimit: upstream's" in lines


def test_a_chunked_upstream_body_is_framed_again_and_a_date_added() -> None:
    lines = head([(b"Transfer-Encoding", b"chunked")])
    got = names(lines)
    assert "Transfer-Encoding: chunked" in lines and got.count("transfer-encoding") == 1
    assert "date" in got and "content-length" not in got


# Fields an upstream may send, special ones included, in a few spellings and values.
_FIELDS = st.sampled_from([
    (b"Server", b"nginx"), (b"Date", b"Mon, 23 Nov 2026 15:00:00 GMT"),
    (b"Date", b"Mon, 23 Nov 2026 15:00:01 GMT"), (b"Content-Length", b"5"),
    (b"content-length", b"7"), (b"Connection", b"keep-alive"), (b"Connection", b"x-hop"),
    (b"X-Hop", b"1"), (b"Keep-Alive", b"timeout=5"), (b"Transfer-Encoding", b"chunked"),
    (b"Via", b"1.0 cache"), (b"RateLimit", b"upstream"), (b"X-RateLimit-Limit", b"9"),
    (b"X-Request-Id", b"upstream-id"), (b"X-Kept", b"a"), (b"X-Kept", b"b"),
])  # fmt: skip
_HEADS = st.lists(
    st.tuples(st.lists(_FIELDS, max_size=8), st.booleans(), st.booleans()), min_size=1, max_size=6
)


def _stable(lines: list[str]) -> list[str]:
    # (the gateway's own Date line, when the upstream sent none, may tick between calls)
    return [x for x in lines if not x.startswith("Date: ") or "2026 15:00:0" in x]


@settings(max_examples=300, deadline=None)
@given(heads=_HEADS, repeat=st.booleans())
def test_a_head_equal_to_the_last_one_is_written_as_a_fresh_pass_writes_it(heads, repeat):
    """The pass over the fields is kept for the next head with equal fields (the same
    flags): every head is written exactly as a fresh pass writes it, whatever came before."""
    if repeat:  # the common case under load: the same head again and again
        heads = [heads[0]] * 3 + heads
    for fields, rate, legacy in heads:
        rate_lines = RATE if rate else b""
        got = head(list(fields), rate=rate_lines, legacy=legacy)
        relay_module._LAST_HEAD.passed = None
        fresh = head(list(fields), rate=rate_lines, legacy=legacy)
        assert _stable(got) == _stable(fresh), fields


class _Client(Client):
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def set_paused(self, reason: str, paused: bool) -> None:
        pass

    def response_progress(self) -> None:
        pass

    def body_sink_ready(self) -> None:
        pass

    def relay_done(self, *args: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # the rest of ClientSide: nothing to do here
        return lambda *args, **kwargs: None


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False


def _exchange(raw: bytes, method: str = "GET") -> bytes:
    """What the client gets for an upstream answering ``raw`` in one read, through a real
    UpstreamConnection (its llhttp parser) and Relay."""
    from gateway.proxy.upstream_pool import UpstreamConnection, UpstreamPool

    req = Incoming()
    req.request_id = "rid"
    req.method = method
    req.head_only = method == "HEAD"
    client = _Client()
    relay = Relay(client, req, Upstream("u", "http://127.0.0.1:9"), Metrics())
    # (a real pool: compiled code checks the type)
    conn = UpstreamConnection(UpstreamPool(4, 1.0), ("h", 1, False))
    loop = asyncio.new_event_loop()  # (the batch's; nothing here is held: no write)
    try:
        conn.transport = BatchedTransport(cast(Any, _Transport()), WriteBatch(loop))
        conn.start(relay, b"", req.head_only)
        conn.data_received(raw)
    finally:
        loop.close()
    return b"".join(client.written)


def test_what_an_upstream_sends_after_a_head_it_ended_changes_no_kept_head() -> None:
    """Review finding: after a HEAD answer's head, the parser went on through the read and
    appended what it found (a trailer) to the field list the last pass kept, so a later
    head equal to the changed list took a pass that was not its own."""
    start = b"HTTP/1.1 200 OK\r\nServer: s\r\nTransfer-Encoding: chunked\r\n"
    after_head = start + b"\r\n0\r\nX-Secret: t\r\n\r\n"
    _exchange(after_head, "HEAD")
    later = start + b"X-Secret: t\r\n\r\n0\r\n\r\n"
    got = _exchange(later)
    relay_module._LAST_HEAD.passed = None
    fresh = _exchange(later)
    assert b"X-Secret: t" in fresh
    assert _stable(got.decode().split("\r\n")) == _stable(fresh.decode().split("\r\n"))


def test_a_date_named_hop_by_hop_is_replaced_by_the_gateways_own() -> None:
    # (review finding, older than the kept pass: the upstream's Date was dropped and none
    # written instead)
    lines = head([(b"Date", b"Mon, 23 Nov 2026 15:00:00 GMT"), (b"Connection", b"date"),
                  (b"Content-Length", b"0")])  # fmt: skip
    dates = [line for line in lines if line.lower().startswith("date:")]
    assert len(dates) == 1 and "15:00:00" not in dates[0]


# Raw heads as an upstream may send them: a few status lines, and fields spelled with
# and without the optional whitespace around their values (the same fields, other bytes).
_STATUS_LINES = st.sampled_from(
    [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 Fine", b"HTTP/1.1 404 Not Found", b"HTTP/1.0 200 OK"]
)
_SPACING = st.sampled_from([(b": ", b""), (b":", b""), (b":  ", b" "), (b":\t", b"\t")])


@st.composite
def _raw_responses(draw: Any) -> bytes:
    status = draw(_STATUS_LINES)
    fields = draw(st.lists(_FIELDS, max_size=8))
    lines = [status]
    chunked = False
    for name, value in fields:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            continue  # (the body's framing is chosen below, once)
        before, after = draw(_SPACING)
        lines.append(name + before + value + after)
    if draw(st.booleans()):
        chunked = True
        lines.append(b"Transfer-Encoding: chunked")
    else:
        lines.append(b"Content-Length: 2")
    body = b"2\r\nok\r\n0\r\n\r\n" if chunked else b"ok"
    lead = draw(st.sampled_from([b"", b"", b"", b"\r\n", b"\r\n\r\n"]))  # llhttp skips these
    return lead + b"\r\n".join(lines) + b"\r\n\r\n" + body


@settings(max_examples=300, deadline=None)
@given(
    reads=st.lists(_raw_responses(), min_size=1, max_size=6),
    repeat=st.booleans(),
    method=st.sampled_from(["GET", "HEAD"]),
)
def test_a_head_whose_bytes_are_the_last_ones_is_written_as_a_fresh_pass_writes_it(
    reads: list[bytes], repeat: bool, method: str
) -> None:
    """Differential: through a real UpstreamConnection (llhttp) the kept pass is found by
    the head's bytes; whatever came before, each response reaches the client exactly as
    it does with nothing kept (heads of other bytes, equal fields or not, included)."""
    if repeat:  # the common case under load: the same response again and again
        reads = [reads[0]] * 3 + reads
    relay_module._LAST_HEAD.passed = None
    for raw in reads:
        got = _exchange(raw, method)
        kept = relay_module._LAST_HEAD.passed
        assert kept is not None
        if raw.startswith(b"HTTP/"):
            assert kept.head == raw[: raw.index(b"\r\n\r\n") + 4]
        elif kept.head is not None:  # (kept from an earlier read: not this one's bytes)
            assert not raw.startswith(kept.head)
        relay_module._LAST_HEAD.passed = None
        fresh = _exchange(raw, method)
        assert _stable(got.decode().split("\r\n")) == _stable(fresh.decode().split("\r\n"))
        relay_module._LAST_HEAD.passed = kept


def test_a_head_split_over_reads_is_matched_field_for_field() -> None:
    """A head that does not start a read whole is matched by its fields (its bytes are not
    kept), and the next read's whole head by its bytes again."""
    raw = b"HTTP/1.1 200 OK\r\nServer: s\r\nX-Kept: a\r\nContent-Length: 2\r\n\r\nok"
    relay_module._LAST_HEAD.passed = None
    first = _exchange(raw)
    kept = relay_module._LAST_HEAD.passed
    assert kept is not None and kept.head == raw[:-2]
    from gateway.proxy.upstream_pool import UpstreamConnection, UpstreamPool

    req = Incoming()
    req.request_id = "rid"
    client = _Client()
    relay = Relay(client, req, Upstream("u", "http://127.0.0.1:9"), Metrics())
    conn = UpstreamConnection(UpstreamPool(4, 1.0), ("h", 1, False))
    loop = asyncio.new_event_loop()
    try:
        conn.transport = BatchedTransport(cast(Any, _Transport()), WriteBatch(loop))
        conn.start(relay, b"", False)
        conn.data_received(raw[:20])
        conn.data_received(raw[20:])
    finally:
        loop.close()
    assert relay_module._LAST_HEAD.passed is kept  # the same fields: the kept pass
    assert _stable(b"".join(client.written).decode().split("\r\n")) == _stable(
        first.decode().split("\r\n")
    )


def test_empty_lines_before_a_head_are_never_kept_as_its_bytes() -> None:
    """Review finding: llhttp skips empty lines before a response; a head kept as its read
    up to the first blank line was then ``\\r\\n\\r\\n``, and every later response that
    started with empty lines took that pass: another response's Content-Length and
    fields, a client connection out of step."""
    first = b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\nSet-Cookie: a=1\r\n\r\nok"
    second = b"\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    relay_module._LAST_HEAD.passed = None
    _exchange(first)
    kept = relay_module._LAST_HEAD.passed
    assert kept is not None and kept.head is None
    got = _exchange(second).decode()
    assert "Content-Length: 5\r\n" in got and "Set-Cookie" not in got and got.endswith("hello")
