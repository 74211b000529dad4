"""Hardening, second round, finding 0: an Upgrade request with a body.

llhttp (as httptools drives it) stops at the end of an Upgrade request's head, so the
gateway used to forward such a request with its Content-Length but without its body,
and return the upstream connection to the pool: the next client's request on it was
read by the upstream as the missing body (request smuggling). Now the body is read by
the same strict parser and forwarded whole, an upstream connection is reused only after
a request that went out whole, and a framing refusal closes the client connection.

Checked against two real upstreams: the recording raw upstream (what bytes arrive) and
nginx, which answers ``return 200`` without waiting for the body and discards the body
from the connection afterwards, the upstream behaviour the attack relied on.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.support.edge_corpus import chunks
from tests.support.gateway import free_port, running_gateway
from tests.support.raw_upstream import running_raw_upstream

NGINX = shutil.which("nginx") or "/usr/sbin/nginx"
SMUGGLED = b"GET /smuggled;x HTTP/1.1\r\nHost: a\r\n\r\n"


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


def upgrade_head(framing: str, body: bytes, path: bytes = b"/up") -> bytes:
    length = (
        b"Transfer-Encoding: chunked\r\n"
        if framing == "chunked"
        else b"Content-Length: %d\r\n" % len(body)
    )
    return (
        b"POST " + path + b" HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n" + length + b"\r\n"
    )


def wire_body(framing: str, body: bytes) -> bytes:
    return chunks(body) if framing == "chunked" else body


async def exchange(port: int, parts: list[bytes], pause: float = 0.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for n, part in enumerate(parts):
        if n and pause:
            await asyncio.sleep(pause)
        writer.write(part)
        await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


CASES = [
    pytest.param("length", 0.0, id="content-length-early"),
    pytest.param("length", 0.2, id="content-length-late"),
    pytest.param("chunked", 0.0, id="chunked-early"),
    pytest.param("chunked", 0.2, id="chunked-late"),
]


@pytest.mark.parametrize(("framing", "pause"), CASES)
async def test_an_upgrade_request_body_reaches_the_upstream_whole(framing, pause):
    body = SMUGGLED + b"tail"
    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        reply = await exchange(
            _port(gw), [upgrade_head(framing, body), wire_body(framing, body)], pause
        )
        assert reply.startswith(b"HTTP/1.1 200"), reply[:80]
        # Upgrade is not offered: answered as plain HTTP, then the connection closes
        assert b"Connection: close" in reply
        received = up.recording.requests
        assert [(r.target, r.body) for r in received] == [(b"/up", body)]
        assert not up.recording.failures and not up.recording.incomplete
        assert b"upgrade" not in {name.lower() for name, _ in received[0].headers}


async def test_a_broken_chunked_upgrade_body_is_refused_and_nothing_is_forwarded():
    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        head = upgrade_head("chunked", b"")
        reply = await exchange(_port(gw), [head + b"zz\r\nabc\r\n0\r\n\r\n"])
        assert reply.startswith(b"HTTP/1.1 400"), reply[:80]
        await asyncio.sleep(0.1)
        assert not up.recording.requests


@pytest.mark.parametrize(
    "refused",
    [
        b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Transfer-Encoding: identity, chunked\r\n",
        b"Content-Length: 5\r\nContent-Length: 5\r\n",
    ],
)
async def test_after_a_framing_refusal_nothing_more_is_read(refused):
    """The refused request's body is framed in a way upstreams disagree about: what
    follows it on the connection is not parsed as a request."""
    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        attack = b"POST /a HTTP/1.1\r\nHost: a\r\n" + refused + b"\r\n5\r\nhello\r\n0\r\n\r\n"
        reply = await exchange(_port(gw), [attack + SMUGGLED])
        assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.1 501")), reply[:80]
        assert reply.count(b"HTTP/1.1 ") == 1, reply
        assert b"Connection: close" in reply
        await asyncio.sleep(0.1)
        assert not up.recording.requests


def _nginx_config(directory: Path, port: int) -> str:
    temp = "\n".join(
        f"{kind}_temp_path {directory}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
daemon off;
master_process off;
worker_processes 1;
pid {directory}/nginx.pid;
error_log {directory}/error.log;
events {{ worker_connections 64; }}
http {{
    {temp}
    log_format uris '$request_uri';
    access_log {directory}/access.log uris;
    keepalive_requests 10000;
    server {{
        listen 127.0.0.1:{port};
        location / {{ return 200 "served $request_uri\\n"; }}
    }}
}}
"""


@asynccontextmanager
async def running_nginx(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    if not Path(NGINX).exists():
        pytest.fail("nginx is required by this test: scripts/test installs nginx-light")
    port = free_port()
    config = tmp_path / "nginx.conf"
    config.write_text(_nginx_config(tmp_path, port))
    process = subprocess.Popen([NGINX, "-c", str(config), "-e", str(tmp_path / "error.log")])
    try:
        for _ in range(100):
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield f"http://127.0.0.1:{port}", tmp_path / "access.log"
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize(("framing", "pause"), CASES)
async def test_the_next_request_after_an_upgrade_with_a_body_is_served_intact(
    tmp_path, framing, pause
):
    """nginx answers before reading the body, then discards the body from the
    connection: with a body missing, the next client's request (on the same pooled
    upstream connection) would be eaten, and the rest parsed as a request never routed."""
    async with running_nginx(tmp_path) as (url, access_log):
        async with running_gateway(url, upstream_pool_size=1) as gw:
            body = SMUGGLED
            await exchange(
                _port(gw), [upgrade_head(framing, body), wire_body(framing, body)], pause
            )
            for n in range(3):
                reply = await exchange(
                    _port(gw), [b"GET /next%d HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n" % n]
                )
                assert reply.startswith(b"HTTP/1.1 200"), reply[:120]
                assert reply.endswith(b"served /next%d\n" % n), reply
        await asyncio.sleep(0.1)
    seen = access_log.read_text().split()
    assert seen == ["/up", "/next0", "/next1", "/next2"], seen
