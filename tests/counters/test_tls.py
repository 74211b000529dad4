"""rediss:// end to end against a TLS-only redis-server with a throwaway private CA.

Needs ``openssl`` and a redis-server built with TLS (both checked by starting one):
these tests fail rather than skip when either is missing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gateway.counters.base import LimitCheck
from gateway.counters.factory import ACCEPTED_FORMS, open_counter_backend, parse_counter_url
from tests.counters.helpers import RecordingEvents, keys_sharing_tag, new_key
from tests.support.redis_servers import RedisServer


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("tls-redis"), tls=True)
    server.start()
    yield server
    server.stop()


def base_url(server: RedisServer) -> str:
    return server.url.partition("?")[0]


async def test_rediss_with_private_ca_admits_exactly_the_limit(tls_redis: RedisServer) -> None:
    assert tls_redis.url.startswith("rediss://") and "ssl_ca_certs=" in tls_redis.url
    events = RecordingEvents()
    backend = open_counter_backend(tls_redis.url, region="us", timeout_seconds=2.0, events=events)
    try:
        minute, second = keys_sharing_tag(2)
        checks = [
            LimitCheck(minute, limit=5, window_ms=60_000, bucket_ms=1_000),
            LimitCheck(second, limit=50, window_ms=1_000, bucket_ms=100),
        ]
        # Concurrent calls go through the coalescer's pipelines as well as single calls.
        results = await asyncio.gather(*(backend.hit(checks) for _ in range(12)))
        assert sum(r.admitted for r in results) == 5
        assert {r.source for r in results} <= {"redis", "deny-cache"}
        assert any(r.source == "redis" and not r.admitted for r in results)
        assert events.errors == [] and events.fallbacks == 0
        # Counted on the server, over TLS (the CLI reaches it with the same CA).
        assert tls_redis.cli("EXISTS", minute, second).strip() == "2"
        assert await backend.healthy()
    finally:
        await backend.close()


async def test_server_certificate_is_verified_by_default(tls_redis: RedisServer) -> None:
    # Without the private CA the server's certificate is not trusted: the store is
    # unavailable (fallback, an error reported), never silently accepted.
    events = RecordingEvents()
    backend = open_counter_backend(
        base_url(tls_redis), region="us", timeout_seconds=2.0, events=events
    )
    try:
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.source == "fallback"
        assert events.errors and not await backend.healthy()
    finally:
        await backend.close()


async def test_plain_client_on_the_tls_port_falls_back_quickly(tls_redis: RedisServer) -> None:
    url = base_url(tls_redis).replace("rediss://", "redis://")
    backend = open_counter_backend(url, region="us", timeout_seconds=0.2)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.source == "fallback" and loop.time() - started < 2.0
    finally:
        await backend.close()


@pytest.mark.parametrize(
    "query",
    [
        "ssl_cert_reqs=none",  # encrypted, not verified: no CA needed
        "ssl_cert_reqs=REQUIRED&ssl_ca_certs={ca}",  # values are case-insensitive
        "ssl_ca_certs={ca}&ssl_check_hostname=false",
        "ssl_ca_certs={ca}&ssl_check_hostname=yes",
    ],
)
async def test_tls_options(tls_redis: RedisServer, query: str) -> None:
    assert tls_redis.tls_files is not None
    url = f"{base_url(tls_redis)}?{query.format(ca=tls_redis.tls_files.ca_cert)}"
    backend = open_counter_backend(url, region="us", timeout_seconds=2.0)
    try:
        key = new_key()
        result = await backend.hit([LimitCheck(key, 1, 1_000, 100)])
        assert result.admitted and result.source == "redis"
        assert tls_redis.cli("EXISTS", key).strip() == "1"
    finally:
        await backend.close()


async def test_hostname_in_the_certificate(tls_redis: RedisServer) -> None:
    # The certificate names 127.0.0.1 and localhost; both verify with the default
    # ssl_check_hostname=true.
    url = tls_redis.url.replace("127.0.0.1", "localhost")
    backend = open_counter_backend(url, region="us", timeout_seconds=2.0)
    try:
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.source == "redis"
    finally:
        await backend.close()


def test_parsed_tls_options_are_normalised() -> None:
    parsed = parse_counter_url(
        "rediss://h/0?ssl_cert_reqs=Optional&ssl_check_hostname=OFF&ssl_ca_certs=/x.pem"
    )
    assert dict(parsed.options) == {
        "ssl_cert_reqs": "optional",
        "ssl_check_hostname": "false",
        "ssl_ca_certs": "/x.pem",
    }
    assert "TLS options" in ACCEPTED_FORMS and "ssl_ca_certs" in ACCEPTED_FORMS


@pytest.mark.parametrize(
    ("query", "says"),
    [
        # Each of these used to reach redis-py and fail only on the first connect,
        # which the stack took for an outage (silent fallback), or, for
        # ssl_check_hostname, to be read as "false" (no hostname check).
        ("ssl_cert_reqs=requierd", "ssl_cert_reqs must be"),
        ("ssl_cert_reqs=", "ssl_cert_reqs must be"),
        ("ssl_check_hostname=maybe", "ssl_check_hostname must be"),
        ("ssl_ca_certs=", "ssl_ca_certs needs a file path"),
        ("ssl_certfile=", "ssl_certfile needs a file path"),
        ("ssl_ca_certs=/nonexistent/ca.pem", "no readable file"),
        ("ssl_keyfile=/nonexistent/client.key", "no readable file"),
        ("ssl_verify=none", "unknown option"),
    ],
)
def test_bad_tls_options_are_refused_when_the_backend_is_built(query: str, says: str) -> None:
    for scheme, hosts in (("rediss", "127.0.0.1:1/0"), ("rediss+cluster", "127.0.0.1:1")):
        with pytest.raises(ValueError) as caught:
            open_counter_backend(f"{scheme}://{hosts}?{query}", region="us")
        assert says in str(caught.value) and ACCEPTED_FORMS in str(caught.value)


def test_missing_files_are_not_checked_when_only_parsing() -> None:
    # Configuration checks parse URLs where the certificate files may not be mounted.
    parsed = parse_counter_url("rediss://h/0?ssl_ca_certs=/nonexistent/ca.pem")
    assert parsed.options == (("ssl_ca_certs", "/nonexistent/ca.pem"),)
