"""Outages of the counter store: kill -9, a hung server, and the way back."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.counters.base import CounterBackend, CounterUnavailableError, LimitCheck
from gateway.counters.factory import open_counter_backend
from gateway.counters.resilient import CircuitBreaker, ResilientBackend, failure_kind
from tests.counters.helpers import LoopLag, RecordingEvents, called, eventually, new_key
from tests.support.redis_servers import RedisServer

WAIT_SECONDS = 10.0
# The outage tests run through both ways of calling the stack: ``hit`` (tools, cluster
# tests) and ``submit`` (the data plane's callback path).
VIA = pytest.mark.parametrize("via", ["hit", "submit"])


@dataclass
class Load:
    """Workers hitting the backend in a loop, recording every answer."""

    backend: CounterBackend
    workers: int = 16
    sources: list[str] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    slowest: float = 0.0
    _stop: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self.workers)]

    async def _work(self) -> None:
        check = LimitCheck(new_key(), limit=1_000_000, window_ms=60_000, bucket_ms=1_000)
        while not self._stop:
            started = time.monotonic()
            try:
                result = await self.backend.hit([check])
                self.sources.append(result.source)
            except Exception as exc:
                self.errors.append(exc)
            self.slowest = max(self.slowest, time.monotonic() - started)
            await asyncio.sleep(0.002)

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


def resilient_of(backend: CounterBackend) -> ResilientBackend:
    inner = getattr(backend, "inner", None)
    assert isinstance(inner, ResilientBackend)
    return inner


@VIA
async def test_kill9_under_load_falls_back_then_returns_to_redis(
    own_redis: RedisServer, via: str
) -> None:
    events = RecordingEvents()
    backend = called(
        open_counter_backend(own_redis.url, region="us", events=events, breaker_reset_seconds=0.2),
        via,
    )
    load = Load(backend)
    lag = LoopLag()
    lag.start()
    load.start()
    try:
        await eventually(
            WAIT_SECONDS, lambda: load.sources.count("redis") > 50, "traffic reaches redis"
        )
        # Off the loop (as the restart below): the calls in flight must not be timed
        # with the wait for the process, which a slow machine stretches.
        await asyncio.to_thread(own_redis.kill9)
        await eventually(WAIT_SECONDS, lambda: "open" in events.breaker, "the breaker opens")
        mark = len(load.sources)
        await eventually(WAIT_SECONDS, lambda: len(load.sources) > mark + 100, "traffic continues")
        assert "fallback" in load.sources[mark:]
        assert events.fallbacks > 0 and events.errors
        assert set(events.errors) <= {"connection", "timeout", "error"}

        # Fail-open answers are local counts: still bounded per instance.
        local = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
        answers = [await backend.hit([local]) for _ in range(30)]
        assert sum(a.admitted for a in answers) == 10
        assert {a.source for a in answers} <= {"fallback", "deny-cache"}
        # Fail-closed checks refuse to guess.
        closed = LimitCheck(new_key(), 10, 60_000, 1_000, fail_open=False)
        with pytest.raises(CounterUnavailableError):
            await backend.hit([closed])
        # A fail-closed *shadow* check never blocks, so fail-open still applies.
        shadow_closed = LimitCheck(new_key(), 10, 60_000, 1_000, enforce=False, fail_open=False)
        assert (await backend.hit([shadow_closed])).source == "fallback"

        await asyncio.to_thread(own_redis.restart)
        mark = len(load.sources)
        await eventually(
            WAIT_SECONDS, lambda: "redis" in load.sources[mark:], "traffic returns to redis"
        )
        await eventually(WAIT_SECONDS, lambda: events.breaker[-1] == "closed", "the breaker closes")
        assert "half_open" in events.breaker
        # Counted in Redis again. Without the load: 16 workers on a slow machine could
        # make one of these calls miss the 50 ms store timeout (then the fallback answers).
        await load.stop()
        fresh = LimitCheck(new_key(), limit=3, window_ms=60_000, bucket_ms=1_000)
        results = [await backend.hit([fresh]) for _ in range(4)]
        assert [r.admitted for r in results] == [True, True, True, False]
        assert results[0].source == "redis"
    finally:
        await load.stop()
        await lag.stop()
        await backend.close()
    assert not load.errors  # fail-open: nothing raised, whatever happened
    # Generous: the timeout is 50 ms. Time the loop did not run (a slow, loaded machine)
    # is in a call's time, twice at most (the store timeout is re-armed for it).
    assert load.slowest < 1.0 + 2 * lag.stalled, (load.slowest, lag.stalled)


@VIA
async def test_hung_server_times_out_and_recovers(own_redis: RedisServer, via: str) -> None:
    events = RecordingEvents()
    backend = called(
        open_counter_backend(own_redis.url, region="us", events=events, breaker_reset_seconds=0.2),
        via,
    )
    load = Load(backend, workers=8)
    lag = LoopLag()
    lag.start()
    load.start()
    try:
        await eventually(
            WAIT_SECONDS, lambda: load.sources.count("redis") > 20, "traffic reaches redis"
        )
        own_redis.pause()
        try:
            await eventually(WAIT_SECONDS, lambda: "open" in events.breaker, "the breaker opens")
            assert "timeout" in events.errors
            mark = len(load.sources)
            await eventually(
                WAIT_SECONDS, lambda: len(load.sources) > mark + 50, "traffic continues"
            )
            assert set(load.sources[mark:]) == {"fallback"}
        finally:
            own_redis.resume()
        mark = len(load.sources)
        await eventually(
            WAIT_SECONDS, lambda: "redis" in load.sources[mark:], "traffic returns to redis"
        )
    finally:
        await load.stop()
        await lag.stop()
        await backend.close()
    assert not load.errors
    # As above: the 50 ms timeout, and room for the time a slow machine stalled the loop.
    assert load.slowest < 1.0 + 2 * lag.stalled, (load.slowest, lag.stalled)


@VIA
async def test_store_down_from_the_start(tmp_path: Path, via: str) -> None:
    server = RedisServer(tmp_path / "never-started")  # a free port nobody listens on
    events = RecordingEvents()
    backend = called(open_counter_backend(server.url, region="eu", events=events), via)
    try:
        check = LimitCheck(new_key(region="eu"), 2, 60_000, 1_000)
        results = [await backend.hit([check]) for _ in range(3)]
        assert [r.admitted for r in results] == [True, True, False]
        assert {r.source for r in results} == {"fallback"}
        assert not await backend.healthy()
        assert events.errors and set(events.errors) <= {"connection", "timeout"}
    finally:
        await backend.close()


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_breaker_opens_after_consecutive_failures_and_probes_once() -> None:
    clock = FakeTime()
    events = RecordingEvents()
    breaker = CircuitBreaker(failure_threshold=3, reset_seconds=1.0, events=events, monotonic=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.failure()
    assert breaker.allow()
    breaker.success()  # a success resets the count
    for _ in range(3):
        assert breaker.allow()
        breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()  # the single probe
    assert breaker.state == "half_open" and not breaker.allow()
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow()
    assert events.breaker == ["open", "half_open", "open", "half_open", "closed"]


def test_a_cancelled_probe_frees_the_probe_slot() -> None:
    clock = FakeTime()
    breaker = CircuitBreaker(failure_threshold=1, reset_seconds=1.0, monotonic=clock)
    breaker.allow()
    breaker.failure()
    clock.now += 1.0
    assert breaker.allow()
    breaker.release()
    assert breaker.allow()


def test_failure_kinds() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    assert failure_kind(TimeoutError()) == "timeout"
    assert failure_kind(RedisTimeoutError()) == "timeout"
    assert failure_kind(RedisConnectionError()) == "connection"
    assert failure_kind(ConnectionRefusedError()) == "connection"
    assert failure_kind(ResponseError("WRONGTYPE")) == "error"


@VIA
async def test_a_burst_on_a_healthy_store_admits_exactly_the_limit(
    redis_server: RedisServer, via: str
) -> None:
    # Regression: the 50 ms store timeout used to cover the wait in the coalescing
    # queue, so a burst timed out locally, fell back to local counts (over-admitting)
    # and opened the breaker against a perfectly healthy store.
    events = RecordingEvents()
    backend = called(open_counter_backend(redis_server.url, region="us", events=events), via)
    try:
        check = LimitCheck(new_key(10), limit=15, window_ms=10_000, bucket_ms=1_000)
        results = await asyncio.wait_for(
            asyncio.gather(*(backend.hit([check]) for _ in range(1000))), WAIT_SECONDS
        )
        assert sum(r.admitted for r in results) == 15
        assert {r.source for r in results} == {"redis"}
        assert events.errors == [] and events.fallbacks == 0
        assert events.breaker == [] and resilient_of(backend).breaker_state == "closed"
    finally:
        await backend.close()
