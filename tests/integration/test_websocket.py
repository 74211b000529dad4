"""WebSocket (and other Upgrade) through the gateway, issue 26 item 2: a real aiohttp
WebSocket server behind a real gateway, real aiohttp WebSocket clients. The upgrade
request is counted once by the rule table; after the 101 the connections are joined and
bytes go both ways, with backpressure, until either side closes. Fairness: clients on
127.0.0.2 (taking every tunnel it may) and 127.0.0.3 (served)."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest
from aiohttp import web

from gateway.proxy.tunnel import TunnelLimits
from tests.support.gateway import running_app, running_gateway

RULES = """\
rules:
  - id: ws
    match: {prefix: /ws}
    identity: ip
    limits: {us: 3/60}
  - id: rest
    identity: ip
    limits: {us: 1000/60}
"""


def ws_app(seen: dict) -> web.Application:
    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        seen.setdefault("headers", []).append(dict(request.headers))
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                if msg.data == "close-please":
                    await ws.close(code=4000, message=b"server says bye")
                    break
                await ws.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        seen["closed"] = seen.get("closed", 0) + 1
        return ws

    async def plain(request: web.Request) -> web.Response:
        return web.json_response(
            {"upgrade": request.headers.get("Upgrade"), "conn": request.headers.get("Connection")}
        )

    app = web.Application()
    app.router.add_get("/ws", echo)
    app.router.add_get("/plain", plain)
    return app


@pytest.fixture
async def ws_upstream():
    seen: dict = {}
    async with running_app(ws_app(seen)) as url:
        yield url, seen


@pytest.fixture
def rules(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return [str(path)]


async def _wait(condition, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_messages_go_both_ways_and_the_upgrade_is_counted_once(ws_upstream, rules):
    url, seen = ws_upstream
    async with running_gateway(url, rules=rules) as gw, aiohttp.ClientSession() as http:
        async with http.ws_connect(gw.url + "/ws") as ws:
            headers = ws._response.headers
            assert headers["RateLimit-Policy"] == '"ws";q=3;w=60'
            assert headers["RateLimit"].startswith('"ws";r=2;')
            for n in range(20):  # many messages on one upgrade: counted once
                await ws.send_str(f"hello {n}")
                assert (await ws.receive_str(timeout=5)) == f"echo:hello {n}"
            blob = os.urandom(3 * 1024 * 1024)  # larger than any buffer: backpressure
            await ws.send_bytes(blob)
            assert (await ws.receive_bytes(timeout=20)) == blob
        await _wait(lambda: seen.get("closed") == 1, "the server to see the client's close")
        # the upstream saw the upgrade with the gateway's forwarding headers
        (upstream_headers,) = seen["headers"]
        assert upstream_headers["Upgrade"].lower() == "websocket"
        assert upstream_headers["X-Forwarded-For"] == "127.0.0.1"
        await _wait(lambda: not gw.proxy.plane.tunnels.open, "the tunnel to end")
        # the rule counted each upgrade once: 2 more, then 429 before any upgrade
        for _ in range(2):
            async with http.ws_connect(gw.url + "/ws") as ws:
                await ws.send_str("x")
                assert (await ws.receive_str(timeout=5)) == "echo:x"
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(gw.url + "/ws")
        assert refused.value.status == 429
        scraped = gw.metrics.registry
        from prometheus_client import generate_latest

        text = generate_latest(scraped).decode()
        assert "gateway_tunnels_opened_total 3.0" in text
        assert 'gateway_tunnels_closed_total{reason="closed"} 3.0' in text


async def test_the_server_closing_reaches_the_client(ws_upstream, rules):
    url, _ = ws_upstream
    async with running_gateway(url, rules=rules) as gw, aiohttp.ClientSession() as http:
        async with http.ws_connect(gw.url + "/ws") as ws:
            await ws.send_str("close-please")
            msg = await ws.receive(timeout=5)
            assert msg.type == aiohttp.WSMsgType.CLOSE
            assert msg.data == 4000 and msg.extra == "server says bye"
        await _wait(lambda: not gw.proxy.plane.tunnels.open, "the tunnel to end")
        await _wait(lambda: not gw.proxy.plane.connections, "the client connection to close")


async def test_tunnels_per_address_are_bounded_and_another_address_is_served(ws_upstream, rules):
    url, _ = ws_upstream
    async with running_gateway(url, rules=rules) as gw:
        plane = gw.proxy.plane
        plane.tunnels.limits = TunnelLimits(max_tunnels=10, max_tunnels_per_client=2)
        attacker = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
        )
        served = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0)))
        try:
            held = [await attacker.ws_connect(gw.url + "/ws") for _ in range(2)]
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await attacker.ws_connect(gw.url + "/ws")
            assert refused.value.status == 429
            async with served.ws_connect(gw.url + "/ws") as ws:
                await ws.send_str("still here")
                assert (await ws.receive_str(timeout=5)) == "echo:still here"
            for ws in held:
                await ws.close()
            await _wait(lambda: not plane.tunnels.per_client, "the attacker's tunnels to end")
        finally:
            await attacker.close()
            await served.close()


async def test_an_idle_tunnel_is_closed(ws_upstream, rules):
    url, seen = ws_upstream
    async with running_gateway(url, rules=rules) as gw, aiohttp.ClientSession() as http:
        gw.proxy.plane.tunnels.limits = TunnelLimits(idle_timeout=0.3)
        async with http.ws_connect(gw.url + "/ws", autoping=False, heartbeat=None) as ws:
            msg = await ws.receive(timeout=10)  # nothing is sent: the gateway closes both
            assert msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSE)
        await _wait(lambda: seen.get("closed") == 1, "the upstream side to close too")
        from prometheus_client import generate_latest

        text = generate_latest(gw.metrics.registry).decode()
        assert 'gateway_tunnels_closed_total{reason="idle"} 1.0' in text


async def _raw(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_h2c_and_upgrades_to_upstreams_that_take_none_stay_plain_http(
    ws_upstream, rules, tmp_path
):
    url, _ = ws_upstream
    async with running_gateway(url, rules=rules) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reply = await _raw(
            port,
            b"GET /plain HTTP/1.1\r\nHost: a\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 200")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["upgrade"] is None
        assert not gw.proxy.plane.tunnels.open
    # an upstream that takes no upgrades (an extra route) gets plain HTTP
    config = tmp_path / "gateway.yaml"
    config.write_text(f"routes: {{/plain: '{url}'}}\n")
    async with running_gateway(None, rules=rules, config_file=str(config)) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reply = await _raw(
            port,
            b"GET /plain HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 200")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["upgrade"] is None


async def test_an_upgrade_the_upstream_declines_is_answered_as_http(ws_upstream, rules):
    url, _ = ws_upstream
    async with running_gateway(url, rules=rules) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        # /plain is no WebSocket endpoint: the upstream answers 200, the gateway passes it
        # on and closes the connection; the tunnel slot is given back.
        reply = await _raw(
            port,
            b"GET /plain HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 200")
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["upgrade"] == "websocket"
        tunnels = gw.proxy.plane.tunnels
        assert tunnels.reserved == 0 and not tunnels.per_client and not tunnels.open


async def test_tunnel_bounds_come_from_the_settings(ws_upstream, rules):
    from gateway.settings import SettingsError, load_settings

    url, _ = ws_upstream
    async with running_gateway(
        url, rules=rules, max_tunnels_per_client=1, tunnel_idle_timeout=30
    ) as gw:
        limits = gw.proxy.plane.tunnels.limits
        assert (limits.max_tunnels_per_client, limits.idle_timeout) == (1, 30)
        async with aiohttp.ClientSession() as http, http.ws_connect(gw.url + "/ws"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await http.ws_connect(gw.url + "/ws")
            assert refused.value.status == 429
    for bad in ({"max_tunnels": 0}, {"tunnel_idle_timeout": 0}, {"tunnel_max_bytes": -1}):
        with pytest.raises(SettingsError):
            load_settings(bad, env={}, config_file=None)


async def test_a_route_takes_upgrades_when_it_says_so_and_the_upstream_can_refuse(
    ws_upstream, rules, tmp_path
):
    url, _ = ws_upstream
    config = tmp_path / "gateway.yaml"
    config.write_text(f"routes:\n  /ws: {{url: '{url}', upgrade: true}}\n  /plain: '{url}'\n")
    async with running_gateway(None, rules=rules, config_file=str(config)) as gw:
        async with aiohttp.ClientSession() as http, http.ws_connect(gw.url + "/ws") as ws:
            await ws.send_str("via a route")
            assert (await ws.receive_str(timeout=5)) == "echo:via a route"
        info = {u["prefix"]: u["upgrade"] for u in (await gw.proxy.info())["upstreams"]}
        assert info == {"/ws": True, "/plain": False}
    # upstream_upgrade: false turns it off for --upstream
    async with running_gateway(url, rules=rules, upstream_upgrade=False) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reply = await _raw(
            port,
            b"GET /plain HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        )
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["upgrade"] is None
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"routes:\n  /ws: {{url: '{url}', upgrade: 'yes'}}\n")
    from gateway.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="takes 'url' and 'upgrade'"):
        load_settings({}, env={}, config_file=str(bad))
