"""The TLS port (gateway/proxy/tls.py, tls_sniff.py) over real sockets on loopback: real
clients (``ssl`` sockets, aiohttp's client, asyncio streams) against ``start_tls_server``
serving a tiny HTTP protocol, aiohttp's own low-level server, and the gateway's data
plane itself. Certificates are made here (tests/support/tls_pki.py's ``Pki``).

Each scenario runs on both event loops the gateway may run on: asyncio's own and uvloop
(what ``gateway serve`` runs; its transports are not ``asyncio.Transport`` subclasses).
Nothing here asserts a duration: waits are polls with generous limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import ssl
import threading
import warnings
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web
from cryptography import x509

from gateway.proxy.server import ClientConnection
from gateway.proxy.tls import (
    PASSPHRASE_ENV,
    TlsContextSource,
    TlsFiles,
    TlsStats,
    peer_subject,
    start_tls_server,
)
from tests.support.gateway import running_app, running_gateway
from tests.support.tls_pki import (
    Issued,
    Pki,
    client_context,
    key_pem,
    pem,
    swap_to,
    write_pair,
)
from tests.support.upstream import create_upstream_app

Runner = Callable[[Awaitable[Any]], Any]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}
PLAIN_BODY = {"detail": "this port speaks HTTPS; use https://"}


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


def serial_of(sock: ssl.SSLSocket | ssl.SSLObject) -> int:
    der = sock.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


# --- a tiny HTTP/1.1 server protocol: GET and Content-Length bodies, keep-alive


@dataclass
class Seen:
    """What the application protocols saw, across connections."""

    made: int = 0
    lost: int = 0
    data_while_paused: int = 0
    peers: list[Any] = field(default_factory=list)


class TinyHttp(asyncio.Protocol):
    """Answers each request with JSON: its path, body size, the TLS details the
    transport gives (ALPN, client subject, peer address)."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.seen.made += 1
        self.seen.peers.append(transport.get_extra_info("peername"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.seen.lost += 1

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, _, rest = self.buffer.partition(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            sslobj = self.transport.get_extra_info("ssl_object")
            answer = {
                "path": lines[0].split(" ")[1],
                "body": len(rest[:length]),
                "alpn": sslobj.selected_alpn_protocol() if sslobj is not None else None,
                "subject": peer_subject(self.transport),
                "peercert": self.transport.get_extra_info("peercert") is not None,
                "peer": list(self.transport.get_extra_info("peername")),
            }
            body = json.dumps(answer).encode()
            self.transport.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )


def request(sock: ssl.SSLSocket, path: str, body: bytes = b"") -> dict[str, Any]:
    """One request on an open (keep-alive) connection; the JSON answer."""
    head = f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the answer"
        data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    assert head_bytes.startswith(b"HTTP/1.1 200 "), head_bytes
    length = int(head_bytes.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    result: dict[str, Any] = json.loads(rest)
    return result


def connect(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    return context.wrap_socket(raw, server_hostname="localhost")


@dataclass
class Site:
    port: int
    source: TlsContextSource
    stats: TlsStats
    seen: Seen
    server: asyncio.Server


async def tiny_site(files: TlsFiles, **kwargs: Any) -> Site:
    source = TlsContextSource(files, env=kwargs.pop("env", None))
    stats, seen = TlsStats(), Seen()
    server = await start_tls_server(
        asyncio.get_running_loop(),
        lambda: TinyHttp(seen),
        source,
        "127.0.0.1",
        0,
        stats=stats,
        **kwargs,
    )
    port = server.sockets[0].getsockname()[1]
    return Site(port, source, stats, seen, server)


async def close(site: Site) -> None:
    site.server.close()
    await site.server.wait_closed()


def server_files(tmp_path: Path, pki: Pki, serial: int, **extra: Any) -> TlsFiles:
    cert, key = write_pair(tmp_path / f"srv-{serial}", pki.issue("gateway.test", serial=serial))
    return TlsFiles(cert=cert, key=key, **extra)


# --- handshake, request, ALPN, versions


def test_https_requests_through_aiohttp_server_and_client(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    """aiohttp's low-level web.Server as the protocol factory: a real HTTP server
    behind the TLS port, asked by aiohttp's client trusting the test CA."""

    async def handler(request: web.BaseRequest) -> web.Response:
        if request.path == "/big":
            return web.Response(body=b"z" * (4 * 1024 * 1024))
        body = await request.content.read()  # (read() stops at client_max_size, 1 MiB)
        return web.json_response(
            {
                "scheme": request.scheme,
                "secure": request.secure,
                "body": len(body),
                "subject": peer_subject(request.transport) if request.transport else None,
                "remote": request.remote,
            }
        )

    async def scenario() -> None:
        source = TlsContextSource(server_files(tmp_path, pki, 101))
        http = web.Server(handler)
        server = await start_tls_server(asyncio.get_running_loop(), http, source, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        connector = aiohttp.TCPConnector(ssl=client_context(pki), limit=2)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                for size in (0, 10, 3 * 1024 * 1024):
                    async with session.post(
                        f"https://localhost:{port}/x", data=io.BytesIO(os.urandom(size))
                    ) as response:
                        assert response.status == 200
                        got = await response.json()
                        assert got == {
                            "scheme": "https",
                            "secure": True,
                            "body": size,
                            "subject": None,
                            "remote": "127.0.0.1",
                        }
                # A large answer comes back whole.
                async with session.get(f"https://localhost:{port}/big") as response:
                    assert response.status == 200
                    assert await response.read() == b"z" * (4 * 1024 * 1024)
        finally:
            await http.shutdown(1)
            server.close()
            await server.wait_closed()

    run(scenario())


def test_alpn_is_http11_and_tls_1_1_is_refused(run: Runner, tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        site = await tiny_site(server_files(tmp_path, pki, 102))

        def modern() -> tuple[str | None, str | None, dict[str, Any]]:
            context = client_context(pki)
            context.set_alpn_protocols(["h2", "http/1.1"])
            with connect(site.port, context) as sock:
                return sock.selected_alpn_protocol(), sock.version(), request(sock, "/a")

        def tls11() -> str:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            context.load_verify_locations(cadata=pem(pki.ca.cert).decode())
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                context.minimum_version = ssl.TLSVersion.TLSv1_1
                context.maximum_version = ssl.TLSVersion.TLSv1_1
            # (this OpenSSL offers TLS 1.1 only at security level 0)
            context.set_ciphers("DEFAULT:@SECLEVEL=0")
            try:
                with connect(site.port, context):
                    return "handshake completed"
            except ssl.SSLError as exc:
                return str(exc)

        try:
            alpn, version, answer = await asyncio.to_thread(modern)
            assert alpn == "http/1.1" and answer["alpn"] == "http/1.1"
            assert version in ("TLSv1.2", "TLSv1.3")
            assert answer["path"] == "/a" and answer["peer"][0] == "127.0.0.1"
            refused = await asyncio.to_thread(tls11)
            # The server's protocol_version alert, not a client-side refusal to offer 1.1.
            assert "TLSV1_ALERT_PROTOCOL_VERSION" in refused, refused
            await until(lambda: site.stats.handshake_failures == 1, "the failure counted")

            # TLS 1.2 exactly is still served.
            def tls12() -> str | None:
                context = client_context(pki)
                context.maximum_version = ssl.TLSVersion.TLSv1_2
                with connect(site.port, context) as sock:
                    request(sock, "/b")
                    return sock.version()

            assert await asyncio.to_thread(tls12) == "TLSv1.2"
            assert site.stats.handshakes == 2
            await until(lambda: site.seen.lost == site.seen.made == 3, "all connections closed")
        finally:
            await close(site)

    run(scenario())


def test_a_bound_socket_and_reuse_port(run: Runner, tmp_path: Path, pki: Pki) -> None:
    """``sock=``: a socket bound beforehand (as a supervisor would); ``reuse_port``: two
    listeners on one port (as --workers runs them), both serving TLS."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        source = TlsContextSource(server_files(tmp_path, pki, 110))
        seen = Seen()
        bound = socket.create_server(("127.0.0.1", 0))
        bound.setblocking(False)
        first = await start_tls_server(loop, lambda: TinyHttp(seen), source, sock=bound)
        port = bound.getsockname()[1]
        shared = await start_tls_server(
            loop, lambda: TinyHttp(seen), source, "127.0.0.1", 0, reuse_port=True
        )
        shared_port = shared.sockets[0].getsockname()[1]
        second = await start_tls_server(
            loop, lambda: TinyHttp(seen), source, "127.0.0.1", shared_port, reuse_port=True
        )

        def ask(at: int) -> str:
            with connect(at, client_context(pki)) as sock:
                return str(request(sock, f"/{at}")["path"])

        try:
            assert await asyncio.to_thread(ask, port) == f"/{port}"
            for _ in range(4):
                assert await asyncio.to_thread(ask, shared_port) == f"/{shared_port}"
        finally:
            for server in (first, shared, second):
                server.close()
                await server.wait_closed()

    run(scenario())


# --- plain HTTP on the TLS port


def test_plain_http_gets_a_400_that_says_https(run: Runner, tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        site = await tiny_site(server_files(tmp_path, pki, 103))

        def raw_http() -> bytes:
            with socket.create_connection(("127.0.0.1", site.port), timeout=30) as sock:
                sock.sendall(b"GET /v1/things HTTP/1.1\r\nHost: gw\r\n\r\n")
                data = b""
                while chunk := sock.recv(65536):
                    data += chunk
                return data

        try:
            answer = await asyncio.to_thread(raw_http)
            head, _, body = answer.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            assert lines[0] == "HTTP/1.1 400 Bad Request"
            headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
            assert headers["content-type"] == "application/json"
            assert headers["connection"] == "close"
            assert int(headers["content-length"]) == len(body)
            assert json.loads(body) == PLAIN_BODY
            # aiohttp's client told http:// reads the same answer.
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{site.port}/x") as response:
                    assert response.status == 400
                    assert await response.json() == PLAIN_BODY
            assert site.stats.plain_http == 2 and site.stats.handshakes == 0
            # The application protocol saw both connections come and go, and no request.
            await until(lambda: site.seen.lost == 2, "both connections closed")
            assert site.seen.made == 2

            # The port still speaks TLS.
            def tls() -> dict[str, Any]:
                with connect(site.port, client_context(pki)) as sock:
                    return request(sock, "/after")

            assert (await asyncio.to_thread(tls))["path"] == "/after"
        finally:
            await close(site)

    run(scenario())


# --- client certificates


def test_a_required_client_certificate(run: Runner, tmp_path: Path, pki: Pki, clients: Pki) -> None:
    async def scenario() -> None:
        ca = clients.write_ca(tmp_path / "clients.pem")
        site = await tiny_site(
            server_files(tmp_path, pki, 104, client_ca=ca, client_auth="required")
        )
        alice = clients.issue("alice", server=False)

        def with_cert(issued: Issued, where: str) -> dict[str, Any]:
            with connect(site.port, client_context(pki, issued, tmp_path / where)) as sock:
                return request(sock, "/me")

        def without_cert() -> str:
            try:
                with connect(site.port, client_context(pki)) as sock:
                    # TLS 1.3: the refusal arrives as an alert after the client's side of
                    # the handshake; a request shows it.
                    return json.dumps(request(sock, "/me"))
            except (ssl.SSLError, ConnectionError, AssertionError) as exc:
                return f"refused: {exc}"

        try:
            answer = await asyncio.to_thread(with_cert, alice, "alice")
            assert answer["subject"] == "CN=alice,O=Gateway Tests"
            assert answer["peercert"] is True
            refused = await asyncio.to_thread(without_cert)
            assert refused.startswith("refused:"), refused
            # A certificate of another CA (the server's own) is refused too.
            stranger = pki.issue("mallory", server=False)
            with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
                await asyncio.to_thread(with_cert, stranger, "mallory")
            await until(lambda: site.stats.handshake_failures == 2, "both refusals counted")
        finally:
            await close(site)

    run(scenario())


def test_an_optional_client_certificate(
    run: Runner, tmp_path: Path, pki: Pki, clients: Pki
) -> None:
    async def scenario() -> None:
        ca = clients.write_ca(tmp_path / "clients.pem")
        site = await tiny_site(
            server_files(tmp_path, pki, 105, client_ca=ca, client_auth="optional")
        )
        bob = clients.issue("bob", server=False)

        def ask(context: ssl.SSLContext) -> dict[str, Any]:
            with connect(site.port, context) as sock:
                return request(sock, "/me")

        try:
            anonymous = await asyncio.to_thread(ask, client_context(pki))
            assert anonymous["subject"] is None and anonymous["peercert"] is False
            known = await asyncio.to_thread(ask, client_context(pki, bob, tmp_path / "bob"))
            assert known["subject"] == "CN=bob,O=Gateway Tests" and known["peercert"] is True
            # aiohttp's client with a client certificate.
            context = client_context(pki, bob, tmp_path / "bob2")
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context)
            ) as session:
                async with session.post(f"https://localhost:{site.port}/x", data=b"hi") as r:
                    assert (await r.json())["subject"] == "CN=bob,O=Gateway Tests"
        finally:
            await close(site)

    run(scenario())


# --- rotation


def test_rotation_serves_new_connections_the_new_pair_and_keeps_open_ones(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        live = tmp_path / "live"
        write_pair(tmp_path / "v1", pki.issue("gateway.test", serial=0x111))
        swap_to(live, tmp_path / "v1")
        files = TlsFiles(cert=str(live / "tls.crt"), key=str(live / "tls.key"))
        outcomes: list[tuple[bool, str]] = []
        source = TlsContextSource(files, on_reload=lambda ok, d: outcomes.append((ok, d)))
        seen = Seen()
        server = await start_tls_server(
            asyncio.get_running_loop(), lambda: TinyHttp(seen), source, "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        watcher = asyncio.create_task(source.watch(0.05))
        stop = threading.Event()
        kept: dict[str, Any] = {"answers": 0, "errors": [], "serials": set()}

        def keep_asking() -> None:
            # One connection, open across the rotation, asking all the time.
            with connect(port, client_context(pki)) as sock:
                kept["serials"].add(serial_of(sock))
                while not stop.is_set() or kept["answers"] < 50:
                    try:
                        answer = request(sock, f"/kept/{kept['answers']}", b"x" * 100)
                        assert answer["body"] == 100
                        kept["answers"] += 1
                    except Exception as exc:
                        kept["errors"].append(repr(exc))
                        return
                    kept["serials"].add(serial_of(sock))

        def new_connection_serial() -> int:
            with connect(port, client_context(pki)) as sock:
                request(sock, "/new")
                return serial_of(sock)

        try:
            asker = asyncio.create_task(asyncio.to_thread(keep_asking))
            await until(lambda: kept["answers"] >= 5, "the kept connection answered")
            assert await asyncio.to_thread(new_connection_serial) == 0x111
            write_pair(tmp_path / "v2", pki.issue("gateway.test", serial=0x222))
            swap_to(live, tmp_path / "v2")
            # New connections see the new certificate once the watcher has read it.
            serials: list[int] = []
            for _ in range(600):
                serials.append(await asyncio.to_thread(new_connection_serial))
                if serials[-1] == 0x222:
                    break
                await asyncio.sleep(0.02)
            assert serials[-1] == 0x222 and set(serials) <= {0x111, 0x222}
            answered = kept["answers"]
            await until(lambda: kept["answers"] >= answered + 20, "the kept connection goes on")
            stop.set()
            await asker
            assert kept["errors"] == []
            assert kept["serials"] == {0x111}  # the open connection kept its certificate
            assert outcomes == [(True, "serial 222")]
            assert source.serial() == 0x222
        finally:
            stop.set()
            watcher.cancel()
            server.close()
            await server.wait_closed()

    run(scenario())


def test_a_bad_pair_is_refused_and_the_old_one_still_served(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        directory = tmp_path / "certs"
        good = pki.issue("gateway.test", serial=0x333)
        write_pair(directory, good)
        files = TlsFiles(cert=str(directory / "tls.crt"), key=str(directory / "tls.key"))
        outcomes: list[tuple[bool, str]] = []
        source = TlsContextSource(files, on_reload=lambda ok, d: outcomes.append((ok, d)))
        seen = Seen()
        server = await start_tls_server(
            asyncio.get_running_loop(), lambda: TinyHttp(seen), source, "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        watcher = asyncio.create_task(source.watch(0.05))

        def served() -> int:
            with connect(port, client_context(pki)) as sock:
                request(sock, "/")
                return serial_of(sock)

        async def refused(expected: str) -> None:
            # (the watcher may also see a step in between: a write of each file)
            count = len(outcomes)
            await until(
                lambda: any(not ok and expected in d for ok, d in outcomes[count:]),
                f"the reload refused ({expected})",
            )
            assert source.last_error is not None and expected in source.last_error
            assert source.serial() == 0x333
            assert await asyncio.to_thread(served) == 0x333

        try:
            newer = pki.issue("gateway.test", serial=0x444)
            cert_file, key_file = Path(files.cert), Path(files.key)
            # A key of another certificate.
            key_file.write_bytes(key_pem(pki.issue("other").key))
            await refused("does not belong to the certificate")
            # A garbage certificate file.
            key_file.write_bytes(key_pem(good.key))
            cert_file.write_bytes(b"garbage\n")
            await refused("holds no readable PEM certificate")
            # Half of the new certificate (a copy still under way), its key in place.
            key_file.write_bytes(key_pem(newer.key))
            whole = pem(newer.cert)
            cert_file.write_bytes(whole[: len(whole) // 2])
            await refused("holds no readable PEM certificate")
            assert source.reload_failures >= 3
            # The copy completes: in force at the next check.
            cert_file.write_bytes(whole)
            await until(lambda: source.serial() == 0x444, "the completed pair in force")
            assert outcomes[-1] == (True, "serial 444") and source.last_error is None
            assert await asyncio.to_thread(served) == 0x444
        finally:
            watcher.cancel()
            server.close()
            await server.wait_closed()

    run(scenario())


def test_an_encrypted_key_with_its_passphrase_from_the_environment(
    run: Runner, tmp_path: Path, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSPHRASE_ENV, "s3cret passphrase")
    cert, key = write_pair(
        tmp_path / "enc", pki.issue("gateway.test", serial=0x555), b"s3cret passphrase"
    )
    files = TlsFiles(cert=cert, key=key, passphrase_env=PASSPHRASE_ENV)

    async def scenario() -> None:
        site = await tiny_site(files)

        def ask() -> int:
            with connect(site.port, client_context(pki)) as sock:
                request(sock, "/")
                return serial_of(sock)

        try:
            assert await asyncio.to_thread(ask) == 0x555
        finally:
            await close(site)

    run(scenario())


# --- deadlines and the application protocol's view


def test_a_stalled_handshake_times_out_and_a_silent_client_is_the_apps(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    async def scenario() -> None:
        site = await tiny_site(server_files(tmp_path, pki, 106), ssl_handshake_timeout=0.2)

        def stalled() -> bytes:
            with socket.create_connection(("127.0.0.1", site.port), timeout=30) as sock:
                sock.sendall(b"\x16\x03\x01\x00")  # the start of a ClientHello, no more
                try:
                    return sock.recv(100)
                except ConnectionResetError:
                    return b"reset"

        try:
            assert await asyncio.to_thread(stalled) in (b"", b"reset")
            assert site.stats.handshake_timeouts == 1
            await until(lambda: site.seen.lost == 1, "the app told the connection ended")
            # A client that sends nothing: the app has it at once (its own deadlines
            # apply), and no handshake deadline runs before the first byte.
            _, writer = await asyncio.open_connection("127.0.0.1", site.port)
            await until(lambda: site.seen.made == 2, "the app told of the silent client")
            # (three handshake timeouts later it is still open: no deadline of ours ran)
            await asyncio.sleep(0.6)
            assert site.seen.lost == 1 and site.stats.handshake_timeouts == 1
            writer.close()
            await until(lambda: site.seen.lost == 2, "the silent client gone")
        finally:
            await close(site)

    run(scenario())


class Pausing(asyncio.Protocol):
    """Pauses reading after each read and resumes soon after; collects every byte,
    noting any delivered while paused. Writes ``reply_size`` bytes on request, noting
    pause_writing / resume_writing."""

    def __init__(self, seen: Seen, reply_size: int) -> None:
        self.seen = seen
        self.reply_size = reply_size
        self.paused = False
        self.received = bytearray()
        self.writing_paused = 0
        self.writing_resumed = 0
        self.transport: asyncio.Transport | None = None
        self.max_buffered = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.seen.peers.append(self)
        transport.set_write_buffer_limits(high=64 * 1024)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.paused:
            self.seen.data_while_paused += 1
        self.received += data
        if self.received.endswith(b"SEND"):
            self.transport.write(b"y" * self.reply_size)
            self.max_buffered = self.transport.get_write_buffer_size()
            return
        self.paused = True
        self.transport.pause_reading()
        assert not self.transport.is_reading()
        asyncio.get_running_loop().call_later(0.001, self.resume)

    def resume(self) -> None:
        assert self.transport is not None
        self.paused = False
        self.transport.resume_reading()

    def pause_writing(self) -> None:
        self.writing_paused += 1

    def resume_writing(self) -> None:
        self.writing_resumed += 1


def test_flow_control_both_ways(run: Runner, tmp_path: Path, pki: Pki) -> None:
    async def scenario() -> None:
        source = TlsContextSource(server_files(tmp_path, pki, 107))
        seen = Seen()
        reply = 32 * 1024 * 1024  # more than loopback's socket buffers can hold
        server = await start_tls_server(
            asyncio.get_running_loop(), lambda: Pausing(seen, reply), source, "127.0.0.1", 0
        )
        port = server.sockets[0].getsockname()[1]
        upload = os.urandom(4 * 1024 * 1024)
        try:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_context(pki), server_hostname="localhost"
            )
            writer.write(upload)
            await writer.drain()
            await until(lambda: bool(seen.peers), "connected")
            app: Pausing = seen.peers[0]
            await until(lambda: len(app.received) == len(upload), "the whole upload read")
            assert bytes(app.received) == upload  # in order, nothing lost or doubled
            assert seen.data_while_paused == 0
            # The answer is larger than the write buffer: the app is told to pause
            # writing, and to resume once the client has read enough.
            writer.write(b"SEND")
            await writer.drain()
            await until(lambda: app.writing_paused == 1, "pause_writing")
            assert app.max_buffered >= 64 * 1024
            got = await reader.readexactly(reply)
            assert got == b"y" * reply
            await until(lambda: app.writing_resumed == 1, "resume_writing")
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    run(scenario())


class PausedFromTheStart(asyncio.Protocol):
    """Pauses reading as soon as it is connected (before the handshake is done), and
    again after each read; the test resumes it. Records what it reads, and the EOF."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen
        self.paused = True
        self.received = b""
        self.eof = 0
        self.lost = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.pause_reading()  # type: ignore[attr-defined]
        self.seen.peers.append(self)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.paused:
            self.seen.data_while_paused += 1
        self.received += data
        self.paused = True
        self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        if self.paused:
            self.seen.data_while_paused += 1
        self.eof += 1
        return None  # the connection closes

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True

    def resume(self) -> None:
        assert self.transport is not None
        self.paused = False
        self.transport.resume_reading()


def test_what_arrives_with_the_handshake_waits_for_resume_reading(
    run: Runner, tmp_path: Path, pki: Pki
) -> None:
    """A client's request (and its close_notify) in the same packet as its last
    handshake message, to an app that paused reading: none of it is delivered while
    paused, all of it once it resumes, though nothing more arrives; the EOF (read with
    it) only once the app, paused again by that read, resumes again."""

    async def scenario() -> None:
        source = TlsContextSource(server_files(tmp_path, pki, 109))
        seen, stats = Seen(), TlsStats()
        server = await start_tls_server(
            asyncio.get_running_loop(),
            lambda: PausedFromTheStart(seen),
            source,
            "127.0.0.1",
            0,
            stats=stats,
        )
        port = server.sockets[0].getsockname()[1]
        payload = os.urandom(20_000)
        done = threading.Event()

        def client() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                tls = client_context(pki).wrap_bio(incoming, outgoing, server_hostname="localhost")
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        sock.sendall(outgoing.read())
                        incoming.write(sock.recv(65536))
                tls.write(payload)
                with contextlib.suppress(ssl.SSLWantReadError):
                    tls.unwrap()  # (ours goes out; the server's is not waited for)
                sock.sendall(outgoing.read())  # Finished, the request, close_notify: one write
                done.wait(60)  # the socket stays open: nothing more arrives

        thread = asyncio.create_task(asyncio.to_thread(client))
        try:
            await until(lambda: stats.handshakes == 1, "the handshake")
            app: PausedFromTheStart = seen.peers[0]
            await asyncio.sleep(0.2)  # (let whatever is in flight arrive; nothing may be read)
            assert app.received == b"" and app.eof == 0
            app.resume()
            await until(lambda: app.received == payload, "the data")
            assert app.eof == 0  # (paused by that read)
            app.resume()
            await until(lambda: app.eof == 1, "the EOF after the data")
            assert app.received == payload and seen.data_while_paused == 0
            await until(lambda: app.lost, "closed after the EOF")
        finally:
            done.set()
            await thread
            server.close()
            await server.wait_closed()

    run(scenario())


# --- the gateway's own data plane behind the TLS port


def half_closing_client(port: int, pki: Pki, target: bytes = b"/half") -> bytes:
    """Send one request, then close_notify and the TCP FIN; read the answer till EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = client_context(pki).wrap_bio(incoming, outgoing, server_hostname="localhost")
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                incoming.write(sock.recv(65536))
        tls.write(b"GET " + target + b" HTTP/1.1\r\nHost: gw\r\n\r\n")
        with contextlib.suppress(ssl.SSLWantReadError):
            tls.unwrap()
        sock.sendall(outgoing.read())
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            data = sock.recv(65536)
            if data:
                incoming.write(data)
            else:
                incoming.write_eof()
            try:
                while chunk := tls.read(65536):
                    answer += chunk
                return answer  # the server's close_notify
            except ssl.SSLWantReadError:
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):  # close_notify, or just EOF
                return answer


def test_the_gateway_data_plane_serves_https(run: Runner, tmp_path: Path, pki: Pki) -> None:
    """``ClientConnection`` (what DataPlane.start serves) behind start_tls_server, as the
    gateway will run it: proxied requests, a large upload and answer, pipelining, the
    gateway's own error answer with its lingering close, and plain HTTP."""

    async def scenario() -> None:
        source = TlsContextSource(server_files(tmp_path, pki, 108))
        async with (
            running_app(create_upstream_app()) as upstream,
            running_gateway(upstream) as gw,
        ):
            plane = gw.proxy.plane
            assert plane is not None
            server = await start_tls_server(
                asyncio.get_running_loop(),
                lambda: ClientConnection(plane),
                source,
                "127.0.0.1",
                0,
            )
            port = server.sockets[0].getsockname()[1]
            try:
                connector = aiohttp.TCPConnector(ssl=client_context(pki))
                async with aiohttp.ClientSession(connector=connector) as session:
                    url = f"https://localhost:{port}"
                    async with session.get(f"{url}/anything?x=1") as response:
                        assert response.status == 200, await response.text()
                        assert (await response.json())["path"] == "/anything?x=1"
                    body = os.urandom(5 * 1024 * 1024)
                    async with session.post(f"{url}/upload", data=io.BytesIO(body)) as response:
                        assert response.status == 200
                        assert (await response.json()) == {"received": len(body)}
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=client_context(pki), server_hostname="localhost"
                )
                # Pipelined: three requests in one write, answered in order.
                writer.write(
                    b"".join(b"GET /p/%d HTTP/1.1\r\nHost: gw\r\n\r\n" % n for n in range(3))
                )
                for n in range(3):
                    head = await reader.readuntil(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200"), head
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    assert json.loads(await reader.readexactly(length))["path"] == f"/p/{n}"
                # A malformed request: the gateway's 400, then its lingering close (over
                # TLS: close_notify, then the connection ends).
                writer.write(b"GET / HTTP/1.1\r\nHost: gw\r\nBad Header\r\n\r\n")
                rest = await reader.read()
                assert rest.startswith(b"HTTP/1.1 400 "), rest
                assert b"malformed HTTP request" in rest
                writer.close()

                # A client that half-closes (close_notify and FIN) after its request still
                # reads the answer, as on plain TCP: proxied, and answered by the gateway
                # itself in the read that also brings the end (written before the TLS
                # transport closes itself: batched_writes).
                for target in (b"/half", b"/ok"):
                    answer = await asyncio.to_thread(half_closing_client, port, pki, target)
                    assert answer.startswith(b"HTTP/1.1 200 "), (target, answer)

                # Plain HTTP to the TLS port.
                async with aiohttp.ClientSession() as session:
                    async with session.get(f"http://127.0.0.1:{port}/anything") as response:
                        assert response.status == 400
                        assert await response.json() == PLAIN_BODY
                await until(lambda: not plane.connections, "every connection closed")
            finally:
                server.close()
                await server.wait_closed()

    run(scenario())
