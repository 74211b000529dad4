"""HTTPS on the gateway's proxy port, end to end: settings (a config file's ``tls:``
section, or the flags' names) -> ``tls_setup.tls_listener`` -> ``DataPlane.start(...,
tls=...)`` serving the real gateway (rules, counters, rate-limit headers) in front of a
real upstream, asked by aiohttp's client and plain sockets trusting a CA made here
(tests/support/tls_pki.py). Rotation under traffic, a bad pair refused, client
certificates, the handshake deadline, the admin port's own certificate.

The HTTPS data plane here is a second one beside ``running_gateway``'s plain one (which
stays on ``gw.url``), sharing its ``Gateway``: what ``Proxy.start`` builds with ``tls=``.
Each scenario runs on asyncio's loop and on uvloop (what ``gateway serve`` runs).
Nothing asserts a duration: waits are polls with generous limits.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from cryptography import x509
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics
from gateway.proxy.admin import create_admin_app
from gateway.proxy.plane import DataPlane
from gateway.proxy.tls import TlsListener, peer_subject
from gateway.proxy.upstream_pool import UpstreamPool
from gateway.settings import load_settings
from gateway.tls_setup import admin_tls, tls_listener
from tests.support.gateway import RunningGateway, running_app, running_gateway
from tests.support.tls_pki import Issued, Pki, client_context, swap_to, write_pair
from tests.support.upstream import create_upstream_app

Runner = Callable[[Awaitable[Any]], Any]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


@pytest.fixture(scope="module")
def clients() -> Pki:
    return Pki("Client CA")


async def until(predicate: Callable[[], bool], what: str) -> None:
    """Wait for ``predicate()``; the limit only ends a hang, no timing is asserted."""
    for _ in range(6000):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


class Https:
    """A small HTTP/1.1 client on one TLS connection (asyncio streams), which knows the
    certificate its connection got (aiohttp's client lets go of the connection, and so
    of its certificate, as soon as an answer is read)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True)
        self.serial = int(x509.load_der_x509_certificate(der).serial_number)
        self.alpn = ssl_object.selected_alpn_protocol()
        self.version = ssl_object.version()

    @classmethod
    async def open(cls, port: int, context: ssl.SSLContext) -> Https:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=context, server_hostname="localhost"
        )
        return cls(reader, writer)

    async def get(
        self, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        lines = [f"GET {path} HTTP/1.1", "Host: localhost"]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        status_line, *fields = head.rstrip("\r\n").split("\r\n")
        answer_headers = {}
        for field in fields:
            name, _, value = field.partition(":")
            answer_headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(answer_headers["content-length"]))
        return int(status_line.split(" ")[1]), answer_headers, body

    async def close(self) -> None:
        self.writer.close()
        with suppress(ConnectionError, ssl.SSLError):
            await self.writer.wait_closed()


async def fetch(
    port: int, pki: Pki, path: str, headers: dict[str, str] | None = None
) -> tuple[int, int, dict[str, str], bytes]:
    """One request on a new connection: the certificate's serial and the answer."""
    client = await Https.open(port, client_context(pki))
    try:
        status, answer_headers, body = await client.get(path, headers)
        return client.serial, status, answer_headers, body
    finally:
        await client.close()


def tls_samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("gateway_tls_")
    }


def reloads(metrics: Metrics, outcome: str, listener: str = "proxy") -> float:
    key = ("gateway_tls_reloads_total", (("listener", listener), ("outcome", outcome)))
    return tls_samples(metrics).get(key, 0.0)


def write_config(tmp_path: Path, tls: str) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(tls)
    return str(path)


@asynccontextmanager
async def https_gateway(
    upstream: str, config_file: str
) -> AsyncIterator[tuple[RunningGateway, TlsListener, DataPlane, str]]:
    """The real gateway (plain HTTP on ``gw.url``) and beside it an HTTPS data plane
    serving the same ``Gateway`` with the TLS the config file describes; yields the
    running gateway, the TLS listener, the HTTPS plane and its base URL."""
    async with running_gateway(upstream) as gw:
        settings = load_settings({}, env={}, config_file=config_file)
        listener = tls_listener(settings, gw.metrics)
        assert listener is not None
        plain = gw.proxy.plane
        assert plain is not None and plain.scheme == "http"
        plane = DataPlane(
            gw.gateway,
            UpstreamPool(settings.upstream_pool_size, settings.upstream_connect_timeout),
            plain.limits,
        )
        addresses = await plane.start("127.0.0.1", 0, tls=listener)
        try:
            assert len(addresses) == 1 and addresses[0].startswith("https://127.0.0.1:")
            assert plane.scheme == "https"
            yield gw, listener, plane, f"https://localhost:{plane.ports[0]}"
        finally:
            await plane.stop(5)
            await listener.close()


def pair_config(cert: str, key: str, extra: str = "") -> str:
    return f"tls:\n  cert: {cert}\n  key: {key}\n{extra}"


# --- requests


def test_https_through_the_gateway_with_rate_limit_headers(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test", serial=0x601))
        config = write_config(tmp_path, pair_config(cert, key))
        async with (
            running_app(create_upstream_app()) as upstream,
            https_gateway(upstream, config) as (gw, listener, plane, url),
        ):
            context = client_context(pki)
            context.set_alpn_protocols(["h2", "http/1.1"])
            connector = aiohttp.TCPConnector(ssl=context)
            async with aiohttp.ClientSession(connector=connector) as session:
                headers = {"x-api-key": "tls-key"}
                async with session.post(f"{url}/runs/query", headers=headers) as response:
                    assert response.status == 200, await response.text()
                    echoed = await response.json()
                    assert echoed["path"] == "/runs/query"
                    assert response.headers["X-Upstream"] == "yes"
                    assert response.headers["RateLimit-Policy"].startswith(
                        '"runs-query-api-key";q=15;w=10'
                    )
                    assert response.headers["RateLimit"].startswith('"runs-query-api-key";r=14;')
                # The limit holds over HTTPS as over HTTP: the 16th request in 10 s is 429.
                statuses = []
                for _ in range(15):
                    async with session.post(f"{url}/runs/query", headers=headers) as response:
                        statuses.append(response.status)
                        last = response
                        body = await response.json()
                assert statuses == [200] * 14 + [429]
                assert "Retry-After" in last.headers and "detail" in body
                # The gateway's own answers (no upstream) are served over TLS too.
                async with session.get(f"{url}/ok") as response:
                    assert response.status == 200

            # The certificate served, ALPN and the protocol version.
            client = await Https.open(plane.ports[0], context)
            try:
                assert (client.serial, client.alpn) == (0x601, "http/1.1")
                assert client.version in ("TLSv1.2", "TLSv1.3")
                status, headers, _ = await client.get("/ok")
                assert status == 200
            finally:
                await client.close()

            # Plain HTTP to the HTTPS port: a 400 that says what to do.
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{plane.ports[0]}/runs") as response:
                    assert response.status == 400
                    assert await response.json() == {
                        "detail": "this port speaks HTTPS; use https://"
                    }
            await until(lambda: not plane.connections, "every connection closed")
            info = listener.info()
            assert info["plain_http_refused"] == 1 and info["handshakes"] >= 1
            assert info["serial"] == "601" and info["client_auth"] == "none"
            json.dumps(info)
            # The counts went to the same metrics as the plain port's requests.
            limited = gw.metrics.requests.children[
                ("us", "runs-query-api-key", "api_key", "limited")
            ]
            assert limited.value == 1

    run(scenario())


def test_a_stalled_handshake_meets_the_configured_deadline(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test"))
        config = write_config(tmp_path, pair_config(cert, key, "  handshake_timeout: 0.3\n"))
        async with (
            running_app(create_upstream_app()) as upstream,
            https_gateway(upstream, config) as (_gw, listener, plane, _url),
        ):
            assert listener.handshake_timeout == 0.3
            reader, writer = await asyncio.open_connection("127.0.0.1", plane.ports[0])
            writer.write(b"\x16\x03\x01")  # a ClientHello that never finishes
            await writer.drain()
            with suppress(ConnectionError):
                assert await asyncio.wait_for(reader.read(), 60) == b""
            writer.close()
            assert listener.stats.handshake_timeouts == 1
            await until(lambda: not plane.connections, "the stalled connection gone")

    run(scenario())


# --- rotation


def test_rotation_under_traffic_fails_no_request(run: Runner, tmp_path: Path, pki: Pki) -> None:
    """cert-manager's way (a symlink swapped to a new directory) three times while
    clients keep asking, on fresh connections and on one kept open: a new pair picked
    up by the file watch, a bad pair refused (the old one still served), a new pair on
    SIGHUP. Not one request fails; each connection sees one whole certificate."""

    async def scenario() -> None:
        live = tmp_path / "live"
        generations: dict[int, Issued] = {}

        def generation(serial: int, key_of: Issued | None = None) -> Path:
            issued = generations[serial] = pki.issue("gateway.test", serial=serial)
            folder = tmp_path / f"gen-{serial:x}"
            write_pair(folder, issued)
            if key_of is not None:  # a certificate beside another one's key
                write_pair(tmp_path / "other", key_of)
                (folder / "tls.key").write_bytes((tmp_path / "other" / "tls.key").read_bytes())
            return folder

        swap_to(live, generation(0x701))
        config = write_config(
            tmp_path,
            # (an hour: the listener's own watch would stay out of the way; the test runs
            # one of its own, and stops it before the SIGHUP step)
            pair_config(str(live / "tls.crt"), str(live / "tls.key"), "  watch_interval: 3600\n"),
        )
        async with (
            running_app(create_upstream_app()) as upstream,
            https_gateway(upstream, config) as (gw, listener, plane, _url),
        ):
            metrics = gw.metrics
            port = plane.ports[0]
            watcher = asyncio.create_task(listener.source.watch(0.05))
            stop = asyncio.Event()
            failures: list[str] = []
            served: dict[str, list[int]] = {}

            async def traffic(name: str, fresh: bool) -> None:
                # fresh: a new connection (a new handshake) for every request; else one
                # connection for all of them.
                seen = served.setdefault(name, [])
                client = None if fresh else await Https.open(port, client_context(pki))
                n = 0
                while not stop.is_set() or n < 10:
                    n += 1
                    path, key = f"/traffic/{name}/{n}", {"x-api-key": name}
                    try:
                        if client is None:
                            serial, status, headers, body = await fetch(port, pki, path, key)
                        else:
                            status, headers, body = await client.get(path, key)
                            serial = client.serial
                    except Exception as exc:  # any failure is the test's failure
                        failures.append(f"{name} {n}: {exc!r}")
                        continue
                    if status != 200 or "ratelimit" not in headers:
                        failures.append(f"{name} {n}: {status} {body!r}")
                    seen.append(serial)
                if client is not None:
                    await client.close()

            async def fresh_serial() -> int:
                serial, status, _, _ = await fetch(port, pki, "/probe")
                assert status == 200
                return serial

            async def until_served(serial: int) -> None:
                for _ in range(3000):
                    if await fresh_serial() == serial:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError(f"serial {serial:x} never served")

            # One keep-alive connection, opened before the first rotation.
            kept = await Https.open(port, client_context(pki))
            assert kept.serial == 0x701
            clients = [asyncio.create_task(traffic(f"fresh-{i}", fresh=True)) for i in range(3)] + [
                asyncio.create_task(traffic("keepalive", fresh=False))
            ]
            try:
                assert (await kept.get("/kept/0"))[0] == 200
                await until(lambda: all(len(s) >= 3 for s in served.values()), "traffic")

                # 1. A new pair, picked up by the watch.
                swap_to(live, generation(0x702))
                await until_served(0x702)
                assert reloads(metrics, "ok") == 1

                # 2. A pair that does not match: refused, the old one still served.
                swap_to(live, generation(0x703, key_of=pki.issue("stranger")))
                await until(lambda: listener.source.reload_failures == 1, "the refusal")
                assert await fresh_serial() == 0x702
                assert "does not belong to the certificate" in str(listener.info()["last_error"])
                assert reloads(metrics, "refused") == 1

                # 3. A new pair on SIGHUP (the watch stopped: only the signal reloads).
                watcher.cancel()
                with suppress(asyncio.CancelledError):
                    await watcher
                swap_to(live, generation(0x704))
                assert await fresh_serial() == 0x702
                listener.request_reload("SIGHUP")
                await until_served(0x704)
                assert reloads(metrics, "ok") == 2

                # The connection kept open all along still has its first certificate.
                assert (await kept.get("/kept/1"))[0] == 200
                assert kept.serial == 0x701
                count = sum(len(s) for s in served.values())
                await until(
                    lambda: sum(len(s) for s in served.values()) >= count + 8,
                    "traffic after the last rotation",
                )
            finally:
                stop.set()
                await asyncio.gather(*clients)
                await kept.close()
                watcher.cancel()
                with suppress(asyncio.CancelledError):
                    await watcher
            assert failures == []
            every = [serial for seen in served.values() for serial in seen]
            assert set(every) <= {0x701, 0x702, 0x704}  # never the refused pair
            assert set(served["keepalive"]) == {0x701}  # its one connection
            assert 0x702 in every
            expiry = tls_samples(metrics)[
                ("gateway_tls_certificate_expiry_timestamp_seconds", (("listener", "proxy"),))
            ]
            assert expiry == generations[0x704].cert.not_valid_after_utc.timestamp()
            assert listener.source.serial() == 0x704

    run(scenario())


# --- client certificates


def test_required_client_certificates_and_the_verified_subject(
    run: Runner, tmp_path: Path, pki: Pki, clients: Pki
) -> None:
    async def scenario() -> None:
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test"))
        ca = clients.write_ca(tmp_path / "clients-ca.pem")
        config = write_config(
            tmp_path,
            pair_config(cert, key, f"  client_ca: {ca}\n  client_auth: required\n"),
        )
        async with (
            running_app(create_upstream_app()) as upstream,
            https_gateway(upstream, config) as (_gw, listener, plane, url),
        ):
            member = clients.issue("service-a", server=False)
            context = client_context(pki, member, tmp_path / "client")
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context)) as s:
                async with s.get(f"{url}/who") as response:
                    assert response.status == 200
                    assert "RateLimit" in response.headers
                # The verified subject, on the connection the gateway keeps open.
                subjects = [
                    peer_subject(conn.transport.raw)
                    for conn in plane.connections
                    if conn.transport is not None
                ]
                assert subjects == ["CN=service-a,O=Gateway Tests"]

            # No certificate, or one from another CA: refused in the handshake.
            for attempt in (
                client_context(pki),
                client_context(pki, pki.issue("x", server=False), tmp_path / "c2"),
            ):
                connector = aiohttp.TCPConnector(ssl=attempt)
                async with aiohttp.ClientSession(connector=connector) as session:
                    with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                        async with session.get(f"{url}/who") as response:
                            await response.read()
            await until(lambda: listener.stats.handshake_failures >= 1, "refusals counted")
            assert listener.info()["client_auth"] == "required"
            assert listener.describe().count("client certificates required") == 1

    run(scenario())


# --- the admin port's own certificate


def test_the_admin_port_serves_its_own_certificate_and_follows_its_rotation(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        live = tmp_path / "admin-live"
        write_pair(tmp_path / "a1", pki.issue("admin.test", serial=0x801))
        swap_to(live, tmp_path / "a1")
        config = write_config(
            tmp_path, f"tls:\n  admin: {{cert: {live / 'tls.crt'}, key: {live / 'tls.key'}}}\n"
        )
        async with running_gateway(None, config_file=config) as gw:
            assert tls_listener(gw.settings, gw.metrics) is None  # the proxy port stays plain
            admin = admin_tls(gw.settings, gw.metrics)
            assert admin is not None
            runner = web.AppRunner(create_admin_app(gw.metrics.registry), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=admin.context)
            await site.start()
            port = runner.addresses[0][1]
            try:
                # A new connection per look: each one a new handshake.
                async def scrape() -> tuple[int, str]:
                    serial, status, _, body = await fetch(port, pki, "/metrics")
                    assert status == 200
                    return serial, body.decode()

                serial, text = await scrape()
                assert serial == 0x801
                assert 'gateway_tls_certificate_expiry_timestamp_seconds{listener="admin"}' in text
                write_pair(tmp_path / "a2", pki.issue("admin.test", serial=0x802))
                swap_to(live, tmp_path / "a2")
                admin.request_reload("SIGHUP")
                for _ in range(3000):
                    serial, text = await scrape()
                    if serial == 0x802:
                        break
                    await asyncio.sleep(0.01)
                assert serial == 0x802
                assert 'gateway_tls_reloads_total{listener="admin",outcome="ok"} 1.0' in text
                assert admin.describe().startswith("TLS on the admin port: certificate ")
                assert admin.info()["serial"] == "802"
            finally:
                await runner.cleanup()
                await admin.close()

    run(scenario())


# --- upgrades over TLS


def test_websocket_over_https_is_tunnelled(run: Runner, tmp_path: Path, pki: Pki) -> None:
    """wss:// through the HTTPS port: after the 101 the gateway joins the TLS
    connection (its application-side transport) to the upstream's; messages and a
    blob larger than any buffer go both ways, and the tunnel ends with the client."""

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        return ws

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/ws", echo)
        cert, key = write_pair(tmp_path / "pair", pki.issue("gateway.test"))
        config = write_config(tmp_path, pair_config(cert, key))
        async with (
            running_app(app) as upstream,
            https_gateway(upstream, config) as (_gw, _listener, plane, url),
        ):
            connector = aiohttp.TCPConnector(ssl=client_context(pki))
            async with (
                aiohttp.ClientSession(connector=connector) as session,
                session.ws_connect(
                    url.replace("https://", "wss://") + "/ws", max_msg_size=16 * 1024 * 1024
                ) as ws,
            ):
                assert "RateLimit" in ws._response.headers
                for n in range(10):
                    await ws.send_str(f"hello {n}")
                    assert await ws.receive_str(timeout=30) == f"echo:hello {n}"
                blob = bytes(range(256)) * (3 * 4096)  # 3 MiB
                await ws.send_bytes(blob)
                assert await ws.receive_bytes(timeout=60) == blob
                assert plane.tunnels.open
            await until(lambda: not plane.tunnels.open, "the tunnel ended")

    run(scenario())
