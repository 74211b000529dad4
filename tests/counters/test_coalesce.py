"""Concurrent checks share pipelines instead of one round trip each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from gateway.counters.base import CounterUnavailableError, HitResult, LimitCheck, LimitState
from gateway.counters.coalesce import (
    CoalescerOverloadedError,
    CoalescingBackend,
    StoreTimeoutError,
)
from gateway.counters.factory import parse_counter_url, redis_client
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resilient import ResilientBackend
from tests.counters.helpers import RecordingEvents, new_key
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


class FakeStore:
    """A batch store answering every check as admitted; keys in ``hang`` never answer
    until ``release`` is set, and each round trip takes ``delay`` seconds."""

    name = "fake"

    def __init__(self, delay: float = 0.0, hang: frozenset[str] = frozenset()) -> None:
        self.delay = delay
        self.hang = hang
        self.release = asyncio.Event()
        self.round_trips: list[list[str]] = []

    async def _trip(self, batch: Sequence[Sequence[LimitCheck]]) -> list[HitResult | Exception]:
        self.round_trips.append([checks[0].key for checks in batch])
        await asyncio.sleep(self.delay)
        if any(checks[0].key in self.hang for checks in batch):
            await self.release.wait()
        return [HitResult(True, (LimitState(True, 1, 0),), source="redis") for _ in batch]

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        result = (await self._trip([checks]))[0]
        assert isinstance(result, HitResult)
        return result

    async def hit_many(self, batch: Sequence[Sequence[LimitCheck]]) -> list[HitResult | Exception]:
        return await self._trip(batch)

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        self.release.set()


def checks_named(*names: str) -> list[list[LimitCheck]]:
    return [[LimitCheck(name, 1_000, 60_000, 1_000)] for name in names]


async def test_time_waiting_for_a_turn_is_not_store_time() -> None:
    # Each round trip takes 10 ms against a 250 ms store timeout; the last checks
    # wait far longer than that in the queue (one check per pipeline) and still pass.
    store = FakeStore(delay=0.01)
    coalescing = CoalescingBackend(
        store, max_batch=1, call_timeout_seconds=0.25, queue_timeout_seconds=30.0
    )
    try:
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(
            *(coalescing.hit(c) for c in checks_named(*(f"k{i}" for i in range(60))))
        )
        assert asyncio.get_running_loop().time() - started > 0.25 * 2
        assert all(r.admitted and r.source == "redis" for r in results)
        assert coalescing.wire_timeouts == 0 and coalescing.queue_timeouts == 0
    finally:
        await coalescing.close()


async def test_a_round_trip_past_the_timeout_fails_its_batch_and_what_queued_behind_it() -> None:
    """The checks queued behind a round trip that ran out of time fail with it: sent
    next, they would wait on the same store once more (replies on one connection come
    in order, so behind the stuck one), and an outage would add two timeouts to them,
    not one (SPEC 4; tests/counters/test_outage_latency.py on a frozen redis-server).
    The slot is free again: checks that come later go out."""
    store = FakeStore(hang=frozenset({"stuck"}))
    coalescing = CoalescingBackend(
        store, max_batch=3, call_timeout_seconds=0.05, queue_timeout_seconds=30.0
    )
    try:
        names = ("first", "stuck", "a", "b", "c", "d")
        results = await asyncio.wait_for(
            asyncio.gather(*(coalescing.hit(c) for c in checks_named(*names)),
                           return_exceptions=True),
            10.0,
        )  # fmt: skip
        assert store.round_trips == [["first"], ["stuck", "a", "b"]]
        assert isinstance(results[0], HitResult)
        assert all(isinstance(r, StoreTimeoutError) for r in results[1:])
        assert coalescing.wire_timeouts == 1 and coalescing.queue_failed == 2
        [later] = checks_named("e")
        assert isinstance(await asyncio.wait_for(coalescing.hit(later), 10.0), HitResult)
        assert store.round_trips[-1] == ["e"]
    finally:
        await coalescing.close()


async def test_a_check_that_waits_too_long_for_a_turn_is_overload_not_an_outage() -> None:
    store = FakeStore(hang=frozenset({"slow"}))
    coalescing = CoalescingBackend(
        store, call_timeout_seconds=30.0, queue_timeout_seconds=0.05, batch_timeout_seconds=30.0
    )
    events = RecordingEvents()
    resilient = ResilientBackend(coalescing, timeout_seconds=30.0, events=events)
    try:
        slow = asyncio.ensure_future(resilient.hit(checks_named("slow")[0]))
        await asyncio.sleep(0)
        waiting = [LimitCheck(new_key(), 10, 60_000, 1_000) for _ in range(3)]
        answers = await asyncio.wait_for(
            asyncio.gather(*(resilient.hit([c]) for c in waiting)), 10.0
        )
        assert {a.source for a in answers} == {"fallback"} and all(a.admitted for a in answers)
        closed = LimitCheck(new_key(), 10, 60_000, 1_000, fail_open=False)
        with pytest.raises(CounterUnavailableError):
            await asyncio.wait_for(resilient.hit([closed]), 10.0)
        assert coalescing.queue_timeouts == 4
        # Not a store failure: nothing reported, the breaker did not count it.
        assert events.errors == [] and events.breaker == []
        assert resilient.breaker_state == "closed"
        store.release.set()
        assert (await asyncio.wait_for(slow, 10.0)).source == "redis"
    finally:
        await resilient.close()


async def test_a_full_queue_is_refused_as_overload() -> None:
    store = FakeStore(hang=frozenset({"slow"}))
    coalescing = CoalescingBackend(store, max_pending=2)
    try:
        slow = asyncio.ensure_future(coalescing.hit(checks_named("slow")[0]))
        await asyncio.sleep(0)
        queued = [asyncio.ensure_future(coalescing.hit(c)) for c in checks_named("a", "b")]
        await asyncio.sleep(0)
        with pytest.raises(CoalescerOverloadedError):
            await coalescing.hit(checks_named("c")[0])
        store.release.set()
        assert all(r.admitted for r in await asyncio.gather(slow, *queued))
    finally:
        await coalescing.close()


class OnceSlow(FakeStore):
    """A healthy store whose first round trip is slower than the timeout."""

    async def _trip(self, batch):
        self.round_trips.append([checks[0].key for checks in batch])
        await asyncio.sleep(0.08 if len(self.round_trips) == 1 else 0.001)
        return [HitResult(True, (), source="redis") for _ in batch]


async def test_one_slow_reply_does_not_open_the_breaker_through_the_checks_queued_behind_it():
    """The checks queued behind a timed-out round trip fail with it (an outage adds one
    timeout), but the breaker counts that round trip's own checks only: with five
    queued behind one slow reply it stays closed, and the next check goes to the store."""
    from gateway.counters.resilient import ResilientBackend

    store = OnceSlow()
    coalescing = CoalescingBackend(store, call_timeout_seconds=0.05, queue_timeout_seconds=1.0)
    resilient = ResilientBackend(
        coalescing, timeout_seconds=0.05, failure_threshold=5, reset_seconds=1.0
    )
    try:
        first = asyncio.ensure_future(resilient.hit(checks_named("first")[0]))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(resilient.hit(c)) for c in checks_named(*"abcde")]
        await asyncio.gather(first, *rest)
        assert coalescing.queue_failed == 5
        assert resilient.breaker_state == "closed"
        later = await resilient.hit(checks_named("later")[0])
        assert later.source == "redis"
    finally:
        await coalescing.close()


async def test_a_check_queued_while_the_waiting_ones_fail_goes_out():
    """A caller answered by that failure may queue a new check at once (a pipelined
    request starting): it is not failed with the ones that waited, it goes out."""
    store = OnceSlow()
    coalescing = CoalescingBackend(store, call_timeout_seconds=0.05, queue_timeout_seconds=1.0)
    loop = asyncio.get_running_loop()
    late: asyncio.Future[object] = loop.create_future()

    def queued_failed(outcome: object) -> None:
        if not late.done() and isinstance(outcome, Exception):
            coalescing.submit(checks_named("late")[0], late.set_result)

    try:
        first = asyncio.ensure_future(coalescing.hit(checks_named("first")[0]))
        await asyncio.sleep(0.01)
        coalescing.submit(checks_named("queued")[0], queued_failed)
        with pytest.raises(StoreTimeoutError):
            await first
        outcome = await asyncio.wait_for(late, 5.0)
        assert isinstance(outcome, HitResult), outcome
        assert ["late"] in store.round_trips
    finally:
        await coalescing.close()
