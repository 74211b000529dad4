"""What the Lua script leaves in Redis, and how it matches the in-process arithmetic."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from gateway.counters.base import CounterBackend, LimitCheck
from gateway.counters.factory import (
    open_counter_backend,
    parse_counter_url,
    redis_client,
    store_client,
)
from gateway.counters.memory import MemoryBackend
from gateway.counters.redis_backend import RedisBackend
from tests.counters.helpers import keys_sharing_tag, new_key
from tests.support.redis_servers import RedisClusterProcess, RedisServer


@dataclass
class Store:
    """A counter stack plus a plain client to look at what it stored."""

    backend: CounterBackend
    raw: Redis | RedisCluster
    all_keys: list[str]


@pytest.fixture(params=["redis", "cluster"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Store]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        server.cli("FLUSHALL")
        url = server.url
    else:
        cluster: RedisClusterProcess = request.getfixturevalue("redis_cluster")
        cluster.flush()
        url = cluster.url
    backend = open_counter_backend(url, region="eu", timeout_seconds=2.0, deny_cache=False)
    raw = redis_client(parse_counter_url(url))
    yield Store(backend, raw, [])
    await backend.close()
    await raw.aclose()


# The script's callers over both clients: redis-py (Sentinel) and the lean connection.
CLIENTS = {"redis-py": redis_client, "wire": store_client}


@pytest.fixture(params=sorted(CLIENTS))
def make_client(request: pytest.FixtureRequest) -> object:
    return CLIENTS[request.param]


async def stored_keys(raw: Redis | RedisCluster) -> set[str]:
    if isinstance(raw, RedisCluster):
        found = await raw.keys("*", target_nodes=RedisCluster.PRIMARIES)
    else:
        found = await raw.keys("*")
    return {k.decode() if isinstance(k, bytes) else k for k in found}


async def test_keys_are_exactly_the_ones_passed_and_expire(store: Store) -> None:
    passed = [*keys_sharing_tag(2, region="eu"), new_key(region="eu")]
    short = LimitCheck(passed[0], limit=100, window_ms=1_000, bucket_ms=100)
    long = LimitCheck(passed[1], limit=100, window_ms=60_000, bucket_ms=1_000)
    other = LimitCheck(passed[2], limit=100, window_ms=5_000, bucket_ms=100)
    await store.backend.hit([short, long])
    await store.backend.hit([other])
    # Two lives (window + bucket) ahead: the expiry moves about once a window. Read right
    # after the hits, before the KEYS scans: the short key lives only 2.2 s.
    ttls = [await store.raw.pttl(key) for key in passed]
    assert 0 < ttls[0] <= 2_200
    assert 118_000 < ttls[1] <= 122_000
    assert 0 < ttls[2] <= 10_200
    assert await stored_keys(store.raw) == set(passed)
    assert all(key.startswith("rl:{eu:") for key in await stored_keys(store.raw))


async def test_memory_per_key_is_bounded_by_the_bucket_count(store: Store) -> None:
    key = new_key(region="eu")
    check = LimitCheck(key, limit=10_000, window_ms=500, bucket_ms=100)
    for _ in range(40):  # ~1.2 s: many more buckets than the window holds
        await store.backend.hit([check])
        # 16 bytes a bucket, a 24-byte trailer; at most 16 that left the window are kept.
        records = (await store.raw.strlen(key) - 24) // 16
        assert records <= 500 // 100 + 2 + 16
        await asyncio.sleep(0.03)


async def test_a_refused_check_is_not_written(store: Store) -> None:
    a, b = keys_sharing_tag(2, region="eu")
    full = LimitCheck(a, limit=0, window_ms=1_000, bucket_ms=100)
    other = LimitCheck(b, limit=5, window_ms=1_000, bucket_ms=100)
    assert not (await store.backend.hit([full, other])).admitted
    assert await stored_keys(store.raw) == set()


async def test_script_matches_the_in_process_arithmetic(redis_server: RedisServer) -> None:
    """The Lua script and MemoryBackend agree call by call, at the store's own times."""
    redis = RedisBackend(redis_client(parse_counter_url(redis_server.url)), name="redis")
    now = [0]
    memory = MemoryBackend(clock=lambda: now[0])
    rng = random.Random(20240601)
    keys = keys_sharing_tag(3)
    shapes = [(3, 300, 100, True), (5, 500, 100, True), (2, 400, 200, False)]
    try:
        for _ in range(120):
            chosen = rng.sample(range(3), rng.randint(1, 3))
            checks = [
                LimitCheck(keys[i], shapes[i][0], shapes[i][1], shapes[i][2], enforce=shapes[i][3])
                for i in chosen
            ]
            result, store_now = await redis.hit_timed(checks)
            now[0] = store_now
            assert memory.hit_now(checks).states == result.states
            await asyncio.sleep(rng.choice((0, 0, 0.005, 0.02, 0.06)))
    finally:
        await redis.close()


async def test_script_is_reloaded_after_script_flush(
    redis_server: RedisServer, make_client: Any
) -> None:
    redis = RedisBackend(make_client(parse_counter_url(redis_server.url)), name="redis")
    try:
        check = LimitCheck(new_key(), limit=10, window_ms=1_000, bucket_ms=100)
        await redis.hit([check])
        redis_server.cli("SCRIPT", "FLUSH")
        loads = redis.script_loads
        assert (await redis.hit([check])).states[0].remaining == 8  # single call path
        assert redis.script_loads == loads + 1
        redis_server.cli("SCRIPT", "FLUSH")
        batch = await redis.hit_many([[check]] * 5)  # pipeline path
        assert [r.states[0].remaining for r in batch if not isinstance(r, Exception)] == [
            7,
            6,
            5,
            4,
            3,
        ]
        assert redis.script_loads == loads + 2
    finally:
        await redis.close()


async def test_a_changed_limit_is_sent_though_the_key_is_the_same(
    redis_server: RedisServer, make_client: Any
) -> None:
    # The backend keeps each identity's EVALSHA bytes while the limiter hands it the
    # same checks object; a reloaded rule hands new checks under the same key, and the
    # new limit must be what Redis applies, on the single-call and the pipeline path.
    redis = RedisBackend(make_client(parse_counter_url(redis_server.url)), name="redis")
    try:
        key = new_key()
        tight = [LimitCheck(key, limit=2, window_ms=60_000, bucket_ms=1_000)]
        assert (await redis.hit(tight)).admitted
        assert (await redis.hit(tight)).admitted
        assert not (await redis.hit(tight)).admitted  # the same object: the kept call
        loose = [LimitCheck(key, limit=5, window_ms=60_000, bucket_ms=1_000)]
        result = await redis.hit(loose)
        assert result.admitted and result.states[0].remaining == 2
        batch = await redis.hit_many([loose, tight, loose])
        assert [r.admitted for r in batch if not isinstance(r, Exception)] == [
            True,
            False,
            True,
        ]
        assert not (await redis.hit(loose)).admitted  # 5 of 5 counted
    finally:
        await redis.close()


async def test_cluster_refuses_keys_in_different_slots(redis_cluster: RedisClusterProcess) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    try:
        split = [LimitCheck(new_key(), 1, 1_000, 100), LimitCheck(new_key(), 1, 1_000, 100)]
        with pytest.raises(ValueError, match="hash tag"):
            await backend.hit(split)
        fine = LimitCheck(new_key(), 1, 1_000, 100)
        result = await backend.hit([fine])
        assert result.admitted and result.source == "redis"
    finally:
        await backend.close()


async def test_bad_checks_are_refused_before_reaching_redis(redis_server: RedisServer) -> None:
    backend = open_counter_backend(redis_server.url, region="us", timeout_seconds=2.0)
    try:
        with pytest.raises(ValueError):
            await backend.hit([LimitCheck(new_key(), 1, window_ms=0, bucket_ms=100)])
        assert (await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])).source == "redis"
    finally:
        await backend.close()


async def test_pooled_connections_of_a_restarted_server_cost_no_failed_call(
    own_redis: RedisServer, make_client: Any
) -> None:
    # The lean round trip (standalone servers) keeps redis-py's rule: a pooled connection
    # that died with its server is replaced once, so the first calls after a restart
    # succeed instead of failing (the script is loaded again on the new server too).
    redis = RedisBackend(make_client(parse_counter_url(own_redis.url)), name="redis")
    try:
        check = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
        assert (await redis.hit([check])).states[0].remaining == 9
        assert len(await redis.hit_many([[check]] * 3)) == 3
        own_redis.restart()  # no persistence: counts start over, connections are stale
        assert (await redis.hit([check])).states[0].remaining == 9  # single call path
        batch = await redis.hit_many([[check]] * 3)  # pipeline path
        assert [r.states[0].remaining for r in batch if not isinstance(r, Exception)] == [8, 7, 6]
    finally:
        await redis.close()
