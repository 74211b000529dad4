"""Content on any method but POST, PUT and PATCH never reaches a second request.

Servers that handle GET, HEAD, DELETE, OPTIONS (or PURGE, UNLOCK...) without reading a
body ("CL.0": Python's ``http.server``, many hand-written handlers) read the content, on
a kept-alive connection, as the next request. Through the gateway that was a request nobody counted
(a review reproduced six ``/runs/stats`` calls upstream where the rule allows one), and
when it was slow its answer went to the next client the pooled connection served (a
victim's request answered with the smuggled one's response).

Now such a request goes upstream with ``Connection: close`` and its upstream connection
is never used again. Checked against a real CL.0 server: the standard library's
``http.server`` with keep-alive, whose handlers never read a body."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.support.edge_corpus import chunks
from tests.support.gateway import running_gateway

# Every method but POST, PUT and PATCH (TRACE and CONNECT: refused with 405 before this)
METHODS = ["GET", "HEAD", "DELETE", "OPTIONS", "PURGE", "UNLOCK", "REPORT", "PROPFIND"]


class _Seen:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []  # (method, path, client port)


@contextmanager
def cl0_upstream() -> Iterator[tuple[str, _Seen]]:
    """A keep-alive HTTP/1.1 server that answers every method without reading any body
    (except POST, which it reads, as a server expecting content does)."""
    seen = _Seen()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

        def _answer(self) -> None:
            with seen.lock:
                seen.requests.append((self.command, self.path, self.client_address[1]))
            body = f"you asked for {self.command} {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_DELETE = do_OPTIONS = do_TRACE = _answer
        do_PURGE = do_UNLOCK = do_REPORT = do_PROPFIND = _answer

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _one(port: int, request: bytes) -> bytes:
    """One request on its own connection; its whole answer (the gateway keeps the
    connection: read until the response's length is met)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        head_only = request.startswith(b"HEAD ")
        body = b"" if head_only else await asyncio.wait_for(reader.readexactly(length), 10)
        return head + body
    finally:
        writer.close()


def _smuggling(method: str, framing: str, smuggled: bytes) -> bytes:
    target = f"/outer/{method.lower()}".encode()
    if framing == "chunked":
        return (
            method.encode() + b" " + target + b" HTTP/1.1\r\nHost: a\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n" + chunks(smuggled)
        )
    return (
        method.encode() + b" " + target + b" HTTP/1.1\r\nHost: a\r\n"
        b"Content-Length: %d\r\n\r\n" % len(smuggled) + smuggled
    )


@pytest.mark.parametrize("framing", ["length", "chunked"])
@pytest.mark.parametrize("method", METHODS)
async def test_content_on_a_bodiless_method_is_never_run_as_a_request_upstream(method, framing):
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: a\r\nx-api-key: evader\r\n\r\n"
    with cl0_upstream() as (url, seen):
        async with running_gateway(url) as gw:
            port = _port(gw)
            reply = await _one(port, _smuggling(method, framing, smuggled))
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            # A later client, on whatever upstream connection the gateway picks.
            victim = await _one(port, b"GET /victim HTTP/1.1\r\nHost: a\r\n\r\n")
            assert victim.startswith(b"HTTP/1.1 200"), victim[:200]
            assert victim.endswith(b"you asked for GET /victim"), victim
            await asyncio.sleep(0.3)  # time for a smuggled request to run, were it sent
    paths = [(m, p) for m, p, _ in seen.requests]
    assert paths == [(method, f"/outer/{method.lower()}"), ("GET", "/victim")], paths
    # The connection that carried the content served nothing after it.
    assert seen.requests[0][2] != seen.requests[1][2]


async def test_requests_with_content_on_post_and_bodiless_ones_keep_the_pooled_connection():
    """The cost stays where the risk is: a POST's content is read by such a server, and
    requests without content (the common case) reuse one upstream connection."""
    with cl0_upstream() as (url, seen):
        async with running_gateway(url) as gw:
            port = _port(gw)
            for n in range(3):
                body = b'{"n": %d}' % n
                reply = await _one(
                    port,
                    b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n" % len(body) + body,
                )
                assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
                reply = await _one(port, b"GET /g HTTP/1.1\r\nHost: a\r\n\r\n")
                assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            # And an empty body on GET is no content: pooled as well.
            reply = await _one(port, b"GET /e HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert [p for _, p, _ in seen.requests] == ["/p", "/g"] * 3 + ["/e"]
    assert len({port for _, _, port in seen.requests}) == 1, seen.requests


@pytest.mark.parametrize("written", [b"3", b"003", b"0003"])
async def test_content_length_goes_upstream_as_the_gateway_read_it(written):
    """'003' is 3 to the gateway; the upstream gets '3', so no reader of leading zeros
    (octal) can frame the body otherwise."""
    from tests.support.raw_upstream import running_raw_upstream

    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        reply = await _one(
            _port(gw),
            b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: " + written + b"\r\n\r\nabc",
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    [seen] = up.recording.requests
    lengths = [v for n, v in seen.headers if n.lower() == b"content-length"]
    assert lengths == [b"3"] and seen.body == b"abc", seen


async def test_a_kept_method_override_to_a_bodiless_method_closes_the_upstream_connection():
    """With keep_method_override, POST + X-HTTP-Method-Override: GET is a GET to an
    override-honouring upstream, which may then leave the content unread as well."""
    from tests.support.raw_upstream import running_raw_upstream

    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, keep_method_override=True) as gw,
    ):
        port = _port(gw)
        for override in (b"GET", b"POST"):
            reply = await _one(
                port,
                b"POST /o HTTP/1.1\r\nHost: a\r\nX-HTTP-Method-Override: "
                + override
                + b"\r\nContent-Length: 3\r\n\r\nabc",
            )
            assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    closes = [
        [v.lower() for n, v in r.headers if n.lower() == b"connection"]
        for r in up.recording.requests
    ]
    assert closes == [[b"close"], []], closes
