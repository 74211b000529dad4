"""Every per-client bound counts a client under the same address the rate limiter does
(review findings, fixed by their class):

* behind a trusted proxy, upgraded connections (tunnels) are capped per client that the
  proxy names in X-Forwarded-For, as exchanges and uploads are; only the proxy's own
  requests (naming no client) are not: they are all its clients;
* connections are capped per IPv6 prefix (``ipv6_prefix``), not per full address: one
  host's /64 must not hold every connection slot.

Real WebSocket upstream and clients for the tunnels; the connection cap is driven through
the real ``ClientConnection`` with transports that report IPv6 peers (the loopback
interface has one IPv6 address, ::1)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest

from gateway.app import Proxy, Upstreams
from gateway.metrics import Metrics
from gateway.proxy.reload import RuleSource
from gateway.proxy.server import ClientConnection
from gateway.proxy.tunnel import TunnelLimits
from gateway.settings import load_settings
from tests.integration.test_websocket import _wait, ws_app  # the same upstream and poll
from tests.support.gateway import SECRET, running_app, running_gateway

RULES = """\
rules:
  - id: everything
    identity: ip
    limits: {us: 100000/60}
"""


@pytest.fixture
def rules(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(RULES)
    return [str(path)]


async def _upgrade(http: aiohttp.ClientSession, url: str, forwarded: str | None):
    headers = {} if forwarded is None else {"X-Forwarded-For": forwarded}
    return await http.ws_connect(url + "/ws", headers=headers)


@pytest.mark.parametrize(
    ("attacker", "same_client", "other_client"),
    [
        ("203.0.113.9", "203.0.113.9", "203.0.113.10"),
        # An IPv6 client is one client across its /64, as the rate limiter counts it.
        ("2001:db8:1:1::1", "2001:db8:1:1::beef", "2001:db8:1:2::1"),
    ],
)
async def test_tunnels_behind_a_trusted_proxy_are_capped_per_forwarded_client(
    rules, attacker: str, same_client: str, other_client: str
) -> None:
    async with running_app(ws_app({})) as upstream:
        async with running_gateway(upstream, rules=rules, trusted_proxies=["127.0.0.1/32"]) as gw:
            plane = gw.proxy.plane
            plane.tunnels.limits = TunnelLimits(max_tunnels=6, max_tunnels_per_client=2)
            async with aiohttp.ClientSession() as http:
                held = [await _upgrade(http, gw.url, f) for f in (attacker, same_client)]
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await _upgrade(http, gw.url, same_client)
                assert refused.value.status == 429  # the client's share, not everyone's
                # Another client behind the same proxy is served, and so are the proxy's
                # own requests (no X-Forwarded-For: not capped per address).
                for forwarded in (other_client, None, None):
                    ws = await _upgrade(http, gw.url, forwarded)
                    await ws.send_str("hi")
                    assert await ws.receive_str(timeout=5) == "echo:hi"
                    held.append(ws)
                for ws in held:
                    await ws.close()
                await _wait(lambda: not plane.tunnels.open, "every tunnel to end")
                assert not plane.tunnels.per_client


async def test_tunnels_from_an_untrusted_peer_ignore_its_forwarding_header(rules) -> None:
    """Without a trusted proxy X-Forwarded-For names nobody: a client cannot spread its
    tunnels over invented clients."""
    async with running_app(ws_app({})) as upstream:
        async with running_gateway(upstream, rules=rules) as gw:
            gw.proxy.plane.tunnels.limits = TunnelLimits(max_tunnels=6, max_tunnels_per_client=2)
            async with aiohttp.ClientSession() as http:
                held = [await _upgrade(http, gw.url, f"198.51.100.{n}") for n in range(2)]
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await _upgrade(http, gw.url, "198.51.100.7")
                assert refused.value.status == 429
                for ws in held:
                    await ws.close()


class _Transport:
    """What ``ClientConnection`` asks of its transport, for a peer of our choosing."""

    def __init__(self, peer: str) -> None:
        self.peer = peer
        self.aborted = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return (self.peer, 40000, 0, 0) if name == "peername" else default

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted

    def write(self, data: bytes) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.mark.parametrize("prefix", [64, 56, 128])
async def test_connections_are_capped_per_ipv6_prefix(rules, prefix: int) -> None:
    async with running_gateway(
        "http://127.0.0.1:9", rules=rules, max_client_connections=2, ipv6_prefix=prefix
    ) as gw:
        plane = gw.proxy.plane
        opened: list[tuple[ClientConnection, _Transport]] = []

        def connect(peer: str) -> bool:
            conn = ClientConnection(plane)
            transport = _Transport(peer)
            conn.connection_made(transport)  # type: ignore[arg-type]
            opened.append((conn, transport))
            return not transport.aborted

        try:
            # Six addresses of one /64 (and so of one /56): one client for the cap unless
            # every address is its own (/128).
            same_net = [f"2001:db8:0:1::{n:x}" for n in range(1, 7)]
            accepted = [connect(peer) for peer in same_net]
            expected = 6 if prefix == 128 else 2
            assert accepted.count(True) == expected
            assert accepted[:expected] == [True] * expected
            # A host of another /56 is served whatever the first one holds.
            assert connect("2001:db8:ff00::1")
            # Closing gives the slots back.
            for conn, transport in opened:
                if not transport.aborted:
                    conn.connection_lost(None)
            assert not plane.per_address
        finally:
            for conn, transport in opened:
                if not transport.aborted:
                    conn.connection_lost(None)


async def test_connections_from_ipv4_addresses_are_capped_each(rules) -> None:
    """Real sockets: 127.0.0.2 holds its share, 127.0.0.3 is still served."""
    async with running_app(ws_app({})) as upstream:
        async with running_gateway(upstream, rules=rules, max_client_connections=2) as gw:
            held = []
            for _ in range(2):
                _, writer = await asyncio.open_connection(
                    "127.0.0.1", gw.proxy.port, local_addr=("127.0.0.2", 0)
                )
                held.append(writer)
            await _wait(lambda: gw.proxy.plane.per_address.get("127.0.0.2") == 2, "2 counted")
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", gw.proxy.port, local_addr=("127.0.0.2", 0)
            )
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed at once
            writer.close()
            served = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(local_addr=("127.0.0.3", 0))
            )
            async with served, served.get(gw.url + "/ok") as answer:
                assert answer.status == 200
            for writer in held:
                writer.close()


async def test_a_declined_upgrade_behind_a_trusted_proxy_gives_its_slot_back(rules) -> None:
    """A tunnel slot reserved per forwarded client is given back under the same client
    when the upstream declines the upgrade (review: taken per client, given back as the
    proxy's, the client's count never went down)."""
    request = (
        b"GET /plain HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"X-Forwarded-For: 203.0.113.9\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n"
    )
    async with running_app(ws_app({})) as upstream:
        async with running_gateway(upstream, rules=rules, trusted_proxies=["127.0.0.1/32"]) as gw:
            plane = gw.proxy.plane
            plane.tunnels.limits = TunnelLimits(max_tunnels=6, max_tunnels_per_client=2)
            for _ in range(4):  # more than the client's share: each slot came back
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.proxy.port)
                writer.write(request)
                reply = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
            await _wait(lambda: not plane.tunnels.per_client, "every slot given back")


@contextlib.asynccontextmanager
async def _gateway_on(host: str, upstream: str, rules: list[str], **overrides):
    """``running_gateway`` listening on ``host`` (::1 for an IPv6 peer)."""
    settings = load_settings(
        {"rules": rules, "upstream": upstream, "embedded": False, "watch_rules": False,
         "access_log": "off", **overrides},
        env={},
    )  # fmt: skip
    metrics = Metrics()
    source = RuleSource.load(settings.rules, [r.name for r in settings.region_table()], metrics)
    proxy = Proxy(settings, Upstreams({}), metrics, source, SECRET)
    await proxy.start(host, 0)
    try:
        yield proxy
    finally:
        await proxy.stop(5)


async def test_a_client_in_a_trusted_proxys_ipv6_prefix_is_capped_as_any(rules) -> None:
    """Review finding: a proxy at ::1 and a client it names at ::2 share a /64. The
    client is a client all the same (capped), the proxy's own requests are not."""
    async with running_app(ws_app({})) as upstream:
        async with _gateway_on("::1", upstream, rules, trusted_proxies=["::1/128"]) as proxy:
            plane = proxy.plane
            assert plane is not None
            plane.tunnels.limits = TunnelLimits(max_tunnels=6, max_tunnels_per_client=2)
            url = f"http://[::1]:{proxy.port}"
            async with aiohttp.ClientSession() as http:
                held = [await _upgrade(http, url, "::2") for _ in range(2)]
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await _upgrade(http, url, "::3")  # the same /64: the same client
                assert refused.value.status == 429
                held += [await _upgrade(http, url, None) for _ in range(3)]  # the proxy's
                for ws in held:
                    await ws.close()
            await _wait(lambda: not plane.tunnels.open, "every tunnel to end")
            assert not plane.tunnels.per_client
