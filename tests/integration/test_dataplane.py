"""The proxy port's connection handling (gateway/proxy/server.py), over real sockets:
pipelining, framing both ways, HEAD, 100-continue, keep-alive reuse, deadlines, the
connection cap, and small bodies that never hold an upstream connection."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from tests.support.gateway import running_app, running_gateway


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _read_responses(reader: asyncio.StreamReader, count: int) -> list[tuple[int, bytes]]:
    """Read ``count`` Content-Length-framed responses; (status, body) each."""
    out = []
    for _ in range(count):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        body = await asyncio.wait_for(reader.readexactly(length), 10) if length else b""
        out.append((status, body))
    return out


async def test_pipelined_requests_are_answered_in_order(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        # a proxied request, a gateway answer, a refusal, another proxied one: one write
        writer.write(
            b"GET /echo/1 HTTP/1.1\r\nHost: a\r\n\r\n"
            b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n"
            b"GET /a;b HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /echo/4 HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"
        )
        await writer.drain()
        replies = await _read_responses(reader, 4)
        writer.close()
    assert [status for status, _ in replies] == [200, 200, 400, 200]
    assert json.loads(replies[0][1])["path"] == "/echo/1"
    assert json.loads(replies[1][1]) == {"ok": True}
    assert json.loads(replies[3][1])["path"] == "/echo/4"
    assert json.loads(replies[3][1])["body_length"] == 3


async def test_a_malformed_request_after_good_ones_is_answered_last(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"GET /echo/1 HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n")
        await writer.drain()
        replies = await _read_responses(reader, 2)
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then the connection closes
        writer.close()
    assert replies[0][0] == 200
    assert replies[1][0] == 400 and b"malformed HTTP request" in replies[1][1]


async def _app_upstream(routes):
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return running_app(app)


async def test_chunked_and_close_delimited_responses_reach_the_client_whole(upstream):
    body = b"".join(b"line %d\n" % n for n in range(2000))

    async def close_delimited(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        for n in range(0, len(body), 1000):
            writer.write(body[n : n + 1000])
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(close_delimited, "127.0.0.1", 0)
    raw_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_gateway(raw_url) as gw, aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/x") as r:
                assert r.status == 200
                assert r.headers.get("Transfer-Encoding") == "chunked"  # re-framed for 1.1
                assert await r.read() == body
            # an HTTP/1.0 client gets the body delimited by the close, as it expects
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
            writer.write(b"GET /x HTTP/1.0\r\n\r\n")
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            head, _, rest = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
            assert rest == body
    finally:
        server.close()


async def test_head_and_no_content_responses_carry_no_body_and_keep_the_connection(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(
            b"HEAD /echo HTTP/1.1\r\nHost: a\r\n\r\nGET /echo/after HTTP/1.1\r\nHost: a\r\n\r\n"
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200")
        assert b"Content-Length:" in head  # the length of the body a GET would get
        # the next bytes are the second response, not a body of the first
        ((status, body),) = await _read_responses(reader, 1)
        writer.close()
    assert status == 200 and json.loads(body)["path"] == "/echo/after"


async def test_expect_100_continue_is_answered_after_the_decision(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"
        )
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        ((status, body),) = await _read_responses(reader, 1)
        writer.close()
    assert status == 200 and json.loads(body)["body_length"] == 5
    # The expectation was met here: the upstream is not asked to meet it again.
    assert "expect" not in {k.lower() for k in json.loads(body)["headers"]}


async def test_upstream_connections_are_reused(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for _ in range(20):
            async with http.get(gw.url + "/echo") as r:
                assert r.status == 200
        assert gw.proxy.plane is not None
        assert gw.proxy.plane.pool.open == 1  # one keep-alive connection served them all


async def test_a_stale_keep_alive_connection_is_retried_once(upstream):
    """The upstream closes an idle connection; the next request must not see a 502."""
    hits = 0

    async def closing(reader, writer):
        nonlocal hits
        await reader.readuntil(b"\r\n\r\n")
        hits += 1
        # Keep-alive promised, then the connection is closed right after the answer.
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_gateway(url) as gw, aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.get(gw.url + "/x") as r:
                    assert r.status == 200 and await r.read() == b"ok"
                await asyncio.sleep(0.05)
        assert hits == 5
    finally:
        server.close()


async def test_headers_that_never_complete_get_408_and_the_connection_closes(upstream):
    async with running_gateway(upstream, header_timeout=0.3) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\nX-Slow: ")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert data.startswith(b"HTTP/1.1 408")
    assert b"did not arrive in time" in data


async def test_a_stalled_body_gets_408(upstream):
    async with running_gateway(upstream, body_read_timeout=0.3) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nabc")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert data.startswith(b"HTTP/1.1 408") and b"stalled" in data


async def test_connections_over_the_cap_are_closed_and_others_still_served(upstream):
    async with running_gateway(upstream, max_connections=5) as gw:
        held = [await asyncio.open_connection("127.0.0.1", _port(gw)) for _ in range(5)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n")
        refused = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        assert refused == b""  # closed without an answer
        assert gw.proxy.plane is not None and gw.proxy.plane.refused >= 1
        for _, w in held:
            w.close()
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/ok") as r:
                assert r.status == 200


async def test_trickled_small_bodies_hold_no_upstream_connection(upstream):
    """Slow-body starvation: clients trickling small bodies must not take the upstream
    pool; everyone else is still served at once."""
    async with running_gateway(upstream, upstream_pool_size=4) as gw:
        slow = []
        for n in range(12):
            _, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
            writer.write(
                f"POST /upload HTTP/1.1\r\nHost: a\r\nx-api-key: slow-{n}\r\n"
                "Content-Length: 50000\r\n\r\nx".encode()
            )
            slow.append(writer)
        await asyncio.sleep(0.2)
        assert gw.proxy.plane is not None and gw.proxy.plane.pool.open == 0
        async with aiohttp.ClientSession() as http:
            for _ in range(10):
                async with http.get(gw.url + "/echo", timeout=aiohttp.ClientTimeout(5)) as r:
                    assert r.status == 200
        for writer in slow:
            writer.close()


async def test_the_head_size_is_bounded(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"GET /x HTTP/1.1\r\nHost: a\r\n")
        for n in range(40):  # 40 headers of 4 KB: each under the limit, the head over it
            writer.write(b"X-H%d: " % n + b"v" * 4000 + b"\r\n")
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert data.startswith(b"HTTP/1.1 431") and b"request head is larger" in data


async def test_versions_and_codings_it_cannot_relay_faithfully_are_refused(upstream):
    async with running_gateway(upstream) as gw:
        cases = {
            b"GET /x HTTP/2.0\r\nHost: a\r\n\r\n": b"505",
            b"POST /x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n"
            b"Connection: close\r\n\r\n"
            b"0\r\n\r\n": b"501",
            b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n": b"400",
        }
        for request, status in cases.items():
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
            writer.write(request)
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert data.split(b" ")[1] == status, (request, data[:120])


async def test_nothing_after_a_connection_close_request_is_read(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(
            b"GET /echo/1 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
            b"GET /echo/2 HTTP/1.1\r\nHost: a\r\n\r\n"
        )
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert data.count(b"HTTP/1.1 ") == 1 and b"/echo/1" in data and b"/echo/2" not in data


async def test_a_client_gone_mid_body_leaves_nothing_behind(upstream):
    async with running_gateway(upstream) as gw:
        _, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 50\r\n\r\nabcde")
        await writer.drain()
        await asyncio.sleep(0.1)
        writer.close()
        plane = gw.proxy.plane
        assert plane is not None
        for _ in range(50):
            if not plane.connections:
                break
            await asyncio.sleep(0.05)
        assert not plane.connections


async def test_malformed_requests_never_put_their_bytes_in_any_log(upstream, caplog):
    secret = b"sk-live-never-log-me-0123456789"
    async with running_gateway(upstream, access_log="json") as gw:
        with caplog.at_level(logging.DEBUG):
            for request in (
                b"GET /x HTTP/1.1\r\nHost: a\r\nx-api-key: " + secret + b"\r\n b\r\n\r\n",
                b"GET /x?token=" + secret + b" HTTP/1.1\r\nHost: a\r\nX: \x00\r\n\r\n",
                b"get /x HTTP/1.1\r\nAuthorization: Bearer " + secret + b"\r\n\r\n",
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
                writer.write(request)
                data = await asyncio.wait_for(reader.read(), 10)
                writer.close()
                assert data.startswith(b"HTTP/1.1 400"), data[:80]
                assert b"X-Request-Id" in data
            gw.gateway.access_log.flush()
    assert secret.decode() not in caplog.text
    assert "malformed HTTP request" in caplog.text  # the refusal itself is logged


async def test_connection_cannot_strip_the_framing_of_a_forwarded_body(upstream):
    """``Connection: content-length`` must not drop the length while the body is still
    sent: the upstream would read the body as a request of its own (smuggling)."""
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(
            b"POST /echo HTTP/1.1\r\nHost: a\r\nConnection: content-length\r\n"
            b"Content-Length: 3\r\n\r\nabc"
        )
        ((status, body),) = await _read_responses(reader, 1)
        writer.close()
    seen = json.loads(body)
    assert status == 200 and seen["body_length"] == 3
    assert seen["headers"]["Content-Length"] == "3"


async def test_an_unsafe_request_is_never_sent_twice(upstream):
    """A POST on a reused connection the upstream drops without answering is a 502, not
    a second POST (it may have been applied)."""
    posts = 0

    async def handler(reader, writer):
        nonlocal posts
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if head.startswith(b"POST"):
                posts += 1
                await reader.readexactly(5)
                writer.close()  # read it, then vanish without an answer
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_gateway(url) as gw, aiohttp.ClientSession() as http:
            async with http.get(gw.url + "/warm") as r:
                assert r.status == 200
            async with http.post(gw.url + "/orders", data=b"12345") as r:
                assert r.status == 502
        assert posts == 1
    finally:
        server.close()


async def test_a_connection_reads_on_after_an_answered_upload(tmp_path, upstream):
    """A request refused after its body was buffered (it waited behind a slow one) must
    not leave the connection paused: the request after it is answered."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n"
        "  - id: tiny\n    category: test\n    match: {prefix: /tiny}\n"
        "    identity: ip\n    limits: {us: 1/60}\n"
        "  - id: rest\n    category: test\n    match: {prefix: /}\n"
        "    identity: ip\n    unlimited: true\n"
    )
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"POST /tiny HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\n\r\nx")
        ((status, _),) = await _read_responses(reader, 1)
        assert status == 200  # the one request the limit allows
        body = b"x" * 200_000  # over the 64 KiB read ahead while it waits its turn
        writer.write(
            b"GET /slow?s=0.3 HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /tiny HTTP/1.1\r\nHost: a\r\nContent-Length: %d\r\n\r\n"
            % len(body)
            + body
            + b"GET /echo/next HTTP/1.1\r\nHost: a\r\n\r\n"
        )
        replies = await _read_responses(reader, 3)
        writer.close()
    assert [status for status, _ in replies] == [200, 429, 200]
    assert json.loads(replies[2][1])["path"] == "/echo/next"


async def test_inflight_gauge_counts_requests_being_answered():
    # The upstream answers when the test lets it, not after a fixed time: the gauge is
    # read while the request is surely in flight, however slow the machine.
    release = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"held": True})

    app = web.Application()
    app.router.add_get("/held", held)
    async with (
        running_app(app) as upstream,
        running_gateway(upstream) as gw,
        aiohttp.ClientSession() as http,
    ):
        sample = gw.metrics.registry.get_sample_value
        pending = asyncio.ensure_future(http.get(gw.url + "/held"))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while sample("gateway_inflight_requests") != 1:
            assert loop.time() < deadline, sample("gateway_inflight_requests")
            assert not pending.done(), "answered before the upstream was let answer"
            await asyncio.sleep(0.01)
        release.set()
        async with await pending as r:
            assert r.status == 200
        assert sample("gateway_inflight_requests") == 0


async def test_a_pipelined_upload_that_stalls_gets_408(upstream):
    async with running_gateway(upstream, body_read_timeout=0.5) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(
            b"GET /echo/1 HTTP/1.1\r\nHost: a\r\n\r\n"
            b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabcde"
        )
        ((status, _),) = await _read_responses(reader, 1)
        rest = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert status == 200
    assert rest.startswith(b"HTTP/1.1 408")


async def test_a_long_pipeline_then_an_upload_is_read_to_the_end(upstream):
    async with running_gateway(upstream) as gw:
        reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
        writer.write(b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n" * 40)
        writer.write(b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabcde")
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(b"fghij")
        replies = await _read_responses(reader, 41)
        writer.close()
    assert all(status == 200 for status, _ in replies)
    assert json.loads(replies[-1][1])["body_length"] == 10


async def test_a_body_sent_after_a_head_answer_never_reaches_the_next_response(upstream):
    async def head_with_body(reader, writer):
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            if head.startswith(b"HEAD"):  # a buggy upstream: a body after a HEAD answer
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
            else:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc")

    server = await asyncio.start_server(head_with_body, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with running_gateway(url) as gw:
            reader, writer = await asyncio.open_connection("127.0.0.1", _port(gw))
            writer.write(
                b"HEAD /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost: a\r\n"
                b"Connection: close\r\n\r\n"
            )
            data = await asyncio.wait_for(reader.read(), 10)
            writer.close()
    finally:
        server.close()
    assert b"hello" not in data
    assert data.count(b"HTTP/1.1 200") == 2 and data.endswith(b"abc")


async def _until(condition, seconds: float = 2.0) -> None:
    """Wait for ``condition()`` (the gateway's state after bytes sent on other sockets)."""
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def _start_upload(port: int, n: int, forwarded_for: str | None = None):
    """Send a 200,000-byte upload's head and its first 70,000 bytes (past the 64 KiB read
    before forwarding, so it streams), then stall: it holds an upstream connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    xff = f"X-Forwarded-For: {forwarded_for}\r\n" if forwarded_for else ""
    writer.write(
        f"POST /upload HTTP/1.1\r\nHost: a\r\nx-api-key: up-{n}\r\n{xff}"
        "Content-Length: 200000\r\n\r\n".encode()
        + b"x" * 70_000
    )
    await writer.drain()
    return reader, writer


async def test_one_client_cannot_hold_more_than_its_share_of_upstream_connections(upstream):
    """Slow-body starvation with bodies that stream (over 64 KiB): one client address may
    hold at most max_uploads_per_client upstream connections with unfinished uploads."""
    async with running_gateway(upstream, upstream_pool_size=8, max_uploads_per_client=2) as gw:
        plane = gw.proxy.plane
        assert plane is not None
        held = [await _start_upload(_port(gw), n) for n in range(2)]
        await _until(lambda: plane.uploads_open == 2)
        assert plane.uploads == {"127.0.0.1": 2}
        reader, writer = await _start_upload(_port(gw), 3)
        [(status, body)] = await _read_responses(reader, 1)
        assert status == 429
        assert "too many uploads in progress from this client" in json.loads(body)["detail"]
        writer.close()
        # Requests without a streamed body are not held back, from the same client too.
        async with aiohttp.ClientSession() as http:
            for _ in range(5):
                async with http.post(gw.url + "/echo", data=b"y" * 1000) as r:
                    assert r.status == 200
        # A finished upload gives its slot back: the next one goes through whole.
        held_reader, held_writer = held[0]
        held_writer.write(b"x" * 130_000)
        [(status, body)] = await _read_responses(held_reader, 1)
        assert (status, json.loads(body)) == (200, {"received": 200_000})
        assert plane.uploads == {"127.0.0.1": 1}
        reader, writer = await _start_upload(_port(gw), 4)
        writer.write(b"x" * 130_000)
        [(status, body)] = await _read_responses(reader, 1)
        assert (status, json.loads(body)) == (200, {"received": 200_000})
        for _, w in [*held, (reader, writer)]:
            w.close()
        await _until(lambda: plane.uploads_open == 0)  # a client gone mid-upload too
        assert plane.uploads == {} and plane.uploads_open == 0


async def test_uploads_of_all_clients_together_leave_half_the_pool_free(upstream):
    """Many addresses trickling large bodies hold at most half the upstream pool: the
    other half keeps serving everyone else."""
    async with running_gateway(
        upstream, upstream_pool_size=4, max_uploads_per_client=8, trusted_proxies=["127.0.0.1/32"]
    ) as gw:
        plane = gw.proxy.plane
        assert plane is not None
        held = [await _start_upload(_port(gw), n, f"10.0.0.{n}") for n in range(2)]
        await _until(lambda: plane.uploads_open == 2)
        assert plane.uploads == {"10.0.0.0": 1, "10.0.0.1": 1}
        refused = []
        for n in range(2, 6):
            reader, writer = await _start_upload(_port(gw), n, f"10.0.0.{n}")
            refused.append(await _read_responses(reader, 1))
            writer.close()
        assert [replies[0][0] for replies in refused] == [503] * 4
        assert "set aside for uploads (2)" in json.loads(refused[0][0][1])["detail"]
        async with aiohttp.ClientSession() as http:
            for _ in range(10):
                async with http.get(gw.url + "/echo", timeout=aiohttp.ClientTimeout(5)) as r:
                    assert r.status == 200
        for _, w in held:
            w.close()
