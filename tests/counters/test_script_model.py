"""The sliding-window script against the arithmetic it implements, on a real redis-server.

The script reads the store's clock (TIME); here a copy of it reads the time from its
last argument instead, so sequences of calls can move time as they like (far beyond a
window, back after a failover) while every other line runs as shipped. Each call's reply
is compared with a model written from ``gateway.ratelimit.window`` alone, and for time
that only moves forward with ``MemoryBackend``, the in-process backend, so all three
agree on every request: admitted or not, each limit's allowed, remaining and reset.
"""

from __future__ import annotations

import struct
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.counters.base import LimitCheck
from gateway.counters.memory import MemoryBackend
from gateway.counters.redis_backend import (
    cross_slot_text,
    parse_reply,
    script_args,
    script_text,
)
from gateway.ratelimit.window import (
    bucket_ms_for,
    current_bucket,
    ms_until_room,
    oldest_counted_bucket,
)
from tests.support.redis_servers import RedisServer

CLOCK_LINES = (
    "local t = redis.call('TIME')\n"
    "local now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)\n"
    "local nargs = #ARGV\n"
)


def clocked_script() -> str:
    """The shipped script, reading ``now`` (ms) from its last argument instead of TIME."""
    text = script_text()
    assert text.count(CLOCK_LINES) == 1, "the script's clock lines changed: update this test"
    return text.replace(CLOCK_LINES, "local now = tonumber(ARGV[#ARGV])\nlocal nargs = #ARGV - 1\n")


@pytest.fixture(scope="module")
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    yield client
    client.close()


@dataclass
class Model:
    """window.py's arithmetic over a dict of buckets per key: the specification."""

    buckets: dict[str, dict[int, int]] = field(default_factory=dict)

    def hit(
        self, checks: Sequence[LimitCheck], now: int
    ) -> tuple[bool, list[tuple[bool, int, int]]]:
        counted = []
        for check in checks:
            oldest = oldest_counted_bucket(now, check.window_ms, check.bucket_ms)
            live = {b: c for b, c in self.buckets.get(check.key, {}).items() if b >= oldest}
            self.buckets[check.key] = live
            counted.append(live)
        admitted = all(
            sum(live.values()) < check.limit
            for check, live in zip(checks, counted, strict=True)
            if check.enforce
        )
        states = []
        for check, live in zip(checks, counted, strict=True):
            total = sum(live.values())
            has_room = total < check.limit
            if admitted and has_room:
                bucket = current_bucket(now, check.bucket_ms)
                live[bucket] = live.get(bucket, 0) + 1
                total += 1
            reset = ms_until_room(
                sorted(live.items()), total, check.limit, now, check.window_ms, check.bucket_ms
            )
            states.append((has_room, max(0, check.limit - total), reset))
        return admitted, states


class Script:
    def __init__(self, raw: redis.Redis) -> None:
        self.raw = raw
        self.sha = raw.script_load(clocked_script())

    def hit(
        self, checks: Sequence[LimitCheck], now: int
    ) -> tuple[bool, list[tuple[bool, int, int]]]:
        reply = self.raw.evalsha(self.sha, *script_args(checks), now)
        result, store_now = parse_reply(reply, len(checks))
        assert store_now == now
        return result.admitted, [(s.allowed, s.remaining, s.reset_ms) for s in result.states]


WINDOWS_MS = (60_000, 120_000, 3_600_000)  # long: the keys' real expiry never cuts in

# One step: (identities' index, which windows, limits, enforce flags, time to move (ms)).
steps = st.lists(
    st.tuples(
        st.integers(0, 2),
        st.lists(st.sampled_from(WINDOWS_MS), min_size=1, max_size=3),
        st.lists(st.integers(0, 12), min_size=3, max_size=3),
        st.lists(st.booleans(), min_size=3, max_size=3),
        st.one_of(
            st.just(0),  # the same bucket
            st.integers(1, 3_000),
            st.integers(3_000, 70_000),  # part of a window leaves
            st.integers(70_000, 4_000_000),  # whole windows pass
        ),
    ),
    min_size=1,
    max_size=80,
)


def _checks(
    tag: str, windows: list[int], limits: list[int], enforce: list[bool]
) -> list[LimitCheck]:
    return [
        LimitCheck(
            f"rl:{{{tag}}}:{i}:{window}",
            limit=limits[i],
            window_ms=window,
            bucket_ms=bucket_ms_for(window),
            enforce=enforce[i] or i == 0,  # at least the rule's own limit is enforced
        )
        for i, window in enumerate(windows)
    ]


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(steps=steps)
def test_the_script_agrees_with_the_arithmetic_and_the_memory_backend(
    raw: redis.Redis, steps: list[tuple[int, list[int], list[int], list[bool], int]]
) -> None:
    script, model = Script(raw), Model()
    now = 1_764_000_000_000 + 537  # a Unix time in ms, not on a bucket edge
    memory = MemoryBackend(clock=lambda: now)
    run = uuid.uuid4().hex
    for who, windows, limits, enforce, step in steps:
        now += step
        checks = _checks(f"{run}:{who}", windows, limits, enforce)
        expected = model.hit(checks, now)
        assert script.hit(checks, now) == expected
        result = memory.hit_now(checks)
        assert (
            result.admitted,
            [(s.allowed, s.remaining, s.reset_ms) for s in result.states],
        ) == expected


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    moves=st.lists(
        st.tuples(st.integers(-200_000, 70_000), st.sampled_from(("a", "b", "ab"))),
        min_size=1,
        max_size=50,
    ),
    limits=st.tuples(st.integers(1, 8), st.integers(1, 8)),
)
def test_a_store_clock_that_steps_back_is_counted_as_the_arithmetic_says(
    raw: redis.Redis, moves: list[tuple[int, str]], limits: tuple[int, int]
) -> None:
    """After a failover the new master's clock may be behind: a bucket older than the
    newest goes in its place, and nothing counted is lost or counted twice, nor is a
    bucket that left the window counted again (a refused request records what left)."""
    script, model = Script(raw), Model()
    tag = uuid.uuid4().hex
    checks = {
        name: LimitCheck(f"rl:{{{tag}}}:{name}", limit, 60_000, bucket_ms_for(60_000))
        for name, limit in zip("ab", limits, strict=True)
    }
    now = 1_764_000_000_000
    for move, which in moves:
        now += move
        request = [checks[name] for name in which]
        assert script.hit(request, now) == model.hit(request, now)


def test_a_refused_request_records_what_left_the_window(raw: redis.Redis) -> None:
    """The case that found it: B's bucket leaves while A refuses the request; then the
    clock steps back and B must not count that bucket again."""
    script, model = Script(raw), Model()
    tag = uuid.uuid4().hex
    a = LimitCheck(f"rl:{{{tag}}}:a", 1, 60_000, 1_000)
    b = LimitCheck(f"rl:{{{tag}}}:b", 2, 60_000, 1_000)
    start = 1_764_000_000_000
    for at, request in ((0, [b]), (30_000, [a]), (30_000, [b]), (61_500, [a, b]), (40_000, [b])):
        assert script.hit(request, start + at) == model.hit(request, start + at)


def test_a_rewrite_after_the_clock_stepped_back_keeps_the_newer_buckets_alive(
    raw: redis.Redis,
) -> None:
    script = Script(raw)
    check = LimitCheck(f"rl:{{{uuid.uuid4().hex}}}:60s", 5, 60_000, 1_000)
    start = 1_764_000_000_000
    script.hit([check], start + 200_000)  # counted at T+200 s
    script.hit([check], start + 50_000)  # the clock stepped back 150 s: rewritten
    # The T+200 s bucket is counted until T+261 s: the key must outlive that (in the
    # store's clock, 211 s after the second call).
    assert raw.pttl(check.key) > 211_000


@pytest.mark.parametrize(
    "value",
    [
        b"x" * 24,  # a huge total
        struct.pack("<ddd", 0, float("nan"), 0),
        struct.pack("<ddd", 8, 1, 0) + b"y" * 16,  # first not on a record
        struct.pack("<ddd", 0, -3, 0),
    ],
)
def test_a_value_that_only_looks_like_a_counter_is_counted_from_scratch(
    raw: redis.Redis, value: bytes
) -> None:
    script = Script(raw)
    check = LimitCheck(f"rl:{{{uuid.uuid4().hex}}}:60s", 2, 60_000, 1_000)
    raw.set(check.key, value)
    now = 1_764_000_000_000
    assert script.hit([check], now) == (True, [(True, 1, 61_000)])
    assert raw.pttl(check.key) > 0


def test_a_counted_call_writes_a_few_bytes_in_place(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    """The common case (the newest bucket counted again, or a new one after it) is one
    SETRANGE of a record and the trailer, not the value rewritten: its cost does not
    grow with the buckets the window holds."""
    script = Script(raw)
    check = LimitCheck(f"rl:{{{uuid.uuid4().hex}}}:60s", 10_000, 60_000, 1_000)
    now = 1_764_000_000_000
    for _ in range(50):  # fifty buckets: the value holds fifty records
        now += 1_000
        script.hit([check], now)
    before = redis_server.commandstats()
    for _ in range(20):
        now += 400  # the same bucket or the next one
        assert script.hit([check], now)[0]
    after = redis_server.commandstats()
    assert after.get("set", 0) == before.get("set", 0), "no call rewrote the value"
    assert after.get("setrange", 0) - before.get("setrange", 0) == 20, "one write a call"
    assert raw.strlen(check.key) == 16 * 58 + 24  # the window's 58 buckets, the trailer


def test_a_value_of_another_layout_is_counted_from_scratch(raw: redis.Redis) -> None:
    script = Script(raw)
    check = LimitCheck(f"rl:{{{uuid.uuid4().hex}}}:60s", 2, 60_000, 1_000)
    raw.set(check.key, b"not a counter")
    now = 1_764_000_000_000
    assert script.hit([check], now) == (True, [(True, 1, 61_000)])
    assert script.hit([check], now) == (True, [(True, 0, 61_000)])
    assert script.hit([check], now)[0] is False


def test_memory_stays_bounded_as_the_window_moves(raw: redis.Redis) -> None:
    """Records that left the window are skipped, then dropped when the string is
    rewritten: however long an identity keeps calling, its value holds at most the
    window's buckets and the few that left since the last rewrite."""
    script = Script(raw)
    check = LimitCheck(f"rl:{{{uuid.uuid4().hex}}}:10s", 1_000_000, 10_000, 1_000)
    now = 1_764_000_000_000
    longest = 0
    for _ in range(300):
        now += 1_000  # a new bucket each call; one leaves the window each call
        assert script.hit([check], now)[0]
        longest = max(longest, (raw.strlen(check.key) - 24) // 16)
    assert 10 <= longest <= 10 + 1 + 16  # the window's buckets, DEAD_MAX that left


def _one_call(raw: redis.Redis, sha: str, requests: list[list[LimitCheck]], now: int) -> list:
    """Several requests in one script call, as RedisBackend.send_many sends them."""
    keys: list[str | int] = []
    argv: list[str | int] = []
    for checks in requests:
        args = script_args(checks)
        keys.extend(args[1 : len(checks) + 1])
        argv.extend(args[len(checks) + 1 :])
    reply = raw.evalsha(sha, len(keys), *keys, *argv, now)
    return _answers(reply, requests)


def _answers(reply: list, requests: list[list[LimitCheck]]) -> list:
    """A call's reply cut into each request's (admitted, states), in order."""
    answers, offset = [], 0
    for checks in requests:
        size = 2 + 3 * len(checks)
        result, _ = parse_reply(reply[offset : offset + size], len(checks))
        answers.append(
            (result.admitted, [(s.allowed, s.remaining, s.reset_ms) for s in result.states])
        )
        offset += size
    assert offset == len(reply)
    return answers


def calls(request: st.SearchStrategy[Any]) -> st.SearchStrategy[list[tuple[int, list[Any]]]]:
    """Up to 8 script calls of up to 12 requests drawn from ``request``, each after a
    pause of up to 70 s (part of a window)."""
    return st.lists(
        st.tuples(st.integers(0, 70_000), st.lists(request, min_size=1, max_size=12)),
        min_size=1,
        max_size=8,
    )


# A request's limits: which of three or four keys, and each one's limit.
LIMITS_OF = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5)), min_size=1, max_size=3)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rounds=calls(LIMITS_OF))  # one tag: four keys
def test_requests_in_one_call_are_decided_as_if_one_after_another(
    raw: redis.Redis, rounds: list[tuple[int, list[list[tuple[int, int]]]]]
) -> None:
    """A key two requests of one call share sees the first one's count; each request
    is all-or-nothing on its own; the answers are the model's, request by request."""
    script, model = Script(raw), Model()
    tag = uuid.uuid4().hex
    now = 1_764_000_000_000 + 123
    for step, requests in rounds:
        now += step
        batch = []
        for limits in requests:
            seen: dict[int, LimitCheck] = {}
            for which, limit in limits:  # a key once per request
                seen.setdefault(which, LimitCheck(f"rl:{{{tag}}}:{which}", limit, 60_000, 1_000))
            batch.append(list(seen.values()))
        expected = [model.hit(checks, now) for checks in batch]
        assert _one_call(raw, script.sha, batch, now) == expected


def clocked_cross_slot_script() -> str:
    """The cross-slot form as the gateway sends it, reading ``now`` as clocked_script."""
    text = cross_slot_text()
    assert text.count(CLOCK_LINES) == 1 and text.count("local last = #ARGV\n") == 1
    text = text.replace(CLOCK_LINES, "local now = tonumber(ARGV[#ARGV])\nlocal nargs = 0\n")
    return text.replace("local last = #ARGV\n", "local last = #ARGV - 1\n")


def _cross_call(raw: redis.Redis, sha: str, requests: list[list[LimitCheck]], now: int) -> list:
    """``_one_call`` in the cross-slot layout: the first request's keys declared, then
    the number of requests, their limits and the other requests' keys."""
    first = script_args(requests[0])
    limits: list[str | int | bytes] = []
    rest: list[str | int | bytes] = []
    for index, checks in enumerate(requests):
        args = script_args(checks)
        limits.extend(args[len(checks) + 1 :])
        if index:
            rest.extend(args[1 : len(checks) + 1])
    declared = first[1 : len(requests[0]) + 1]
    reply = raw.evalsha(sha, len(declared), *declared, len(requests), *limits, *rest, now)
    return _answers(reply, requests)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rounds=calls(st.tuples(st.integers(0, 2), LIMITS_OF)))  # one of three tags a request
def test_the_cross_slot_form_decides_as_the_script_does(
    raw: redis.Redis, rounds: list[tuple[int, list[tuple[int, list[tuple[int, int]]]]]]
) -> None:
    """Requests of several hash tags (slots) in one call of the cross-slot form: each
    request all-or-nothing, decided after the ones before it, the model's answers."""
    sha = raw.script_load(clocked_cross_slot_script())
    model = Model()
    run = uuid.uuid4().hex
    now = 1_764_000_000_000 + 321
    for step, requests in rounds:
        now += step
        batch = []
        for tag, limits in requests:
            seen: dict[int, LimitCheck] = {}
            for which, limit in limits:  # a key once per request, one tag a request
                key = f"rl:{{{run}{tag}}}:{which}"
                seen.setdefault(which, LimitCheck(key, limit, 60_000, 1_000))
            batch.append(list(seen.values()))
        expected = [model.hit(checks, now) for checks in batch]
        assert _cross_call(raw, sha, batch, now) == expected


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    requests=st.integers(1, 4),
    count=st.one_of(
        st.integers(-3, 8).map(lambda n: str(n).encode()),
        st.sampled_from([b"1.5", b"x", b"", b"inf", b"nan", b"1e300"]),
    ),
)
def test_a_cross_slot_call_is_decided_only_when_its_count_is_its_requests(
    raw: redis.Redis, requests: int, count: bytes
) -> None:
    """ARGV 1 of the cross-slot form, whatever it holds: the call is decided when it is
    the number of requests whose limits follow; anything else is an error reply and no
    key is written (the count is read before any key is touched)."""
    sha = raw.script_load(clocked_cross_slot_script())
    tag = uuid.uuid4().hex
    checks = [LimitCheck(f"rl:{{{tag}{n}}}:0", 5, 60_000, 1_000) for n in range(requests)]
    limits = [script_args([c])[2] for c in checks]
    others = [c.key for c in checks[1:]]
    args = (checks[0].key, count, *limits, *others, 1_764_000_000_000)
    if count == str(requests).encode():
        reply = raw.evalsha(sha, 1, *args)
        assert len(reply) == 5 * requests  # admitted, now, three a key: each request decided
        assert raw.exists(*(c.key for c in checks)) == requests
        return
    with pytest.raises(redis.ResponseError, match="sliding_window"):
        raw.evalsha(sha, 1, *args)
    assert raw.exists(*(c.key for c in checks)) == 0


def test_a_value_of_another_type_fails_no_request_of_the_call(raw: redis.Redis) -> None:
    script = Script(raw)
    tag = uuid.uuid4().hex
    hashed = LimitCheck(f"rl:{{{tag}}}:a", 5, 60_000, 1_000)
    other = LimitCheck(f"rl:{{{tag}}}:b", 5, 60_000, 1_000)
    raw.hset(hashed.key, "x", "1")  # an operator's hash where a counter goes
    now = 1_764_000_000_000
    assert _one_call(raw, script.sha, [[hashed], [other]], now) == [
        (True, [(True, 4, 61_000)]),
        (True, [(True, 4, 61_000)]),
    ]
    assert raw.type(hashed.key) == b"string"  # counted from scratch, in this layout


def test_a_call_reads_its_keys_with_one_mget(raw: redis.Redis, redis_server: RedisServer) -> None:
    """Every key of a call is read by one MGET, not a command a key (each cost the server
    about as much as the rest of a request's work: benchmarks/script_cost.py), and only
    once, whichever requests of the call count in it."""
    script = Script(raw)
    tag = uuid.uuid4().hex
    shared = LimitCheck(f"rl:{{{tag}}}:ceiling", 100, 60_000, 1_000)
    batch = [[LimitCheck(f"rl:{{{tag}}}:{i}", 5, 60_000, 1_000), shared] for i in range(10)]
    before = redis_server.commandstats()
    answers = _one_call(raw, script.sha, batch, 1_764_000_000_000)
    after = redis_server.commandstats()
    assert [states[1][1] for _, states in answers] == list(range(99, 89, -1))
    assert after.get("mget", 0) - before.get("mget", 0) == 1
    # The ceiling, shared by all ten, is not read again after the first counted in it.
    assert after.get("get", 0) == before.get("get", 0)


def test_a_call_of_more_keys_than_one_mget_takes_reads_them_one_by_one(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    """Past MGET_MAX keys (Lua's stack bounds how many one MGET takes) each key is read
    with GET, and the answers are the model's all the same."""
    script, model = Script(raw), Model()
    tag = uuid.uuid4().hex
    now = 1_764_000_000_000
    batch = [
        [LimitCheck(f"rl:{{{tag}}}:{i % 700}", 2, 60_000, 1_000)] for i in range(1_400)
    ]  # 1,400 keys, each of 700 twice: the second sees the first's count
    expected = [model.hit(checks, now) for checks in batch]
    before = redis_server.commandstats()
    assert _one_call(raw, script.sha, batch, now) == expected
    after = redis_server.commandstats()
    assert after.get("mget", 0) == before.get("mget", 0)
    assert after.get("get", 0) - before.get("get", 0) == 700  # each key once


def test_a_request_with_no_keys_is_admitted_and_reads_nothing(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    """A request of no limits is admitted, alone or beside others (the gateway sends none,
    but the script's contract allows it): no MGET of nothing, which Redis refuses."""
    script = Script(raw)
    now = 1_764_000_000_000
    before = redis_server.commandstats()
    assert raw.evalsha(script.sha, 0, b"", now) == [1, now]
    assert redis_server.commandstats().get("mget", 0) == before.get("mget", 0)
    tag = uuid.uuid4().hex
    checks = [LimitCheck(f"rl:{{{tag}}}:{i}", 1, 60_000, 1_000) for i in range(17)]
    before = redis_server.commandstats()
    assert _one_call(raw, script.sha, [[], checks, []], now) == [
        (True, []),
        (True, [(True, 0, 61_000)] * 17),
        (True, []),
    ]
    assert redis_server.commandstats().get("mget", 0) - before.get("mget", 0) == 1


def test_a_call_of_few_keys_reads_each_with_get(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    """Up to MGET_MIN (16) keys a call, each is read with its own GET: cheaper for Redis
    than the MGET and its tables (benchmarks/script_instructions.py), as a Redis
    Cluster's calls and a quiet gateway's are; past it, one MGET."""
    script, model = Script(raw), Model()
    tag = uuid.uuid4().hex
    now = 1_764_000_000_000
    for size, mgets, gets in ((16, 0, 16), (17, 1, 0)):
        batch = [[LimitCheck(f"rl:{{{tag}}}:{size}:{i}", 3, 60_000, 1_000)] for i in range(size)]
        before = redis_server.commandstats()
        assert _one_call(raw, script.sha, batch, now) == [model.hit(c, now) for c in batch]
        after = redis_server.commandstats()
        assert after.get("mget", 0) - before.get("mget", 0) == mgets, size
        assert after.get("get", 0) - before.get("get", 0) == gets, size


LIMITS_OF_ONE = struct.pack("<4d", 5, 60_000, 1_000, 1)  # one key's limits, in force


@pytest.mark.parametrize(
    ("keys", "argv", "error"),
    [
        (1, [LIMITS_OF_ONE[:31]], "ARGV 1 is not 32 bytes a key"),  # cut short
        (1, [LIMITS_OF_ONE * 2], "1 keys, limits for 2"),  # limits for more keys than sent
        (2, [LIMITS_OF_ONE], "2 keys, limits for 1"),  # a key without limits
        # Two requests, the first well formed, the second not: the first is not counted.
        (2, [LIMITS_OF_ONE, LIMITS_OF_ONE[:31]], "ARGV 2 is not 32 bytes a key"),
        (3, [LIMITS_OF_ONE, LIMITS_OF_ONE], "3 keys, limits for 2"),
    ],
)
def test_limits_that_do_not_fit_the_keys_are_an_error_and_count_nothing(
    raw: redis.Redis, keys: int, argv: list[bytes], error: str
) -> None:
    """The script checks the shape of all its arguments before it counts anything: a
    caller that sends limits of the wrong size gets an error reply and no request of
    the call is counted, not even the well-formed ones before the fault."""
    script = Script(raw)
    tag = uuid.uuid4().hex
    names = [f"rl:{{{tag}}}:{i}" for i in range(keys)]
    with pytest.raises(redis.ResponseError, match=error):
        raw.evalsha(script.sha, keys, *names, *argv, 1_764_000_000_000)
    assert raw.exists(*names) == 0


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    keys=st.integers(0, 6),
    sizes=st.lists(st.integers(0, 200), min_size=0, max_size=4),  # bytes of each ARGV
)
def test_the_script_answers_only_limits_that_fit_its_keys(
    raw: redis.Redis, keys: int, sizes: list[int]
) -> None:
    """Whatever the sizes of the limits strings and the number of keys: the call is
    decided only when every string is 32 bytes a key and they add up to the keys;
    otherwise it is an error reply and nothing is written."""
    script = Script(raw)
    tag = uuid.uuid4().hex
    names = [f"rl:{{{tag}}}:{i}" for i in range(keys)]
    argv = [(LIMITS_OF_ONE * 7)[:size] for size in sizes]
    fits = all(size % 32 == 0 for size in sizes) and sum(sizes) // 32 == keys
    if fits:
        reply = raw.evalsha(script.sha, keys, *names, *argv, 1_764_000_000_000)
        assert len(reply) == 2 * len(sizes) + 3 * keys
        assert raw.exists(*names) == keys if keys else True
    else:
        with pytest.raises(redis.ResponseError, match="sliding_window: "):
            raw.evalsha(script.sha, keys, *names, *argv, 1_764_000_000_000)
        assert keys == 0 or raw.exists(*names) == 0


def _stored(raw: redis.Redis, key: str) -> tuple[bytes | None, int]:
    """A key's value and its time to live (ms; -2: no key, -1: no expiry)."""
    return raw.get(key), raw.pttl(key)


# A request's limits: (which of four keys, its limit, its bucket); windows of 10 s, mostly
# in 1 s buckets, so a few calls move records out of the window and past DEAD_MAX, and
# sometimes finer (requests of one call that count one key in several new buckets).
SHARED_KEYS = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 40), st.sampled_from((1_000, 1_000, 100, 10))),
    min_size=1,
    max_size=3,
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    rounds=st.lists(
        st.tuples(
            # The same or the next buckets; past the expiry's push (11 s); any way.
            st.one_of(
                st.integers(0, 2_500), st.integers(11_000, 22_000), st.integers(-30_000, 40_000)
            ),
            st.lists(SHARED_KEYS, min_size=1, max_size=25),
        ),
        min_size=1,
        max_size=12,
    )
)
def test_a_call_leaves_each_key_as_its_requests_one_call_each_would(
    raw: redis.Redis, rounds: list[tuple[int, list[list[tuple[int, int, int]]]]]
) -> None:
    """The writes of a call wait for its end, one a key: the answers, every value byte
    for byte and every expiry are what the same requests, each in a call of its own at
    the same time, leave. Time moves on and steps back between calls, so values are
    counted in place, pushed on, trimmed of what left and rewritten whole."""
    script = Script(raw)
    run = uuid.uuid4().hex

    def batch(side: str, requests: list[list[tuple[int, int, int]]]) -> list[list[LimitCheck]]:
        made = []
        for limits in requests:
            seen: dict[int, LimitCheck] = {}
            for which, limit, bucket in limits:  # a key once per request
                key = f"rl:{{{run}{side}}}:{which}"
                seen.setdefault(which, LimitCheck(key, limit, 10_000, bucket))
            made.append(list(seen.values()))
        return made

    now = 1_764_000_000_000 + 537
    slowest_ms = 0.0  # the longest round before this one
    for step, requests in rounds:
        now += step
        began = time.monotonic()
        together = _one_call(raw, script.sha, batch("a", requests), now)
        one_by_one = [script.hit(checks, now) for checks in batch("b", requests)]
        assert together == one_by_one
        for which in range(4):
            sides = [_stored(raw, f"rl:{{{run}{side}}}:{which}") for side in "ab"]
            (a, a_ttl), (b, b_ttl) = sides
            assert a == b, which
            # An expiry is set relative to the server's clock, which runs on between the
            # two sides' calls and reads: equal expiries differ by at most the time that
            # took, and a few ms more (the server reads its clock once a script or
            # event-loop turn). A key whose expiry this round left alone was set in an
            # earlier round, between whose two sides' calls the clock ran on as well (a
            # slow CI machine stalled one for 270 ms, and a quick round after it read the
            # two expiries 270 ms apart): so this round's time and the slowest earlier
            # round's. An expiry written wrong is off by a bucket (1 s) or more, which this
            # catches whenever the rounds ran faster.
            ran_ms = (time.monotonic() - began) * 1000
            skew_ms = slowest_ms + ran_ms + 50
            assert abs(a_ttl - b_ttl) <= skew_ms and (a_ttl < 0) == (b_ttl < 0), which
            if a_ttl < 0:
                assert a_ttl == b_ttl, which  # no key on either side
        slowest_ms = max(slowest_ms, (time.monotonic() - began) * 1000)


def test_a_burst_in_one_call_reads_and_writes_each_key_once(
    raw: redis.Redis, redis_server: RedisServer
) -> None:
    """One client's fifty requests in one call (a gateway's pipeline): its rule's key and
    its ceiling's are each read once and written once, not once a request."""
    script = Script(raw)
    tag = uuid.uuid4().hex
    rule = LimitCheck(f"rl:{{{tag}}}:rule", 100, 60_000, 1_000)
    ceiling = LimitCheck(f"rl:{{{tag}}}:ceiling", 1_000, 60_000, 1_000)
    now = 1_764_000_000_000
    # A new value, then counted in place in a new bucket, then all refused.
    calls = ((0, range(99, 49, -1), 2), (1, range(49, -1, -1), 2), (2, [0] * 50, 0))
    for call, remaining, writes in calls:
        before = redis_server.commandstats()
        answers = _one_call(raw, script.sha, [[rule, ceiling]] * 50, now + call * 1_500)
        after = redis_server.commandstats()
        assert [states[0][1] for _, states in answers] == list(remaining)
        assert sum(after.get(c, 0) - before.get(c, 0) for c in ("get", "mget")) == 1, call
        written = sum(after.get(c, 0) - before.get(c, 0) for c in ("set", "setrange"))
        assert written == writes, call


_REPLY_ITEMS = st.one_of(
    st.integers(-(2**62), 2**62),
    st.booleans(),
    st.integers(-999, 10**12).map(lambda n: str(n).encode()),  # a RESP bulk string of digits
)


@settings(max_examples=500, deadline=None)
@given(count=st.integers(1, 4), data=st.data())
def test_a_reply_is_read_as_int_and_bool_read_it(count: int, data: st.DataObject) -> None:
    """Differential: ``parse_reply`` (which takes a RESP integer as it is) reads any
    reply as ``int()`` and ``bool()`` of each item read it."""
    reply = data.draw(st.lists(_REPLY_ITEMS, min_size=2 + 3 * count, max_size=2 + 3 * count))
    result, now = parse_reply(reply, count)
    assert now == int(reply[1]) and result.admitted == bool(reply[0])
    assert [(s.allowed, s.remaining, s.reset_ms) for s in result.states] == [
        (bool(reply[2 + 3 * i]), int(reply[3 + 3 * i]), int(reply[4 + 3 * i])) for i in range(count)
    ]
    assert all(type(s.remaining) is int and type(s.reset_ms) is int for s in result.states)
    with pytest.raises(redis.ResponseError):
        parse_reply(reply[:-1], count)
