"""The request head the data plane sends upstream (``gateway.proxy.relay.request_head``):
the forwarding fields it writes, kept text or not."""

from __future__ import annotations

from gateway.proxy.relay import request_head
from gateway.proxy.request import Incoming
from gateway.proxy.upstream_pool import Upstream

UPSTREAM = Upstream("default", "http://127.0.0.1:9000")


def incoming(headers: list[tuple[bytes, bytes]], *, trusted: bool = False) -> Incoming:
    req = Incoming()
    req.method, req.path, req.request_id = "GET", "/a/b", "rid-1"
    req.trusted_peer = trusted
    for name, value in headers:
        req.headers.append((name, value))
        if name.lower() == b"x-forwarded-for":
            req.forwarded_for.append(value)
        elif name.lower() == b"x-forwarded-proto":
            req.forwarded_proto = value
    return req


def fields(head: bytes) -> list[tuple[str, str]]:
    lines = head.decode().split("\r\n")
    assert lines[-2:] == ["", ""]
    return [tuple(line.split(": ", 1)) for line in lines[1:-2]]  # type: ignore[misc]


def test_a_request_without_forwarding_fields_gets_the_peer_and_ours():
    for _ in range(2):  # the second time from the kept text
        head = request_head(incoming([(b"Host", b"gw")]), UPSTREAM, "/base", "h:1", "10.0.0.1")
        assert head.startswith(b"GET /base/a/b HTTP/1.1\r\n")
        assert fields(head) == [
            ("Host", "gw"),
            ("X-Forwarded-For", "10.0.0.1"),
            ("X-Forwarded-Proto", "http"),
            ("Via", "1.1 ratelimit-gateway"),
            ("X-Request-Id", "rid-1"),
        ]
    other = request_head(incoming([(b"Host", b"gw")]), UPSTREAM, "", "h:1", "10.0.0.2")
    assert other.startswith(b"GET /a/b HTTP/1.1\r\n")
    assert ("X-Forwarded-For", "10.0.0.2") in fields(other)


def test_the_query_follows_the_path_byte_for_byte():
    req = incoming([(b"Host", b"gw")])
    req.query = b"?q=%20x&y"
    assert request_head(req, UPSTREAM, "", "h:1", "10.0.0.1").startswith(
        b"GET /a/b?q=%20x&y HTTP/1.1\r\n"
    )


def test_a_trusted_proxy_chain_and_proto_are_carried_on():
    req = incoming(
        [(b"Host", b"gw"), (b"X-Forwarded-For", b"203.0.113.9"), (b"X-Forwarded-Proto", b"https")],
        trusted=True,
    )
    got = dict(fields(request_head(req, UPSTREAM, "", "h:1", "10.0.0.1")))
    assert got["X-Forwarded-For"] == "203.0.113.9, 10.0.0.1"
    assert got["X-Forwarded-Proto"] == "https"


def test_an_empty_forwarded_for_from_a_trusted_proxy_names_only_the_peer():
    req = incoming([(b"Host", b"gw"), (b"X-Forwarded-For", b"")], trusted=True)
    got = dict(fields(request_head(req, UPSTREAM, "", "h:1", "10.0.0.1")))
    assert got["X-Forwarded-For"] == "10.0.0.1"


def test_an_untrusted_peer_cannot_extend_the_chain_but_via_is_kept():
    req = incoming(
        [(b"Host", b"gw"), (b"X-Forwarded-For", b"6.6.6.6"), (b"X-Forwarded-Proto", b"https"),
         (b"Via", b"1.0 cache")],
    )  # fmt: skip
    got = fields(request_head(req, UPSTREAM, "", "h:1", "10.0.0.1"))
    assert ("X-Forwarded-For", "10.0.0.1") in got
    assert ("X-Forwarded-Proto", "http") in got
    assert ("Via", "1.0 cache, 1.1 ratelimit-gateway") in got
    assert not any(value in ("6.6.6.6", "https") for _, value in got)


def test_an_upstream_that_does_not_keep_the_host_gets_its_own():
    upstream = Upstream("store", "http://127.0.0.1:9001", preserve_host=False)
    got = fields(request_head(incoming([(b"Host", b"gw")]), upstream, "", "127.0.0.1:9001", "p"))
    assert got[0] == ("Host", "127.0.0.1:9001")
    assert ("Host", "gw") not in got


def test_an_upstream_names_itself_in_the_host_header_as_a_uri_host():
    # RFC 9110 section 7.2: uri-host [ ":" port ], an IPv6 address as an IP-literal.
    assert Upstream("a", "http://127.0.0.1:9001").host_header() == "127.0.0.1:9001"
    assert Upstream("a", "http://[::1]:9001/base").host_header() == "[::1]:9001"
    assert Upstream("a", "https://api.example").host_header() == "api.example:443"
    assert Upstream("a", "http://[fe80::1%25eth0]:9001").host_header() == "[fe80::1]:9001"
    upstream = Upstream("b", "http://[::1]:9001", preserve_host=False)
    head = request_head(incoming([(b"Host", b"gw")]), upstream, "", upstream.host_header(), "p")
    assert fields(head)[0] == ("Host", "[::1]:9001")
