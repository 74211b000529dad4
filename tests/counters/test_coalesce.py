"""Concurrent checks share pipelines instead of one round trip each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.counters.base import CounterUnavailableError, LimitCheck
from gateway.counters.coalesce import CoalescingBackend
from gateway.counters.factory import parse_counter_url, redis_client
from gateway.counters.redis_backend import RedisBackend
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisServer


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(redis_client(parse_counter_url(redis_server.url)), name="redis")
    await backend.load_script()
    yield backend
    await backend.close()


async def test_a_burst_takes_two_round_trips(
    store: RedisBackend, redis_server: RedisServer
) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=50, window_ms=60_000, bucket_ms=1_000)
    redis_server.cli("CONFIG", "RESETSTAT")
    trips = store.round_trips
    results = await asyncio.gather(*(coalescing.hit([check]) for _ in range(200)))
    assert sum(r.admitted for r in results) == 50
    # The first check finds nothing in flight and goes alone; the 199 that queued
    # behind it leave together in one pipeline.
    assert store.round_trips - trips == 2
    assert coalescing.batches == 2 and coalescing.batched_calls == 200
    assert redis_server.commandstats()["evalsha"] == 200


async def test_batches_are_bounded_in_size(store: RedisBackend) -> None:
    coalescing = CoalescingBackend(store, max_batch=16)
    check = LimitCheck(new_key(), limit=1_000, window_ms=60_000, bucket_ms=1_000)
    results = await asyncio.gather(*(coalescing.hit([check]) for _ in range(100)))
    assert all(r.admitted for r in results)
    assert coalescing.batches == 1 + 7  # the first alone, then ceil(99 / 16)


async def test_checks_arriving_during_a_round_trip_join_the_next_pipeline(
    store: RedisBackend,
) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=1_000, window_ms=60_000, bucket_ms=1_000)
    first = asyncio.ensure_future(coalescing.hit([check]))
    await asyncio.sleep(0)  # the first check is now on its way
    later = [asyncio.ensure_future(coalescing.hit([check])) for _ in range(30)]
    await asyncio.gather(first, *later)
    assert coalescing.batches == 2


async def test_one_bad_entry_does_not_fail_the_others(store: RedisBackend) -> None:
    coalescing = CoalescingBackend(store)
    good = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
    bad = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=0)
    results = await asyncio.gather(
        coalescing.hit([good]), coalescing.hit([bad]), coalescing.hit([good]),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(results[1], ValueError)
    assert [r.states[0].remaining for r in (results[0], results[2])] == [9, 8]  # type: ignore[union-attr]
    assert coalescing.batches == 2


async def test_a_cancelled_caller_is_not_sent(store: RedisBackend) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
    cancelled = asyncio.ensure_future(coalescing.hit([check]))
    kept = asyncio.ensure_future(coalescing.hit([check]))
    cancelled.cancel()
    result = await kept
    assert result.states[0].remaining == 9
    assert coalescing.batched_calls == 1


async def test_closed_coalescer_refuses_new_checks(store: RedisBackend) -> None:
    coalescing = CoalescingBackend(store)
    await coalescing.close()
    with pytest.raises(CounterUnavailableError):
        await coalescing.hit([LimitCheck(new_key(), 1, 1_000, 100)])


async def test_a_caller_that_gives_up_does_not_cost_the_connection(
    store: RedisBackend, redis_server: RedisServer
) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
    await coalescing.hit([check])  # a pooled connection exists now

    def connections() -> int:
        for line in redis_server.cli("INFO", "stats").splitlines():
            if line.startswith("total_connections_received:"):
                return int(line.split(":")[1])
        raise AssertionError("no total_connections_received in INFO stats")

    before = connections()
    impatient = asyncio.ensure_future(coalescing.hit([check]))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the command is on the wire
    impatient.cancel()
    result = await coalescing.hit([check])
    # The abandoned call still completed (and counted): the connection survived.
    assert result.states[0].remaining == 7
    assert connections() == before + 1  # just redis-cli's own connection for INFO
