"""The counter call by callback (``submit``), which the data plane uses to wait for Redis
without a task: the same answers as ``hit``, given once and never before ``submit`` returns."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.counters.base import CounterUnavailableError, HitResult, LimitCheck
from gateway.counters.coalesce import (
    CoalescerOverloadedError,
    CoalescingBackend,
    StoreTimeoutError,
)
from gateway.counters.factory import open_counter_backend, parse_counter_url, store_client
from gateway.counters.memory import MemoryBackend
from gateway.counters.redis_backend import MAX_REQUESTS_PER_CALL, RedisBackend
from gateway.counters.resp import RespClient
from gateway.policy.loader import load_rules_from_texts
from gateway.policy.matcher import Selection, select
from gateway.policy.model import IdentityKind
from gateway.ratelimit.decision import Decision, Outcome
from gateway.ratelimit.limiter import Limiter
from tests.counters.helpers import LoopLag, ViaSubmit, eventually, new_key
from tests.support.redis_servers import RedisClusterProcess, RedisServer


@pytest.fixture
async def store(redis_server: RedisServer) -> AsyncIterator[RedisBackend]:
    backend = RedisBackend(store_client(parse_counter_url(redis_server.url)), name="redis")
    await backend.load_script()
    yield backend
    await backend.close()


class Answers:
    """Collects what ``submit`` hands back, and whether it came before ``submit`` returned."""

    def __init__(self) -> None:
        self.got: list[HitResult | Exception] = []
        self.early = 0
        self.submitting = False

    def done(self, outcome: HitResult | Exception) -> None:
        if self.submitting:
            self.early += 1
        self.got.append(outcome)

    def submit(self, backend: CoalescingBackend, checks: list[LimitCheck]) -> bool:
        self.submitting = True
        try:
            return backend.submit(checks, self.done)
        finally:
            self.submitting = False

    async def wait_for(self, count: int) -> None:
        async with asyncio.timeout(5):
            while len(self.got) < count:
                await asyncio.sleep(0.001)


async def test_a_burst_of_submits_leaves_in_one_pipeline(
    store: RedisBackend, redis_server: RedisServer
) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=50, window_ms=60_000, bucket_ms=1_000)
    answers = Answers()
    redis_server.cli("CONFIG", "RESETSTAT")
    assert all(answers.submit(coalescing, [check]) for _ in range(200))
    assert answers.got == []  # nothing is answered inside submit
    await answers.wait_for(200)
    results = [r for r in answers.got if isinstance(r, HitResult)]
    assert len(results) == 200 and answers.early == 0
    # Decided in the order submitted: the first 50 admitted, then refusals.
    assert [r.admitted for r in results] == [True] * 50 + [False] * 150
    assert coalescing.batches == 1 and coalescing.batched_calls == 200
    # One pipeline of script calls carrying up to MAX_REQUESTS_PER_CALL requests each.
    calls = -(-200 // MAX_REQUESTS_PER_CALL)
    assert calls > 1 and redis_server.commandstats()["evalsha"] == calls
    await coalescing.close()


async def test_a_bad_request_fails_alone_in_a_call_it_shares(store: RedisBackend) -> None:
    """Requests go several to a script call: one that cannot be sent (a check out of
    range, a key that cannot be encoded) fails alone, and the others of its call are
    answered as if each had been sent by itself."""
    shared = LimitCheck(new_key(), limit=2, window_ms=60_000, bucket_ms=1_000)
    bad_range = LimitCheck(new_key(), limit=1, window_ms=0, bucket_ms=100)
    bad_key = LimitCheck(new_key() + "\udc80", limit=1, window_ms=60_000, bucket_ms=1_000)
    await store.load_script()  # the lean connection is open: send_many sends at once
    got: list[list[HitResult | Exception] | Exception] = []
    batch = [[shared], [bad_range], [shared], [bad_key], [shared]]
    assert store.send_many(batch, got.append)
    for _ in range(200):
        if got:
            break
        await asyncio.sleep(0.01)
    [results] = got
    assert not isinstance(results, Exception)
    assert isinstance(results[1], ValueError) and isinstance(results[3], ValueError)
    answers = [r for r in results if isinstance(r, HitResult)]
    assert [(r.admitted, r.states[0].remaining) for r in answers] == [
        (True, 1),
        (True, 0),
        (False, 0),
    ]


async def test_submit_refuses_by_callback_when_closed_or_overloaded(store: RedisBackend) -> None:
    check = LimitCheck(new_key(), limit=5, window_ms=60_000, bucket_ms=1_000)
    crowded = CoalescingBackend(store, max_pending=1)
    answers = Answers()
    answers.submit(crowded, [check])
    answers.submit(crowded, [check])  # the queue holds one: this one is refused
    await answers.wait_for(2)
    assert answers.early == 0
    assert sum(isinstance(r, CoalescerOverloadedError) for r in answers.got) == 1
    assert sum(isinstance(r, HitResult) for r in answers.got) == 1
    await crowded.close()

    closed = CoalescingBackend(store)
    await closed.close()
    late = Answers()
    late.submit(closed, [check])
    await late.wait_for(1)
    assert late.early == 0 and isinstance(late.got[0], CounterUnavailableError)


async def test_a_failing_callback_does_not_cost_the_rest_of_its_batch(
    store: RedisBackend, caplog: pytest.LogCaptureFixture
) -> None:
    coalescing = CoalescingBackend(store)
    check = LimitCheck(new_key(), limit=10, window_ms=60_000, bucket_ms=1_000)
    answers = Answers()

    def broken(outcome: HitResult | Exception) -> None:
        raise RuntimeError("a bug in one caller")

    with caplog.at_level(logging.ERROR, logger="gateway.counters"):
        answers.submit(coalescing, [check])
        coalescing.submit([check], broken)
        answers.submit(coalescing, [check])
        await answers.wait_for(2)
    assert [r.states[0].remaining for r in answers.got if isinstance(r, HitResult)] == [9, 7]
    assert "callback failed" in caplog.text
    await coalescing.close()


async def test_a_malformed_check_is_the_callers_error_not_an_outage(
    redis_server: RedisServer,
) -> None:
    backend = ViaSubmit(open_counter_backend(redis_server.url, region="us", timeout_seconds=2.0))
    try:
        with pytest.raises(ValueError):
            await backend.hit([LimitCheck(new_key(), 1, window_ms=0, bucket_ms=100)])
        assert (await backend.hit([LimitCheck(new_key(), 1, 1_000, 100)])).source == "redis"
    finally:
        await backend.close()


RULES = """
rules:
  - id: keyed
    match: {path: /x}
    identity: api_key
    limits: {us: 3/60}
  - id: watched
    match: {path: /both}
    identity: api_key
    shadow: true
    limits: {us: 1/60}
  - id: both
    match: {path: /both}
    identity: api_key
    limits: {us: 5/60}
"""


def _api_key(key: str) -> Callable[[IdentityKind], str | None]:
    """The identity lookup of a request that sends ``key`` (as its hash) and nothing else."""
    return lambda kind: key if kind is IdentityKind.API_KEY else None


async def decided_later(limiter: Limiter, sel: Selection) -> Decision:
    """``decide_later`` awaited: the decision (or its exception) handed to ``done``."""
    got: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()

    def done(outcome: Decision | Exception) -> None:
        if isinstance(outcome, Exception):
            got.set_exception(outcome)
        else:
            got.set_result(outcome)

    assert limiter.decide_later("us", sel, done)
    return await got


async def test_the_limiter_decides_by_callback_as_it_decides_by_await(
    redis_server: RedisServer,
) -> None:
    table = load_rules_from_texts([("rules.yaml", RULES)])
    stack = open_counter_backend(redis_server.url, region="us", timeout_seconds=2.0)
    limiter = Limiter({"us": stack})
    memory_limiter = Limiter({"us": MemoryBackend()})
    key = new_key()[-16:]

    def selection(path: str) -> Selection:
        return select(
            table, "us", "GET", path, lambda kind: key if kind is IdentityKind.API_KEY else None
        )

    async def later(path: str) -> Decision:
        return await decided_later(limiter, selection(path))

    try:
        by_callback = [await later("/x") for _ in range(4)]
        assert [d.outcome for d in by_callback] == [Outcome.ALLOWED] * 3 + [Outcome.LIMITED]
        assert [d.reports[0].remaining for d in by_callback] == [2, 1, 0, 0]
        assert by_callback[-1].retry_after >= 1 and by_callback[0].source == "redis"
        # A backend without ``submit`` goes through ``decide``.
        assert not memory_limiter.decide_later("us", selection("/x"), lambda _: None)
        # Shadow rules make several calls, by callback too: the same decisions as
        # awaited ones, for another key with the same history.
        other = new_key()[-16:]

        def other_selection(path: str) -> Selection:
            return select(
                table, "us", "GET", path, lambda k: other if k is IdentityKind.API_KEY else None
            )

        called = [await later("/both") for _ in range(7)]
        awaited = [await limiter.decide("us", other_selection("/both")) for _ in range(7)]

        def seen(d: Decision) -> list[object]:
            return [d.outcome, d.rule_id, [(r.name, r.remaining, r.shadow) for r in d.reports]]

        assert [seen(d) for d in called] == [seen(d) for d in awaited]
        assert [d.outcome for d in called] == [Outcome.ALLOWED] * 5 + [Outcome.LIMITED] * 2
        assert len(called[0].reports) == 2 and called[0].source == "redis"
    finally:
        await stack.close()


async def test_the_groups_decide_now_made_serve_only_the_request_they_were_made_for(
    redis_server: RedisServer,
) -> None:
    # decide_now keeps the counter calls it made for a request it could not answer, for
    # that request's decide_later or decide; any other request makes its own.
    table = load_rules_from_texts([("rules.yaml", RULES)])
    stack = open_counter_backend(redis_server.url, region="us", timeout_seconds=2.0)
    limiter = Limiter({"us": stack})
    first, second = new_key()[-16:], new_key()[-16:]

    def selection(key: str) -> Selection:
        return select(table, "us", "GET", "/x", _api_key(key))

    try:
        asked = selection(first)
        assert limiter.decide_now("us", asked) is None  # (Redis: asked later)
        # Another request's selection is decided by its own calls, not the kept ones.
        other = await decided_later(limiter, selection(second))
        assert other.identity_hash == second and other.reports[0].remaining == 2
        # The kept ones were not consumed by it: the request they were made for uses them.
        mine = await decided_later(limiter, asked)
        assert mine.identity_hash == first and mine.reports[0].remaining == 2
        # Made again when nothing is kept (counted once each time, never twice).
        again = await decided_later(limiter, asked)
        assert again.reports[0].remaining == 1
        assert limiter.decide_now("us", asked) is None
        awaited = await limiter.decide("us", asked)
        assert awaited.reports[0].remaining == 0
    finally:
        await stack.close()


CEILING_RULES = """
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 4/60}
rules:
  - id: keyed
    match: {path: /x}
    identity: api_key
    limits: {us: 3/60}
"""


async def test_on_a_cluster_a_rule_and_its_ceiling_are_decided_by_callback(
    redis_cluster: RedisClusterProcess,
) -> None:
    # Their keys hash to other slots, so they are two calls (separate_calls): both by
    # callback, with the decisions an awaited decide gives for another client's history.
    table = load_rules_from_texts([("rules.yaml", CEILING_RULES)])
    stack = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    limiter = Limiter({"us": stack}, separate_calls=frozenset({"us"}))

    def selection(client: str, key: str) -> Selection:
        ids = {IdentityKind.API_KEY: key, IdentityKind.IP: client}
        return select(table, "us", "GET", "/x", ids.get)

    def seen(d: Decision) -> list[object]:
        return [d.outcome, d.rule_id, sorted((r.name, r.remaining) for r in d.reports)]

    try:
        mine, theirs = new_key()[-12:], new_key()[-12:]
        # two keys from one address: the first uses up the rule, the second meets the ceiling
        plan = ["a"] * 4 + ["b"] * 2
        called = [await decided_later(limiter, selection(mine, f"{mine}{k}")) for k in plan]
        awaited = [await limiter.decide("us", selection(theirs, f"{theirs}{k}")) for k in plan]
        assert [seen(d) for d in called] == [seen(d) for d in awaited]
        # (separate calls: the rule's refusal still counted against the ceiling)
        assert [d.outcome for d in called] == [Outcome.ALLOWED] * 3 + [Outcome.LIMITED] * 3
        assert [d.rule_id for d in called[3:]] == ["keyed", "per-address", "per-address"]
    finally:
        await stack.close()


async def test_the_lean_way_reloads_a_lost_script_and_survives_a_restart(
    own_redis: RedisServer,
) -> None:
    store = RedisBackend(store_client(parse_counter_url(own_redis.url)), name="redis")
    coalescing = CoalescingBackend(store, call_timeout_seconds=2.0, queue_timeout_seconds=2.0)
    check = LimitCheck(new_key(), limit=100, window_ms=60_000, bucket_ms=1_000)
    try:
        await store.load_script()  # the lean connection is open from here on
        answers = Answers()
        for _ in range(5):
            answers.submit(coalescing, [check])
        await answers.wait_for(5)
        assert [r.states[0].remaining for r in answers.got if isinstance(r, HitResult)] == [
            99,
            98,
            97,
            96,
            95,
        ]
        own_redis.cli("SCRIPT", "FLUSH")
        loads = store.script_loads
        flushed = Answers()
        for _ in range(3):
            flushed.submit(coalescing, [check])
        await flushed.wait_for(3)
        assert [r.states[0].remaining for r in flushed.got if isinstance(r, HitResult)] == [
            94,
            93,
            92,
        ]
        assert store.script_loads == loads + 1
        own_redis.restart()  # no persistence: counts start over; the connection is dead
        restarted = Answers()
        for _ in range(3):
            restarted.submit(coalescing, [check])
        await restarted.wait_for(3)
        assert [r.states[0].remaining for r in restarted.got if isinstance(r, HitResult)] == [
            99,
            98,
            97,
        ]
        assert coalescing.wire_timeouts == 0
    finally:
        await coalescing.close()
        await store.close()


async def test_the_lean_way_times_out_on_a_hung_store_and_recovers(own_redis: RedisServer) -> None:
    store = RedisBackend(store_client(parse_counter_url(own_redis.url)), name="redis")
    coalescing = CoalescingBackend(
        store, call_timeout_seconds=0.05, queue_timeout_seconds=1.0, batch_timeout_seconds=1.0
    )
    check = LimitCheck(new_key(), limit=100, window_ms=60_000, bucket_ms=1_000)
    wire = store.client
    assert isinstance(wire, RespClient)
    try:
        await store.load_script()
        own_redis.pause()
        try:
            hung = Answers()
            async with LoopLag() as lag:
                started = asyncio.get_running_loop().time()
                for _ in range(4):
                    hung.submit(coalescing, [check])
                await hung.wait_for(4)
                waited = asyncio.get_running_loop().time() - started
            assert all(isinstance(r, StoreTimeoutError) for r in hung.got)
            # The store timeout (50 ms), not the hard bound (1 s). A timer the loop ran
            # late is re-armed for as long as it was late, so a slow machine's stalls
            # count twice.
            assert waited < 0.05 + 0.2 + 2 * lag.stalled, (waited, lag.stalled)
            assert coalescing.wire_timeouts == 1
            # Past the hard bound the connection is dropped (it has no address then).
            await eventually(10, lambda: not wire.local_address, "the connection dropped")
        finally:
            own_redis.resume()
        back = Answers()
        back.submit(coalescing, [check])
        await back.wait_for(1)
        assert isinstance(back.got[0], HitResult) and back.got[0].admitted
        assert wire.connects == 2
    finally:
        await coalescing.close()
        await store.close()
