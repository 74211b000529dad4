"""An upstream connection answers a read that repeats its last whole response's head
(same bytes, same length) without running llhttp (``UpstreamConnection._answer_kept``).

Differential: a connection reused exchange after exchange, as the pool reuses it, must
tell each client exactly what a connection that never keeps a response tells it (the
same bytes, the same end, the same reusability), whatever the upstream sends: heads
repeated with other bodies, other lengths, chunked bodies, 1xx heads first, empty lines
first, bytes after the response, split reads, answers to HEAD and to upgrades, heads
that close the connection."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics import Metrics
from gateway.proxy import relay as relay_module
from gateway.proxy.batched_writes import BatchedTransport, WriteBatch
from gateway.proxy.relay import Relay
from gateway.proxy.request import Incoming
from gateway.proxy.upstream_pool import Upstream, UpstreamConnection, UpstreamPool


class _Client:
    """A client connection that records what its relay tells it (``fail``: the name of
    one of its methods that raises instead, as a broken client side would)."""

    def __init__(self, fail: str = "") -> None:
        self.events: list[tuple[str, object]] = []
        self.fail = fail

    def write(self, data: bytes) -> None:
        self.events.append(("write", data))

    def forward_done(self, relay: Relay, outcome: int) -> None:
        self.events.append(("done", outcome))

    def forward_failed(self, relay: Relay, exc: BaseException) -> None:
        self.events.append(("failed", type(exc).__name__))

    def keep_alive_after(self, req: Incoming) -> bool:
        if self.fail == "keep_alive_after":  # (asked before the response is under way)
            raise asyncio.CancelledError
        return True

    def __getattr__(self, name: str) -> Any:  # the rest of ClientSide: recorded by name
        def call(*args: Any, **kwargs: Any) -> None:
            self.events.append((name, tuple(a for a in args if not isinstance(a, Relay))))
            if name == self.fail:
                raise RuntimeError(name)

        return call


class _Transport:
    def __init__(self) -> None:
        self.aborted = False

    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted


class _Reused:
    """One UpstreamConnection carrying exchange after exchange; ``keeps``: False clears
    what it kept before each read (every read then goes through llhttp)."""

    def __init__(self, keeps: bool) -> None:
        self.keeps = keeps
        self.conn = UpstreamConnection(UpstreamPool(4, 1.0), ("h", 1, False))
        self.transport = _Transport()
        self.fed = 0  # reads llhttp was given
        self._counting: object = None

    def _count_feeds(self) -> None:
        """Count what the parser is fed (again after a HEAD, 204 or 304 answer, after
        which the connection binds a new parser's method)."""
        if self.conn._feed_parser is self._counting:
            return
        feed = self.conn._feed_parser

        def counting(data: bytes) -> None:
            self.fed += 1
            feed(data)

        self._counting = self.conn._feed_parser = counting

    def exchange(
        self, reads: list[bytes], method: str, upgrade: bool, fail: str = ""
    ) -> list[tuple[str, object]]:
        conn = self.conn
        if not conn.reusable or self.transport.aborted or conn.sink is not None:
            return [("not reused", None)]  # as the pool would have it: a new connection
        req = Incoming()
        req.request_id = "rid"
        req.method = method
        req.head_only = method == "HEAD"
        client = _Client(fail)
        relay = Relay(client, req, Upstream("u", "http://127.0.0.1:9"), Metrics())
        loop = asyncio.new_event_loop()  # (the batch's; nothing here is held: no write)
        try:
            conn.transport = BatchedTransport(cast(Any, self.transport), WriteBatch(loop))
            conn.upgrade_asked = upgrade
            conn.start(relay, b"", req.head_only)
            for read in reads:
                if not self.keeps:
                    conn._kept = None
                if conn.sink is None:
                    break  # ended: the pool gets it back (or the next bytes abort it)
                self._count_feeds()
                conn.data_received(read)
        finally:
            loop.close()
        # (the gateway's own Date line, added when the upstream sent none, may tick)
        events = [
            (kind, b"".join(x for x in value.split(b"\r\n") if not x.startswith(b"Date: ")))
            if kind == "write" and isinstance(value, bytes)
            else (kind, value)
            for kind, value in client.events
        ]
        return [*events, ("reusable", conn.reusable), ("aborted", self.transport.aborted)]


_STATUS = st.sampled_from(
    [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 Fine", b"HTTP/1.1 404 Not Found", b"HTTP/1.0 200 OK",
     b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 101 Switching"]
)  # fmt: skip
_FIELDS = st.sampled_from(
    [(b"Server", b"nginx"), (b"Date", b"Mon, 23 Nov 2026 15:00:00 GMT"),
     (b"Connection", b"keep-alive"), (b"Connection", b"close"), (b"Connection", b"upgrade"),
     (b"Upgrade", b"websocket"), (b"Keep-Alive", b"timeout=5"), (b"X-Kept", b"a"),
     (b"Via", b"1.0 cache"), (b"RateLimit", b"upstream")]
)  # fmt: skip


_CLEAN_STATUS = st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found"])
_CLEAN_FIELDS = st.sampled_from(
    [(b"Server", b"nginx"), (b"Date", b"Mon, 23 Nov 2026 15:00:00 GMT"), (b"X-Kept", b"a")]
)


@st.composite
def _response(draw: Any) -> bytes:
    """One upstream response, or something like one: one in four anything of the
    above, the others a keep-alive response framed by its length (which is kept)."""
    if draw(st.integers(0, 3)) > 0:
        fields = draw(st.lists(_CLEAN_FIELDS, max_size=3))
        body = draw(st.sampled_from([b"", b"ok", b"no", b"hello"]))
        lines = [draw(_CLEAN_STATUS), *(n + b": " + v for n, v in fields)]
        lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body
    lines = [draw(_STATUS)]
    lines += [name + b": " + value for name, value in draw(st.lists(_FIELDS, max_size=4))]
    body = draw(st.sampled_from([b"", b"ok", b"no", b"hello", b"x" * 40]))
    framing = draw(st.sampled_from(["length", "length", "chunked", "none", "short", "long"]))
    if framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing != "none":
        declared = len(body) + {"length": 0, "short": -1, "long": 1}[framing]
        lines.append(b"Content-Length: %d" % max(declared, 0))
    lead = draw(st.sampled_from([b"", b"", b"", b"\r\n", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    tail = draw(
        st.sampled_from([b"", b"", b"", b"junk", b"HTTP/1.1 200 OK\r\n\r\n", b"\r\n", b"\n", b"\r"])
    )
    return lead + b"\r\n".join(lines) + b"\r\n\r\n" + body + tail


@st.composite
def _exchanges(draw: Any) -> list[tuple[list[bytes], str, bool]]:
    """Exchanges on one connection: the same response again (the common case), others
    of the same head with other bodies, and any other response; each in one read or
    split in two."""
    first = draw(_response())
    out = []
    for _ in range(draw(st.integers(1, 8))):
        kind = draw(st.sampled_from(["same", "same", "same", "body", "other"]))
        raw = first
        if kind == "body" and b"\r\n\r\n" in first:  # the same head, another body
            end = first.index(b"\r\n\r\n") + 4
            raw = first[:end] + bytes(reversed(first[end:]))
        elif kind == "other":
            raw = draw(_response())
        split = draw(st.integers(0, len(raw))) if draw(st.integers(0, 3)) == 0 else 0
        reads = [raw[:split], raw[split:]] if 0 < split < len(raw) else [raw]
        method = draw(st.sampled_from(["GET"] * 7 + ["HEAD"]))
        out.append((reads, method, draw(st.sampled_from([False] * 7 + [True]))))
    return out


@settings(max_examples=400, deadline=None)
@given(exchanges=_exchanges())
def test_a_kept_response_reaches_the_client_as_llhttp_parses_it(
    exchanges: list[tuple[list[bytes], str, bool]],
) -> None:
    kept, plain = _Reused(keeps=True), _Reused(keeps=False)
    for reads, method, upgrade in exchanges:
        relay_module._LAST_HEAD.passed = None
        got = kept.exchange(reads, method, upgrade)
        relay_module._LAST_HEAD.passed = None
        want = plain.exchange(reads, method, upgrade)
        assert got == want, (reads, method, upgrade)
        if got[0][0] == "not reused":
            break
    assert plain.fed >= 1  # (at least the first exchange ran)


def test_the_same_response_again_is_answered_without_the_parser() -> None:
    """The fast path is taken (the property above holds for it only if it runs): the
    second and later identical responses on a connection feed llhttp nothing."""
    raw = b"HTTP/1.1 200 OK\r\nServer: s\r\nContent-Length: 2\r\n\r\nok"
    kept, plain = _Reused(keeps=True), _Reused(keeps=False)
    for _ in range(3):
        assert kept.exchange([raw], "GET", False) == plain.exchange([raw], "GET", False)
    assert kept.fed == 1 and plain.fed == 3
    other_body = raw[:-2] + b"no"  # the same head: answered from it
    got = kept.exchange([other_body], "GET", False)
    assert got == plain.exchange([other_body], "GET", False) and kept.fed == 1
    assert ("write", b"HTTP/1.1 200 OKServer: sVia: 1.1 ratelimit-gatewayX-Request-Id: rid"
            b"Content-Length: 2no") in got  # fmt: skip


def test_a_head_kept_from_one_response_never_frames_another() -> None:
    """Review-style cases: a read that starts with the kept head but is longer (a second
    response after it) or is an answer to HEAD goes through llhttp, as do chunked and
    1xx-led responses, which are never kept."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    cases = [
        ([raw], "GET"),
        ([raw + b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"], "GET"),  # smuggled second
        ([raw], "GET"),
        ([raw], "HEAD"),  # a body after a HEAD answer: stray, never reused
    ]
    kept, plain = _Reused(keeps=True), _Reused(keeps=False)
    for reads, method in cases:
        assert kept.exchange(reads, method, False) == plain.exchange(reads, method, False)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    continued = b"HTTP/1.1 100 Continue\r\n\r\n" + raw
    for raw_other in (chunked, continued):
        conn = _Reused(keeps=True)
        conn.exchange([raw_other], "GET", False)
        assert conn.conn._kept is None


def test_a_client_side_that_fails_breaks_the_exchange_as_it_does_under_llhttp() -> None:
    """A callback that raises (here the client side's, called by the relay) ends the
    exchange the same way on both paths: the relay told the upstream broke (by the same
    error: a cancellation too, before the response is under way), the connection
    aborted and never reused."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    for fail in ("forward_head", "response_progress", "keep_alive_after"):
        kept, plain = _Reused(keeps=True), _Reused(keeps=False)
        assert kept.exchange([raw], "GET", False) == plain.exchange([raw], "GET", False)
        got = kept.exchange([raw], "GET", False, fail)
        assert got == plain.exchange([raw], "GET", False, fail)
        assert kept.fed == 1 and plain.fed == 2  # (the kept answer was the one that failed)
        assert ("aborted", True) in got and ("reusable", False) in got


def test_a_body_to_head_after_a_kept_head_is_stray_as_ever() -> None:
    """Review finding: without the HEAD check, a kept head's length framed the body an
    upstream sent after all in answer to HEAD, and the client got it."""
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 002\r\n\r\nok"
    kept, plain = _Reused(keeps=True), _Reused(keeps=False)
    assert kept.exchange([raw], "GET", False) == plain.exchange([raw], "GET", False)
    got = kept.exchange([raw], "HEAD", False)
    assert got == plain.exchange([raw], "HEAD", False)
    written = b"".join(cast(bytes, value) for kind, value in got if kind == "write")
    assert written.endswith(b"Content-Length: 002") and ("reusable", False) in got


def test_what_a_connection_keeps_is_bounded() -> None:
    """Review finding: the head's 8 KiB held ~1,600 empty fields as Python objects. A
    head of more than MAX_KEPT_RESPONSE_FIELDS fields, or longer than
    MAX_KEPT_RESPONSE_HEAD, is parsed each time and never kept."""
    from gateway.proxy.upstream_pool import MAX_KEPT_RESPONSE_FIELDS, MAX_KEPT_RESPONSE_HEAD

    def response(fields: int, pad: int = 0) -> bytes:
        lines = [b"HTTP/1.1 200 OK", *(b"a%d:" % i for i in range(fields - 1))]
        lines.append(b"Content-Length: 2")
        return b"\r\n".join(lines) + b"\r\n" + b"X: " + b"x" * pad + b"\r\n\r\nok"

    for raw, kept in [
        (response(MAX_KEPT_RESPONSE_FIELDS - 1), True),
        (response(MAX_KEPT_RESPONSE_FIELDS), False),
        (response(2, MAX_KEPT_RESPONSE_HEAD - 60), True),
        (response(2, MAX_KEPT_RESPONSE_HEAD), False),
    ]:
        conn, plain = _Reused(keeps=True), _Reused(keeps=False)
        for _ in range(2):
            assert conn.exchange([raw], "GET", False) == plain.exchange([raw], "GET", False)
        assert (conn.conn._kept is not None) is kept and conn.fed == (1 if kept else 2)
