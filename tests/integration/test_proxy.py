"""The proxy path: streaming both ways, headers, upstream failures, open-proxy refusals."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from gateway.proxy.admin import create_admin_app
from tests.support.gateway import free_port, raw_request, running_app, running_gateway
from tests.support.redis_servers import RedisServer
from tests.support.upstream import EVENTS_KEY


async def test_request_and_response_headers(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        headers = {
            "X-Custom": "kept",
            "Connection": "keep-alive, X-Drop-Me",
            "X-Drop-Me": "hop",
            "Proxy-Authorization": "Basic secret",
            "X-Forwarded-For": "6.6.6.6",  # from an untrusted peer: replaced
            "Host": "api.example.com",
        }
        async with http.get(gw.url + "/echo/path?q=1&b=2", headers=headers) as r:
            assert r.status == 200
            seen = (await r.json())["headers"]
            # response side: hop-by-hop headers of the upstream removed, Via added
            assert r.headers["X-Upstream"] == "yes"
            assert "X-Hop" not in r.headers and "Keep-Alive" not in r.headers
            assert "ratelimit-gateway" in r.headers["Via"]
            assert "RateLimit" in r.headers and r.headers["X-Request-Id"]
        lower = {k.lower(): v for k, v in seen.items()}
        assert lower["x-custom"] == "kept"
        assert "x-drop-me" not in lower and "proxy-authorization" not in lower
        assert lower["x-forwarded-for"] == "127.0.0.1"
        assert lower["x-forwarded-proto"] == "http"
        assert "ratelimit-gateway" in lower["via"]
        assert lower["host"] == "api.example.com"


async def test_trusted_proxy_forwarding_is_appended_and_used_for_identity(upstream):
    async with running_gateway(upstream, trusted_proxies=["127.0.0.0/8"]) as gw:
        async with aiohttp.ClientSession() as http:
            # Two different clients behind the trusted proxy get separate catch-all buckets.
            for client in ("203.0.113.1", "203.0.113.2"):
                for _ in range(100):
                    async with http.get(gw.url + "/x", headers={"X-Forwarded-For": client}) as r:
                        assert r.status == 200
                async with http.get(gw.url + "/x", headers={"X-Forwarded-For": client}) as r:
                    assert r.status == 429
            async with http.get(gw.url + "/x", headers={"X-Forwarded-For": "203.0.113.3"}) as r:
                assert r.status == 200
                seen = {k.lower(): v for k, v in (await r.json())["headers"].items()}
                assert seen["x-forwarded-for"] == "203.0.113.3, 127.0.0.1"


async def test_untrusted_forwarding_header_cannot_pick_a_bucket(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for n in range(100):
            async with http.get(gw.url + "/x", headers={"X-Forwarded-For": f"10.9.9.{n}"}) as r:
                assert r.status == 200
        async with http.get(gw.url + "/x", headers={"X-Forwarded-For": "10.1.1.1"}) as r:
            assert r.status == 429


async def test_server_sent_events_pass_through_as_produced(upstream_app):
    app, url = upstream_app
    gate: asyncio.Queue[int] = app[EVENTS_KEY]["sse_gate"]
    async with running_gateway(url) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/sse?n=3") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            for n in range(3):
                gate.put_nowait(n)  # the upstream writes event n only now
                line = await asyncio.wait_for(r.content.readline(), 10)
                assert json.loads(line.decode().removeprefix("data: ")) == {"n": n}
                assert await r.content.readline() == b"\n"


async def test_large_upload_is_streamed_not_buffered(upstream_app):
    app, url = upstream_app
    received: asyncio.Queue[int] = app[EVENTS_KEY]["chunks"]
    first_chunk_seen = asyncio.Event()
    total = 8 * 1024 * 1024
    part = b"x" * (256 * 1024)

    async def body():
        yield part
        # The upstream must see bytes before the client has sent the rest.
        await asyncio.wait_for(received.get(), 10)
        first_chunk_seen.set()
        for _ in range(total // len(part) - 1):
            yield part

    async with running_gateway(url) as gw, aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/upload", data=body()) as r:
            assert r.status == 200
            assert (await r.json())["received"] == total
    assert first_chunk_seen.is_set()


async def test_body_over_the_limit_is_413(upstream):
    async with (
        running_gateway(upstream, max_body_bytes=1000) as gw,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(gw.url + "/upload", data=b"x" * 2000) as r:
            assert r.status == 413
            assert "1000 bytes" in (await r.json())["detail"]

        async def chunked():
            for _ in range(10):
                yield b"y" * 500

        async with http.post(gw.url + "/upload", data=chunked()) as r:
            assert r.status == 413


async def test_unreachable_upstream_is_502_and_slow_is_504(upstream):
    dead = f"http://127.0.0.1:{free_port()}"
    async with running_gateway(dead) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/x") as r:
            assert r.status == 502
            assert "unreachable" in (await r.json())["detail"]
            assert "RateLimit" in r.headers
    async with (
        running_gateway(upstream, upstream_timeout=0.3) as gw,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(gw.url + "/slow?s=3") as r:
            assert r.status == 504
            assert "in time" in (await r.json())["detail"]


async def test_open_proxy_requests_are_refused(upstream):
    async with running_gateway(upstream) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        absolute = await raw_request(
            port,
            b"GET http://example.com/x HTTP/1.1\r\nHost: example.com\r\nConnection: close\r\n\r\n",
        )
        assert absolute.startswith(b"HTTP/1.1 400"), absolute[:100]
        assert b'"detail"' in absolute
        connect = await raw_request(
            port, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n"
        )
        assert connect.split(b"\r\n")[0].split(b" ")[1] in (b"400", b"405"), connect[:100]
        trace = await raw_request(port, b"TRACE /x HTTP/1.1\r\nHost: a\r\n\r\n")
        assert trace.startswith(b"HTTP/1.1 405") and b"\r\nAllow: GET, HEAD" in trace


async def test_path_spellings_do_not_dodge_a_limit(upstream):
    key = {"x-api-key": "spelling-test"}
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for _ in range(15):
            async with http.post(gw.url + "/runs/query", headers=key) as r:
                assert r.status == 200
        for spelling in ["//runs/query", "/runs/./query", "/runs/x/../query", "/runs/%71uery",
                         "/runs/query/", "/runs//query", "/runs/%2e/query"]:  # fmt: skip
            async with http.post(gw.url + spelling, headers=key) as r:
                assert r.status == 429, spelling
        for refused in ["/runs/query;a=b", "/runs%2Fquery", "/runs/query%3B"]:
            async with http.post(gw.url + refused, headers=key) as r:
                assert r.status == 400, refused
                assert "detail" in await r.json()


async def test_forwarded_path_is_the_normalised_one(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a//b/./c/../d/%7Euser/?x=1") as r:
            assert (await r.json())["path"] == "/a/b/d/~user?x=1"


async def test_oversized_and_odd_identity_headers_never_crash(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for value in ["k" * 300, ""]:
            async with http.post(gw.url + "/runs/query", headers={"x-api-key": value}) as r:
                assert r.status == 200
                # no identity formed: the request falls to the IP catch-all
                assert '"catch-all"' in r.headers["RateLimit-Policy"]
        # Not printable ASCII: refused, so a key the upstream receives is always counted
        # (SPEC 2) instead of falling to a catch-all bucket.
        async with http.post(gw.url + "/runs/query", headers={"x-api-key": "tab\there"}) as r:
            assert r.status == 400
            assert "printable ASCII" in (await r.json())["detail"]
        async with http.get(gw.url + "/x", headers={"x-api-key": "h" * 9000}) as r:
            assert r.status == 431
            assert "x-api-key" in (await r.json())["detail"]
        many = {f"x-h{n}": "v" for n in range(150)}
        async with http.get(gw.url + "/x", headers=many) as r:
            assert r.status == 431
            assert "too many request headers" in (await r.json())["detail"]


async def test_no_default_upstream_is_404(upstream):
    async with running_gateway(None) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/nothing/here") as r:
            assert r.status == 404
            assert "no upstream" in (await r.json())["detail"]


async def test_info_reports_table_and_backend(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/info") as r:
            info = await r.json()
            assert r.headers["RateLimit-Policy"].startswith('"high-throughput-ip"')
        assert info["rules"]["hash"] == gw.rules.table.digest
        assert info["regions"][0] == {"name": "us", "counter_backend": "memory", "healthy": True}


async def test_public_info_names_no_address_file_or_upstream(tmp_path, upstream):
    """The public port's /info says which table is in force and whether the counters
    answer; where the counter store, rule files and upstreams are is on the admin port."""
    redis = RedisServer(tmp_path / "redis").start()
    try:
        async with (
            running_gateway(upstream, redis_url=redis.url) as gw,
            aiohttp.ClientSession() as http,
        ):
            async with http.get(gw.url + "/info") as r:
                public = await r.json()
            admin_app = create_admin_app(gw.metrics.registry, gw.proxy.info)
            async with running_app(admin_app) as admin, http.get(admin + "/info") as r:
                assert r.status == 200
                full = await r.json()
    finally:
        redis.stop()
    text = json.dumps(public)
    assert str(redis.port) not in text and "127.0.0.1" not in text
    assert public["regions"] == [{"name": "us", "counter_backend": "redis", "healthy": True}]
    assert set(public["rules"]) == {"hash", "loaded_at", "count"}
    assert "upstreams" not in public
    assert full["regions"][0]["counter_backend"] == f"redis://127.0.0.1:{redis.port}/0 (region us)"
    assert full["rules"]["files"] and full["rules"]["last_reload_error"] is None
    default = [u for u in full["upstreams"] if u["prefix"] == "(everything else)"]
    assert default == [
        {"prefix": "(everything else)", "upstream": "default", "url": upstream, "upgrade": True}
    ]
    assert full["rules"]["hash"] == public["rules"]["hash"]


async def test_compressed_request_body_passes_through_untouched(upstream):
    import gzip

    body = gzip.compress(b"hello " * 1000)
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.post(
            gw.url + "/echo", data=body, headers={"Content-Encoding": "gzip"}
        ) as r:
            assert (await r.json())["body_length"] == len(body)


async def test_gateway_answers_carry_the_request_id(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/a;b", headers={"X-Request-Id": "req-123"}) as r:
            assert r.status == 400 and r.headers["X-Request-Id"] == "req-123"
        async with http.get(gw.url + "/info") as r:
            assert len(r.headers["X-Request-Id"]) == 32
        async with http.get(gw.url + "/echo") as r:
            seen = {k.lower(): v for k, v in (await r.json())["headers"].items()}
            assert seen["x-request-id"] == r.headers["X-Request-Id"]  # the upstream got it
