"""Failing open keeps its bound across an outage *and its end* (issue 24, finding 9).

While Redis is unavailable each process counts fail-open checks in its local fallback,
so it admits at most the limit per window. Those admissions used to be forgotten when
Redis answered again: Redis had never seen them, so the same identity got the limit once
more within the same window (one process admitted 17 on a 15/10 rule, two workers 43).
Now the fallback's count stays in force until every window holding one of its
admissions has passed: a request must pass both it and Redis.

Real ``redis-server`` processes frozen with SIGSTOP (``RedisServer.pause``); the
fallback, the deny cache and the breaker run on an injected clock, so nothing here
depends on how fast the machine is (Redis's own window is 60 s of real time, longer
than any of these tests).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from gateway.counters.base import CounterBackend, HitResult, LimitCheck
from gateway.counters.coalesce import CoalescingBackend
from gateway.counters.deny_cache import DenyCacheBackend
from gateway.counters.factory import parse_counter_url, store_client
from gateway.counters.memory import MemoryBackend
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resilient import ResilientBackend
from tests.counters.helpers import RecordingEvents, called, keys_sharing_tag, new_key
from tests.support.redis_servers import RedisServer

VIA = pytest.mark.parametrize("via", ["hit", "submit"])
WINDOW_MS = 60_000
BUCKET_MS = 1_000
# Probes of a store that came back, before a test gives up on it (each waits 50 ms).
MAX_PROBES = 100


class FakeClock:
    """The fallback's, the deny cache's (ms) and the breaker's (s) time, moved by hand."""

    def __init__(self) -> None:
        self.now_ms = 5_000_000

    def ms(self) -> int:
        return self.now_ms

    def seconds(self) -> float:
        return self.now_ms / 1000

    def advance(self, ms: int) -> None:
        self.now_ms += ms


@dataclass
class Process:
    """One gateway process's counter stack, as the factory builds it for ``redis://``,
    with the injected clock and a breaker that opens on the first failure."""

    backend: CounterBackend
    resilient: ResilientBackend
    events: RecordingEvents

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        return await self.backend.hit(checks)


def process(url: str, clock: FakeClock, via: str = "hit") -> Process:
    events = RecordingEvents()
    store = RedisBackend(store_client(parse_counter_url(url)), name="test")
    inner = CoalescingBackend(
        store,
        max_in_flight=2,
        batch_timeout_seconds=1.0,
        call_timeout_seconds=0.05,
        queue_timeout_seconds=1.0,
    )
    resilient = ResilientBackend(
        inner,
        timeout_seconds=0.05,
        failure_threshold=1,
        reset_seconds=1.0,
        fallback=MemoryBackend(clock=clock.ms, label="fallback"),
        events=events,
        monotonic=clock.seconds,
    )
    stack = DenyCacheBackend(resilient, events=events, clock_ms=clock.ms)
    return Process(called(stack, via), resilient, events)


async def connect(*procs: Process) -> None:
    """Open each process's connection (a first call through Redis)."""
    for proc in procs:
        warm = LimitCheck(new_key(), 1_000, WINDOW_MS, BUCKET_MS)
        assert (await proc.hit([warm])).source == "redis"


async def back_on_redis(clock: FakeClock, *procs: Process) -> None:
    """After ``resume``: let each breaker probe (past its reset time) until it closes,
    through a key of its own that nothing else counts."""
    for proc in procs:
        probe = LimitCheck(new_key(), 1_000_000, WINDOW_MS, BUCKET_MS)
        for _ in range(MAX_PROBES):
            clock.advance(1_000)
            if (await proc.hit([probe])).source == "redis":
                break
            await asyncio.sleep(0.05)
        assert proc.resilient.breaker_state == "closed"


@VIA
async def test_fallback_admissions_count_after_redis_returns(
    own_redis: RedisServer, via: str
) -> None:
    # Regression: 10 admitted by the fallback during the freeze, then Redis (which
    # never saw them) admitted up to 10 more in the same window.
    clock = FakeClock()
    proc = process(own_redis.url, clock, via)
    check = LimitCheck(new_key(), limit=10, window_ms=WINDOW_MS, bucket_ms=BUCKET_MS)
    try:
        await connect(proc)
        admitted = 0
        own_redis.pause()
        try:
            for _ in range(15):
                result = await proc.hit([check])
                assert result.source == "fallback"
                admitted += result.admitted
            assert proc.resilient.breaker_state == "open"
        finally:
            own_redis.resume()
        assert admitted == 10
        await back_on_redis(clock, proc)
        assert proc.resilient.carrying
        after = [await proc.hit([check]) for _ in range(20)]
        admitted += sum(r.admitted for r in after)
        assert admitted <= 10, f"{admitted} admitted in one window on a limit of 10"
        # Refused from the carried-over count, without asking Redis: the deny cache
        # keeps only the store's own refusals.
        assert {r.source for r in after} == {"fallback"}
        assert all(r.certain_ms > 0 and r.states[0].remaining == 0 for r in after)
    finally:
        await proc.backend.close()


@VIA
async def test_after_redis_returns_the_window_is_shared_by_both_counts(
    own_redis: RedisServer, via: str
) -> None:
    # 4 admitted during the outage: 6 more after it (the fallback's count binds; Redis
    # saw at most the one call that timed out), then refused; once the fallback's
    # window has passed, Redis alone decides again.
    clock = FakeClock()
    proc = process(own_redis.url, clock, via)
    check = LimitCheck(new_key(), limit=10, window_ms=WINDOW_MS, bucket_ms=BUCKET_MS)
    other = LimitCheck(new_key(), limit=3, window_ms=WINDOW_MS, bucket_ms=BUCKET_MS)
    try:
        await connect(proc)
        own_redis.pause()
        try:
            during = [await proc.hit([check]) for _ in range(4)]
        finally:
            own_redis.resume()
        assert all(r.admitted and r.source == "fallback" for r in during)
        await back_on_redis(clock, proc)
        after = [await proc.hit([check]) for _ in range(8)]
        assert [r.admitted for r in after] == [True] * 6 + [False] * 2
        assert {r.source for r in after[:6]} == {"redis"}
        # The headers tell the tighter of the two counts.
        assert [r.states[0].remaining for r in after[:6]] == [5, 4, 3, 2, 1, 0]
        # A key the fallback never counted goes to Redis as usual, and is not added to
        # the fallback's table.
        size = len(proc.resilient.fallback)
        plain = [await proc.hit([other]) for _ in range(4)]
        assert [r.admitted for r in plain] == [True, True, True, False]
        assert {r.source for r in plain} <= {"redis", "deny-cache"}
        assert len(proc.resilient.fallback) == size
        # Past the fallback's window: carried over no longer, Redis's own count decides.
        clock.advance(WINDOW_MS + BUCKET_MS)
        assert not proc.resilient.carrying
        late = await proc.hit([check])
        assert late.source in {"redis", "deny-cache"}
        assert proc.resilient.carrying is False
    finally:
        await proc.backend.close()


async def test_two_processes_admit_at_most_twice_the_limit(own_redis: RedisServer) -> None:
    # The documented bound for N processes is N x limit; forgetting the fallback's
    # admissions gave two workers 43 on a limit of 15.
    clock = FakeClock()
    procs = [process(own_redis.url, clock), process(own_redis.url, clock, "submit")]
    check = LimitCheck(new_key(), limit=15, window_ms=WINDOW_MS, bucket_ms=BUCKET_MS)
    per_process = [0, 0]
    try:
        await connect(*procs)
        own_redis.pause()
        try:
            for _ in range(20):
                for i, proc in enumerate(procs):
                    per_process[i] += (await proc.hit([check])).admitted
        finally:
            own_redis.resume()
        await back_on_redis(clock, *procs)
        for _ in range(20):
            for i, proc in enumerate(procs):
                per_process[i] += (await proc.hit([check])).admitted
        assert per_process == [15, 15]
    finally:
        for proc in procs:
            await proc.backend.close()


@pytest.mark.parametrize("seed", range(4))
async def test_any_run_of_outages_keeps_each_limit_per_process(
    own_redis: RedisServer, seed: int
) -> None:
    # The class, not one spelling: random runs of outages and recoveries, requests
    # checking two limits of one identity (one call, all or none counted) plus a shadow
    # limit, by hit and by submit, with the clock moving within the window. However the
    # admissions split between the fallback and Redis, neither enforced limit is ever
    # exceeded by the process, and a limit left room is never refused by the carry-over
    # alone.
    rng = random.Random(seed)
    clock = FakeClock()
    via = "submit" if seed % 2 else "hit"
    proc = process(own_redis.url, clock, via)
    short_key, long_key, shadow_key = keys_sharing_tag(3)
    limits = (rng.randint(3, 8), rng.randint(3, 8))
    bound = min(limits)
    checks = [
        LimitCheck(short_key, limit=limits[0], window_ms=WINDOW_MS, bucket_ms=BUCKET_MS),
        LimitCheck(long_key, limits[1], window_ms=2 * WINDOW_MS, bucket_ms=2 * BUCKET_MS),
        LimitCheck(shadow_key, limit=2, window_ms=WINDOW_MS, bucket_ms=BUCKET_MS, enforce=False),
    ]
    admitted = 0
    try:
        await connect(proc)
        for _ in range(rng.randint(2, 3)):
            own_redis.pause()
            try:
                for _ in range(rng.randint(1, 5)):
                    clock.advance(rng.randint(0, 500))
                    admitted += (await proc.hit(checks)).admitted
            finally:
                own_redis.resume()
            await back_on_redis(clock, proc)
            for _ in range(rng.randint(0, 5)):
                clock.advance(rng.randint(0, 500))
                result = await proc.hit(checks)
                admitted += result.admitted
                assert (
                    result.admitted
                    or result.states[0].remaining == 0
                    or (result.states[1].remaining == 0)
                )
            assert admitted <= bound, f"seed {seed}: {admitted} admitted on limits {limits}"
        # Everything above happened within one window of the short limit (fake time
        # moved at most a few seconds a round, Redis's real time less than its window):
        # the process ends with exactly its limit whatever the split, once asked enough.
        for _ in range(bound + 2):
            admitted += (await proc.hit(checks)).admitted
        assert admitted == bound, f"seed {seed}: {admitted} admitted on limits {limits}"
    finally:
        await proc.backend.close()
