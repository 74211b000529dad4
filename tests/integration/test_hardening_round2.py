"""Hardening, second round (issue 24): findings 1, 2, 3, 6 and 7, each as an attacker
would try it. Fairness is checked with clients bound to different loopback source
addresses: 127.0.0.2 attacks, 127.0.0.3 must still be served."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import string
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.fuzz import fuzz
from tests.support.gateway import GatewayProcess, running_app, running_gateway
from tests.support.upstream import create_upstream_app

ATTACKER = "127.0.0.2"
SERVED = "127.0.0.3"


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _connect(port: int, source: str = "127.0.0.1"):
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def _request(port: int, data: bytes, source: str = "127.0.0.1") -> bytes:
    reader, writer = await _connect(port, source)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def _split(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def _remaining(headers: dict[str, str]) -> tuple[str, int]:
    """(policy name, r) from a RateLimit field."""
    name, _, rest = headers["ratelimit"].partition(";")
    params = dict(p.split("=", 1) for p in rest.split(";"))
    return name, int(params["r"])


# --- finding 1: whitespace around an identity is not a fresh quota

WHITESPACE = st.text(alphabet=" \t", max_size=4)
KEY = st.text(alphabet=string.ascii_letters + string.digits + "-_.~+/=", min_size=1, max_size=24)


@fuzz(30)
@given(
    key=KEY,
    left=WHITESPACE,
    right=WHITESPACE.filter(bool),
    header=st.sampled_from(["x-api-key", "x-user-id"]),
)
def test_padded_identity_is_the_same_identity_the_upstream_reads(key, left, right, header):
    """For any SP/HTAB padding, the counter key is the unpadded identity's (the two
    requests share one bucket) and the forwarded value is what aiohttp's server reads
    from the client's own bytes."""

    async def check() -> None:
        async with running_app(create_upstream_app()) as upstream_url:
            async with running_gateway(upstream_url) as gw:
                plain = f"{header}: {key}".encode()
                padded = f"{header}:{left}{key}{right}".encode()

                def request(field: bytes) -> bytes:
                    start = b"GET /x HTTP/1.1\r\nHost: a\r\n"
                    return start + field + b"\r\nConnection: close\r\n\r\n"

                status0, headers0, _ = _split(await _request(_port(gw), request(plain)))
                status1, headers1, body1 = _split(await _request(_port(gw), request(padded)))
                assert status0 == status1 == 200
                name0, r0 = _remaining(headers0)
                name1, r1 = _remaining(headers1)
                assert name0 == name1 and r1 == r0 - 1, (headers0, headers1)
                forwarded = json.loads(body1)["headers"]
                upstream_port = int(upstream_url.rsplit(":", 1)[1])
                _, _, direct = _split(await _request(upstream_port, request(padded)))
                reference = json.loads(direct)["headers"]
                assert forwarded[header] == reference[header] == key

    asyncio.run(check())


async def test_padded_host_selects_its_region(tmp_path, upstream):
    config = tmp_path / "gateway.yaml"
    config.write_text("regions:\n  us: {}\n  eu: {hosts: [eu.example]}\n")
    async with running_gateway(upstream, config_file=str(config)) as gw:
        for host in (b"eu.example", b"eu.example \t", b"eu.example\t\t"):
            reply = await _request(
                _port(gw),
                b"GET /runs/stats HTTP/1.1\r\nHost: " + host + b"\r\nx-api-key: k\r\n"
                b"Connection: close\r\n\r\n",
            )
            status, headers, _ = _split(reply)
            assert status == 200
            # runs-stats: us 1/10, eu 20/10: the eu limit applies to every spelling
            assert headers["ratelimit-policy"].split(", ")[0] == '"runs-stats";q=20;w=10', (
                host,
                headers,
            )


# --- finding 2: CPU per body byte is bounded


def _tiny_chunk_attack(port: int, result: dict[str, bytes]) -> None:
    with socket.create_connection(("127.0.0.1", port), source_address=(ATTACKER, 0)) as sock:
        sock.sendall(b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"1\r\nx\r\n" * 50_000  # 300 KB of 1-byte chunks per write, 12 MB in all
        try:
            for _ in range(40):
                sock.sendall(block)
        except OSError:
            pass  # refused and closed: expected
        sock.settimeout(10)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except OSError:
            pass
        result["reply"] = data


def _ok_latency(port: int) -> float:
    """Seconds for one GET /ok on a connection of its own, from the served address."""
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=10,
                                  source_address=(SERVED, 0)) as sock:  # fmt: skip
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        reply = sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    return time.perf_counter() - started


def test_tiny_chunks_neither_freeze_others_nor_pass(tmp_path, upstream_process):
    """A body of 1-byte chunks used to cost ~4 us of gateway CPU per chunk on the event
    loop: 2 M of them froze every client for seconds. It is refused once its chunks are
    absurdly small for their number, and /ok on another connection stays fast."""
    gateway = GatewayProcess(
        ["--upstream", upstream_process, "--no-embedded", "--access-log", "off"],
        log_path=tmp_path / "gateway.log",
    ).wait_ready()
    try:
        # "Fast" is also against this machine's own /ok latency without the attack.
        baseline = statistics.median(_ok_latency(gateway.port) for _ in range(30))
        result: dict[str, bytes] = {}
        attacker = threading.Thread(target=_tiny_chunk_attack, args=(gateway.port, result))
        attacker.start()
        latencies = []
        while attacker.is_alive() and len(latencies) < 200:
            latencies.append(_ok_latency(gateway.port))
        attacker.join(30)
        assert result["reply"].startswith(b"HTTP/1.1 400"), result["reply"][:200]
        assert b"send larger chunks" in result["reply"]
        # A frozen loop costs every request seconds. The bound: 5x the median without the
        # attack, and at least 500 ms, as the few /ok measured while the attack lasts
        # share a slow machine's CPU with it (a fixed 50 ms failed on a loaded CI VM).
        assert latencies, "the attack ended before any /ok was measured"
        assert statistics.median(latencies) < max(0.5, 5 * baseline), (baseline, latencies)
    finally:
        gateway.stop()


@pytest.fixture
def upstream_process(tmp_path):
    """The echo upstream in a process of its own (the gateway under test is one too)."""
    import subprocess
    import sys

    from tests.support.gateway import free_port

    port = free_port()
    code = (
        "import sys; from aiohttp import web; sys.path.insert(0, '.');"
        "from tests.support.upstream import create_upstream_app;"
        f"web.run_app(create_upstream_app(), host='127.0.0.1', port={port}, print=None)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


async def test_a_small_chunk_stream_below_the_bound_is_forwarded(upstream):
    """Chunks averaging 64 bytes or more pass, however many."""
    async with running_gateway(upstream) as gw:
        chunk = b"40\r\n" + b"y" * 64 + b"\r\n"
        body = chunk * 5000 + b"0\r\n\r\n"
        reply = await _request(
            _port(gw),
            b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + body,
        )
        status, _, payload = _split(reply)
        assert status == 200 and json.loads(payload)["received"] == 64 * 5000


# --- finding 3: one address can neither lock out nor starve the others


async def test_one_address_cannot_take_every_connection(upstream):
    async with running_gateway(upstream, max_connections=64) as gw:
        port = _port(gw)
        held = [await _connect(port, ATTACKER) for _ in range(64)]
        try:
            # 64 // 8 = 8 stay open; the others were closed at once
            closed = 0
            for reader, _ in held:
                try:
                    if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                        closed += 1
                except TimeoutError:
                    pass
                except ConnectionError:
                    closed += 1
            assert closed == 56
            probe = b"GET /ok HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
            status, _, _ = _split(await _request(port, probe, SERVED))
            assert status == 200
        finally:
            for _, writer in held:
                writer.close()


async def test_a_silent_socket_is_closed_after_the_head_deadline(upstream):
    async with running_gateway(upstream, header_timeout=0.3, client_idle_timeout=60) as gw:
        reader, writer = await _connect(_port(gw), ATTACKER)
        try:
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing said
        finally:
            writer.close()


async def test_unread_downloads_cannot_starve_the_pool(upstream):
    """Requests for streamed answers that are never read hold an upstream connection
    each; one address gets at most max_downloads_per_client of them."""
    async with running_gateway(
        upstream, upstream_pool_size=6, max_downloads_per_client=3, upstream_timeout=3
    ) as gw:
        port = _port(gw)
        attack = b"GET /ticks?n=10000&every=0.05 HTTP/1.1\r\nHost: a\r\n\r\n"
        streams, statuses = [], []
        for _ in range(8):
            reader, writer = await _connect(port, ATTACKER)
            writer.write(attack)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            statuses.append(int(head.split()[1]))
            streams.append(writer)
            await asyncio.sleep(0.15)  # the answer is streaming by now
        try:
            assert statuses == [200, 200, 200, 429, 429, 429, 429, 429], statuses
            reply = await _request(
                port, b"GET /ticks?n=1&every=0 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
                SERVED,
            )  # fmt: skip
            assert reply.startswith(b"HTTP/1.1 200") and b"tick" in reply, reply[:200]
        finally:
            for writer in streams:
                writer.close()


# --- finding 6: method override headers


@pytest.mark.parametrize("name", ["X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override"])
async def test_method_override_is_dropped_by_default(upstream, name):
    async with running_gateway(upstream) as gw:
        reply = await _request(
            _port(gw),
            b"POST /sessions/x HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n" + name.encode()
            + b": DELETE\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )  # fmt: skip
        status, headers, body = _split(reply)
        assert status == 200
        assert headers["ratelimit-policy"].startswith('"default-api-key"')
        seen = {k.lower() for k in json.loads(body)["headers"]}
        assert name.lower() not in seen


async def test_a_kept_method_override_chooses_the_rule(upstream):
    async with running_gateway(upstream, keep_method_override=True) as gw:
        request = (
            b"POST /sessions/x HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n"
            b"X-HTTP-Method-Override: delete\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        )
        status, headers, body = _split(await _request(_port(gw), request))
        assert status == 200
        assert headers["ratelimit-policy"].split(", ")[0] == '"deletion-api-key";q=10;w=60'
        assert json.loads(body)["headers"]["X-HTTP-Method-Override"] == "delete"
        bad = request.replace(b"delete", b"BREW")
        status, _, body = _split(await _request(_port(gw), bad))
        assert status == 400 and b"names no method" in body


# --- finding 7: one head bound, whatever the read sizes


@pytest.mark.parametrize("write_size", [None, 4096])
async def test_the_head_bound_holds_whatever_the_reads(upstream, write_size):
    fields = b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 7900) for n in range(14))  # ~110 KB
    request = b"GET /x HTTP/1.1\r\nHost: a\r\n" + fields + b"Connection: close\r\n\r\n"
    async with running_gateway(upstream) as gw:
        reader, writer = await _connect(_port(gw))
        step = write_size or len(request)
        for start in range(0, len(request), step):
            writer.write(request[start : start + step])
        await writer.drain()
        reply = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert reply.startswith(b"HTTP/1.1 431"), reply[:120]


async def test_the_download_count_matches_the_answers_holding_a_slot(upstream):
    """Answers that start streaming together past the cap (the check comes before any
    of them streams) are not counted, and never release slots others hold."""
    async with running_gateway(upstream, max_downloads_per_client=3) as gw:
        port, plane = _port(gw), gw.proxy.plane
        attack = b"GET /ticks?n=10000&every=0.05 HTTP/1.1\r\nHost: a\r\n\r\n"
        streams = []
        for _ in range(6):  # sent together: all pass the check before any streams
            reader, writer = await _connect(port, ATTACKER)
            writer.write(attack)
            streams.append((reader, writer))
        for reader, _ in streams:
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.sleep(0.3)

        def holding() -> int:
            return sum(
                1
                for conn in plane.connections
                if conn.active is not None and conn.active.download_client is not None
            )

        assert plane.downloads.get(ATTACKER, 0) == holding() <= 3
        for _, writer in streams[:3]:
            writer.close()
        await asyncio.sleep(0.3)
        assert plane.downloads.get(ATTACKER, 0) == holding()
        for _, writer in streams[3:]:
            writer.close()
        await asyncio.sleep(0.3)
        assert plane.downloads == {}
