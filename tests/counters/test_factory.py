"""Counter URLs: every accepted form opens a working backend, bad ones say why."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.counters.base import LimitCheck
from gateway.counters.coalesce import CoalescingBackend
from gateway.counters.deny_cache import DenyCacheBackend
from gateway.counters.factory import ACCEPTED_FORMS, open_counter_backend, parse_counter_url
from gateway.counters.memory import MemoryBackend
from gateway.counters.resilient import ResilientBackend
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisClusterProcess, RedisSentinelProcess, RedisServer


@pytest.mark.parametrize("url", [None, "", "memory://"])
def test_memory(url: str | None) -> None:
    backend = open_counter_backend(url, region="us")
    assert isinstance(backend, MemoryBackend) and backend.name == "memory"


def test_redis_url_builds_the_full_stack() -> None:
    backend = open_counter_backend("redis://127.0.0.1:1/0", region="us")
    assert isinstance(backend, DenyCacheBackend)
    assert isinstance(backend.inner, ResilientBackend)
    assert isinstance(backend.inner.inner, CoalescingBackend)
    plain = open_counter_backend("redis://127.0.0.1:1", region="us", deny_cache=False)
    assert isinstance(plain, ResilientBackend)


@pytest.mark.parametrize(
    ("url", "display"),
    [
        ("redis://localhost", "redis://localhost:6379/0"),
        ("redis://:s3cret@10.0.0.1:6380/2", "redis://10.0.0.1:6380/2"),
        ("redis://user:s3cret@[::1]:7000", "redis://[::1]:7000/0"),
        ("rediss://u:s3cret@host/1?ssl_cert_reqs=none", "rediss://host:6379/1"),
        ("unix://:s3cret@/run/redis.sock?db=3", "unix:///run/redis.sock?db=3"),
        ("redis+cluster://:s3cret@a:7000,b:7001,c:7002", "redis+cluster://a:7000,b:7001,c:7002"),
        ("rediss+cluster://a:7000", "rediss+cluster://a:7000"),
        (
            "redis+sentinel://:s3cret@s1,s2:26380/main/4",
            "redis+sentinel://s1:26379,s2:26380/main/4",
        ),
    ],
)
def test_accepted_forms_and_names_without_secrets(url: str, display: str) -> None:
    parsed = parse_counter_url(url)
    assert parsed.display == display
    backend = open_counter_backend(url, region="eu")
    assert "s3cret" not in backend.name and "s3cret" not in repr(parsed)
    assert backend.name.startswith(display)


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:6379",
        "redis:/localhost",
        "redis://",
        "redis://host:0",
        "redis://host:99999",
        "redis://host:port",
        "redis://a:1,b:2",
        "redis://host/x",
        "redis://host?socket_timeout=1",
        "redis://host?ssl_ca_certs=/x",
        "unix://host/path",
        "unix://",
        "redis+cluster://a",
        "redis+cluster://a:1/3",
        "redis+sentinel://s1:26379",
        "redis+sentinel://[::1:26379/x",
        "memory://something",
        "redis://" + "a" * 3000,
    ],
)
def test_bad_urls_say_what_is_accepted(url: str) -> None:
    with pytest.raises(ValueError) as caught:
        open_counter_backend(url, region="us")
    assert ACCEPTED_FORMS in str(caught.value)
    assert "s3cret" not in str(caught.value)


async def test_password_protected_server(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "auth", password="s3cret-pw").start()
    try:
        backend = open_counter_backend(server.url, region="us", timeout_seconds=2.0)
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.source == "redis" and "s3cret" not in backend.name
        await backend.close()
        wrong = open_counter_backend(
            server.url.replace("s3cret-pw", "nope"), region="us", timeout_seconds=2.0
        )
        assert (await wrong.hit([LimitCheck(new_key(), 1, 1_000, 100)])).source == "fallback"
        await wrong.close()
    finally:
        server.stop()


async def test_unix_socket(redis_server: RedisServer) -> None:
    backend = open_counter_backend(redis_server.unix_url, region="us", timeout_seconds=2.0)
    try:
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.admitted and result.source == "redis"
    finally:
        await backend.close()


async def test_cluster(redis_cluster: RedisClusterProcess) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    try:
        result = await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])
        assert result.admitted and result.source == "redis"
        assert await backend.healthy()
    finally:
        await backend.close()


async def test_sentinel(redis_server: RedisServer, tmp_path: Path) -> None:
    sentinel = RedisSentinelProcess(tmp_path / "sentinel", redis_server).start()
    try:
        backend = open_counter_backend(sentinel.url, region="us", timeout_seconds=2.0)
        key = new_key()
        result = await backend.hit([LimitCheck(key, 1, 1_000, 100)])
        assert result.admitted and result.source == "redis"
        assert redis_server.cli("EXISTS", key).strip() == "1"  # counted on the master
        await backend.close()
    finally:
        sentinel.stop()
