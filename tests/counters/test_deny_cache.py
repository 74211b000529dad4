"""Known refusals are answered from memory until their reset, without the store."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest

from gateway.counters.base import HitResult, LimitCheck
from gateway.counters.deny_cache import DenyCacheBackend
from gateway.counters.factory import open_counter_backend
from gateway.counters.memory import MemoryBackend
from tests.counters.helpers import RecordingEvents, called, keys_sharing_tag, new_key
from tests.support.redis_servers import RedisServer


@pytest.mark.parametrize("via", ["hit", "submit"])
async def test_a_flood_from_one_identity_does_not_reach_redis(
    redis_server: RedisServer, via: str
) -> None:
    events = RecordingEvents()
    backend = called(
        open_counter_backend(redis_server.url, region="us", timeout_seconds=2.0, events=events),
        via,
    )
    try:
        # A minute's window: the 50 calls all come before its reset, however slow the
        # machine (with 1 s, a stall let the store be asked again and the counts drift).
        check = LimitCheck(new_key(60), limit=3, window_ms=60_000, bucket_ms=1_000)
        await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])  # script loaded
        redis_server.cli("CONFIG", "RESETSTAT")
        results = [await backend.hit([check]) for _ in range(50)]
        assert sum(r.admitted for r in results) == 3
        assert [r.source for r in results[:4]] == ["redis"] * 4
        assert {r.source for r in results[4:]} == {"deny-cache"}
        assert all(r.states[0].reset_ms > 0 and r.states[0].remaining == 0 for r in results[3:])
        assert redis_server.commandstats()["evalsha"] == 4
        assert events.deny_hits == 46
        # Once the reset has passed the store is asked again, and has room again: on a
        # 1 s window of its own, where only the lower bound of the wait matters. (Hit
        # until refused: the first is admitted, and a stall may let a second in.)
        short = LimitCheck(new_key(1), limit=1, window_ms=1_000, bucket_ms=100)
        refused = None
        for _ in range(10):
            refused = await backend.hit([short])
            if not refused.admitted:
                break
        assert refused is not None and not refused.admitted
        await asyncio.sleep(refused.states[0].reset_ms / 1000 + 0.05)
        after = await backend.hit([short])
        assert after.source == "redis" and after.admitted
    finally:
        await backend.close()


def _clocked() -> tuple[list[int], DenyCacheBackend, MemoryBackend]:
    now = [1_000_000]
    memory = MemoryBackend(clock=lambda: now[0])
    cache = DenyCacheBackend(
        memory, clock_ms=lambda: now[0], cache_sources=frozenset({"memory"}), max_entries=8
    )
    return now, cache, memory


async def test_entry_lasts_exactly_until_the_reset() -> None:
    now, cache, _ = _clocked()
    check = LimitCheck(new_key(), limit=1, window_ms=1_000, bucket_ms=100)
    await cache.hit([check])
    refused = await cache.hit([check])
    assert refused.source == "memory" and not refused.admitted
    reset = refused.states[0].reset_ms
    now[0] += reset - 1
    cached = await cache.hit([check])
    assert cached.source == "deny-cache" and cached.states[0].reset_ms == 1
    now[0] += 1
    again = await cache.hit([check])
    assert again.source == "memory" and again.admitted


async def test_other_limits_of_the_call_are_reported_from_the_cache() -> None:
    _now, cache, _ = _clocked()
    narrow_key, wide_key = keys_sharing_tag(2)
    narrow = LimitCheck(narrow_key, limit=1, window_ms=1_000, bucket_ms=100)
    wide = LimitCheck(wide_key, limit=10, window_ms=10_000, bucket_ms=1_000)
    await cache.hit([narrow, wide])
    await cache.hit([narrow, wide])
    cached = await cache.hit([narrow, wide])
    assert cached.source == "deny-cache" and not cached.admitted
    assert cached.states[1].allowed and cached.states[1].remaining == 9
    # A call that includes a limit the cache knows nothing about goes to the store.
    fresh = LimitCheck(keys_sharing_tag(1)[0], limit=5, window_ms=1_000, bucket_ms=100)
    assert (await cache.hit([narrow, fresh])).source == "memory"


async def test_a_changed_limit_is_not_answered_from_the_cache() -> None:
    _, cache, _ = _clocked()
    key = new_key()
    await cache.hit([LimitCheck(key, 1, 1_000, 100)])
    assert not (await cache.hit([LimitCheck(key, 1, 1_000, 100)])).admitted
    raised = await cache.hit([LimitCheck(key, 5, 1_000, 100)])  # the rule was edited
    assert raised.source == "memory" and raised.admitted


async def test_shadow_refusals_are_not_cached() -> None:
    _, cache, _ = _clocked()
    shadow = LimitCheck(new_key(), 1, 1_000, 100, enforce=False)
    results = [await cache.hit([shadow]) for _ in range(3)]
    assert all(r.admitted and r.source == "memory" for r in results)
    assert len(cache) == 0


async def test_the_cache_is_bounded() -> None:
    _, cache, _ = _clocked()
    for _ in range(50):
        check = LimitCheck(new_key(), limit=1, window_ms=1_000, bucket_ms=100)
        await cache.hit([check])
        assert not (await cache.hit([check])).admitted
        assert 1 <= len(cache) <= 8


async def test_reported_reset_is_never_earlier_than_the_real_one() -> None:
    # The store decides somewhere between the send and the answer. The entry must
    # expire no later than the real reset (measured from the send), while the reset
    # reported to callers must be no earlier than it (measured from the answer).
    now = [1_000_000]
    memory = MemoryBackend(clock=lambda: now[0])

    class SlowStore:
        name = "slow"
        decided_at: list[int] = []

        async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
            now[0] += 400  # on the way there
            self.decided_at.append(now[0])
            result = await memory.hit(checks)
            now[0] += 700  # on the way back: crosses a second boundary
            return HitResult(result.admitted, result.states, source="redis")

        async def healthy(self) -> bool:
            return True

        async def close(self) -> None:
            pass

    store = SlowStore()
    cache = DenyCacheBackend(store, clock_ms=lambda: now[0])
    check = LimitCheck(new_key(), limit=1, window_ms=10_000, bucket_ms=1_000)
    assert (await cache.hit([check])).admitted
    refused = await cache.hit([check])
    assert not refused.admitted and refused.source == "redis"
    real_reset = store.decided_at[-1] + refused.states[0].reset_ms
    seen = 0
    while True:
        cached = await cache.hit([check])
        if cached.source != "deny-cache":
            break
        seen += 1
        assert now[0] < real_reset  # the entry never outlives the real reset
        reported = cached.states[0].reset_ms
        assert now[0] + reported >= real_reset
        assert math.ceil(reported / 1000) >= math.ceil((real_reset - now[0]) / 1000)
        now[0] += 97
    assert seen > 10
