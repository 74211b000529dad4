"""Tricks a client might try to dodge a limit or break the gateway (from review findings)."""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
import uuid

import aiohttp

from gateway.proxy.relay import UNTRUSTED_FORWARDING
from tests.support.gateway import raw_request, running_gateway


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def test_identity_header_named_in_connection_is_no_identity(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for n in range(101):
            headers = {"x-api-key": f"k-{uuid.uuid4()}", "Connection": "keep-alive, x-api-key"}
            async with http.get(gw.url + "/public-thing", headers=headers) as r:
                # counted by address (the upstream never sees the key), so the IP
                # catch-all's 100/60 holds
                assert r.status == (200 if n < 100 else 429)
                if n == 0:
                    seen = {k.lower() for k in (await r.json())["headers"]}
                    assert "x-api-key" not in seen
                    assert '"catch-all"' in r.headers["RateLimit-Policy"]


async def test_repeated_identity_header_is_refused(upstream):
    async with running_gateway(upstream) as gw:
        reply = await raw_request(
            _port(gw),
            b"GET /x HTTP/1.1\r\nHost: a\r\nx-api-key: k1\r\nx-api-key: k2\r\n"
            b"Connection: close\r\n\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 400")
        assert b"send one x-api-key header" in reply


async def test_every_forwarded_for_line_is_read(upstream):
    async with running_gateway(upstream, trusted_proxies=["127.0.0.0/8"]) as gw:
        statuses = []
        for n in range(101):
            # the client's own line rotates; the trusted proxy's line names the client
            reply = await raw_request(
                _port(gw),
                f"GET /x HTTP/1.1\r\nHost: a\r\nX-Forwarded-For: 10.9.0.{n % 250}\r\n"
                f"X-Forwarded-For: 203.0.113.50\r\nConnection: close\r\n\r\n".encode(),
            )
            statuses.append(int(reply.split(b" ")[1]))
        assert statuses.count(200) == 100 and statuses[-1] == 429


async def test_malformed_host_headers_are_not_500(upstream):
    async with running_gateway(upstream) as gw:
        for host in (b"x:99999", b"x:abc", b"x:-1", b"::1", b"\xff\xfe"):
            reply = await raw_request(
                _port(gw), b"GET /x HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
            )
            status = int(reply.split(b" ")[1])
            assert status < 500, (host, reply[:200])


# Read as the client's address, scheme, host or prefix by: npm request-ip (X-Client-IP,
# CF-Connecting-IP, Fastly-Client-Ip, True-Client-Ip, X-Real-IP, X-Cluster-Client-IP,
# X-Forwarded, Forwarded-For, appengine-user-ip, Cf-Pseudo-IPv4), Rails (X-Forwarded-Ssl,
# X-Forwarded-Scheme, Front-End-Https, X-Url-Scheme), Spring and Traefik
# (X-Forwarded-Prefix), ingress-nginx (X-Original-Forwarded-For, X-Forwarded-Server,
# X-Original-Host), Envoy (X-Envoy-External-Address, X-Forwarded-Client-Cert), Azure Front
# Door (X-Azure-ClientIP), Tornado (X-Scheme), nginx auth_request and Traefik forward-auth
# backends (X-Original-URI, X-Forwarded-Uri).
CLIENT_NAMING = {
    "forwarded", "x-real-ip", "x-forwarded-host", "x-forwarded-port", "x-client-ip",
    "cf-connecting-ip", "fastly-client-ip", "true-client-ip", "x-cluster-client-ip",
    "x-forwarded", "forwarded-for", "x-appengine-user-ip", "cf-pseudo-ipv4",
    "x-forwarded-ssl", "x-forwarded-scheme", "front-end-https", "x-url-scheme",
    "x-forwarded-prefix", "x-original-forwarded-for", "x-forwarded-server",
    "x-original-host", "x-envoy-external-address", "x-azure-clientip",
    "x-scheme", "x-forwarded-client-cert", "x-original-uri", "x-forwarded-uri",
    "x-original-proto", "x-envoy-internal", "x-real-port",
}  # fmt: skip


async def test_every_client_naming_header_is_dropped_from_untrusted_peers_only(upstream):
    """The class: every header a framework or CDN library reads as the client's address,
    scheme, host or prefix (UNTRUSTED_FORWARDING) is dropped from an untrusted peer and
    passed on from a trusted proxy; its '_' spelling is refused (a CGI-style upstream
    would read it as the header)."""
    names = sorted({n.decode() for n in UNTRUSTED_FORWARDING} | CLIENT_NAMING)
    sent = {name: "203.0.113.9" for name in names}
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/x", headers=sent) as r:
            assert r.status == 200
            seen = {k.lower() for k in (await r.json())["headers"]}
        assert not seen & set(names), seen & set(names)
        for name in names:
            if "-" not in name:
                continue
            spelled = name.replace("-", "_")
            async with http.get(gw.url + "/x", headers={spelled: "203.0.113.9"}) as r:
                assert r.status == 400, spelled
    async with (
        running_gateway(upstream, trusted_proxies=["127.0.0.0/8"]) as gw,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(gw.url + "/x", headers=sent) as r:
            assert r.status == 200
            passed = {k.lower() for k in (await r.json())["headers"]}
        assert set(names) <= passed, set(names) - passed


async def test_spoofable_forwarding_headers_are_dropped_from_untrusted_peers(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        headers = {
            "Forwarded": "for=1.2.3.4",
            "X-Real-IP": "1.2.3.4",
            "X-Forwarded-Host": "evil.example",
        }
        async with http.get(gw.url + "/x", headers=headers) as r:
            seen = {k.lower() for k in (await r.json())["headers"]}
        assert not seen & {"forwarded", "x-real-ip", "x-forwarded-host"}


async def test_query_string_is_forwarded_byte_for_byte(upstream):
    async with running_gateway(upstream) as gw:
        reply = await raw_request(
            _port(gw),
            b"GET /echo?a=%zz&b=%2F&c=1+2 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
        )
        assert b'"path": "/echo?a=%zz&b=%2F&c=1+2"' in reply


async def test_uuid_spellings_and_head_stay_in_run_lookup(upstream):
    run = uuid.uuid4()
    spellings = [
        f"/runs/{run}",
        f"/runs/{run.hex}",
        f"/runs/{str(run).upper()}",
        f"/runs/urn:uuid:{run}",
        f"/api/v1/runs/{run.hex}",
        # braces, hyphens anywhere, an encoded colon: uuid.UUID() takes them all
        f"/runs/%7B{run}%7D",
        f"/runs/uuid%3A{run.hex[:5]}-{run.hex[5:]}",
        f"/runs/%7b%7B{run.hex}%7d",
    ]
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for n in range(31):
            method = "HEAD" if n % 3 == 0 else "GET"
            assert uuid.UUID(urllib.parse.unquote(spellings[n % len(spellings)].rsplit("/", 1)[1]))
            path = spellings[n % len(spellings)]
            async with http.request(method, gw.url + path, headers={"x-api-key": "k"}) as r:
                assert r.headers["RateLimit-Policy"].split(", ")[0] == '"run-lookup";q=30;w=60', (
                    path
                )
                assert r.status == (200 if n < 30 else 429)


async def test_only_get_and_head_on_ok_are_exempt(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        async with http.post(gw.url + "/ok") as r:
            assert '"catch-all"' in r.headers["RateLimit-Policy"]
        async with http.head(gw.url + "/ok") as r:
            assert r.status == 200 and "RateLimit" not in r.headers


async def test_host_with_trailing_dot_is_the_same_region(tmp_path, upstream):
    config = tmp_path / "gw.yaml"
    config.write_text("regions:\n  us: {}\n  eu: {hosts: [eu.example.com]}\n")
    async with running_gateway(upstream, config_file=str(config)) as gw:
        async with aiohttp.ClientSession() as http:
            for host in ("eu.example.com", "eu.example.com.", "EU.example.com:8080"):
                async with http.get(
                    gw.url + "/runs/stats", headers={"Host": host, "x-api-key": "k"}
                ) as r:
                    assert (
                        r.headers["RateLimit-Policy"].split(", ")[0] == '"runs-stats";q=20;w=10'
                    ), host


async def test_client_hanging_up_mid_stream_is_quiet_and_not_an_upstream_error(upstream, caplog):
    async with running_gateway(upstream) as gw:
        with caplog.at_level(logging.WARNING):
            async with aiohttp.ClientSession() as http:
                async with http.get(gw.url + "/ticks?n=40&every=0.05") as r:
                    assert await r.content.readline() == b"tick\n"
                # closed early: the gateway's next write finds the client gone
            await asyncio.sleep(0.5)
        sample = gw.metrics.registry.get_sample_value
        assert (
            sample(
                "gateway_upstream_errors_total", {"upstream": "default", "kind": "broken_stream"}
            )
            is None
        )
        assert "Error handling request" not in caplog.text
        assert "broke the response stream" not in caplog.text
