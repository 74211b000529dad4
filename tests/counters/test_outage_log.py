"""What a process logs while its counter store is down: one line when the outage begins,
one summary per interval while it lasts, one line when it ends; never a line per probe.

A real redis-server is killed and started again; the breaker's and the summary's clock is
a hand-driven one, so that two minutes of outage (a probe every second) take no real time
and every count in the log lines is exact.
"""

from __future__ import annotations

import logging
import re

import pytest

from gateway.counters.base import (
    CounterBackend,
    CounterEvents,
    CounterUnavailableError,
    LimitCheck,
)
from gateway.counters.coalesce import CoalescingBackend
from gateway.counters.factory import MAX_IN_FLIGHT, parse_counter_url, store_client
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resilient import ResilientBackend
from gateway.metrics import Metrics
from tests.counters.helpers import RecordingEvents, called, new_key
from tests.support.redis_servers import RedisServer

NAME = "redis-under-test (region us)"
OUR_LINES = re.compile(rf"^counter store {re.escape(NAME)}: ")


class HandClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stack(server: RedisServer, clock: HandClock, events: CounterEvents) -> ResilientBackend:
    """The factory's stack for one server (``open_counter_backend`` takes no clock)."""
    store = RedisBackend(store_client(parse_counter_url(server.url)), name=NAME)
    inner = CoalescingBackend(
        store,
        max_in_flight=MAX_IN_FLIGHT,
        batch_timeout_seconds=2.0,
        # Generous: a slow machine must not turn the healthy calls into timeouts.
        call_timeout_seconds=2.0,
        queue_timeout_seconds=2.0,
    )
    return ResilientBackend(
        inner,
        timeout_seconds=2.0,
        failure_threshold=5,
        reset_seconds=1.0,
        events=events,
        monotonic=clock,
        outage_summary_seconds=60.0,
    )


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if OUR_LINES.match(r.getMessage())]


@pytest.mark.parametrize("via", ["hit", "submit"])
async def test_an_outage_logs_its_start_a_summary_a_minute_and_its_end(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture, via: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="gateway.counters")
    clock = HandClock()
    events = RecordingEvents()
    resilient = _stack(own_redis, clock, events)
    backend: CounterBackend = called(resilient, via)
    open_check = LimitCheck(new_key(), limit=1_000_000, window_ms=60_000, bucket_ms=1_000)
    closed_check = LimitCheck(new_key(), 1_000_000, 60_000, 1_000, fail_open=False)
    try:
        assert (await backend.hit([open_check])).source == "redis"
        assert not _ours(caplog)

        own_redis.kill9()
        # Refused connections, one per call, until the breaker opens (5 in a row); the
        # call that opens it is the outage's first fallback answer.
        for _ in range(5):
            assert (await backend.hit([open_check])).source == "fallback"
        assert resilient.breaker_state == "open"
        [down] = _ours(caplog)
        assert down.levelno == logging.WARNING
        assert "unreachable (connection), circuit breaker open" in down.getMessage()
        assert "one every 1 s" in down.getMessage()

        # 130 seconds of outage: each second one probe (a fail-open request that finds
        # the store still gone), one more fail-open request and one fail-closed request.
        for _ in range(130):
            clock.now += 1.0
            assert (await backend.hit([open_check])).source == "fallback"  # the probe
            assert (await backend.hit([open_check])).source == "fallback"
            with pytest.raises(CounterUnavailableError):
                await backend.hit([closed_check])

        lines = _ours(caplog)
        said = [r.getMessage() for r in lines]
        assert [r.levelno for r in lines] == [logging.WARNING] * 3, said
        # Due at 60 s: written by the first decision of second 60 (its probe), when the
        # fallback had answered 1 + 2 x 59 + 1 requests and refused 59, and 60 probes
        # had failed; the next one at 120 s likewise.
        assert said[1].endswith(
            "still unreachable after 60 s (connection, 60 probe(s) failed); since it went "
            "down 120 request(s) were answered by the local fallback and 59 refused "
            "(fail closed)"
        )
        assert said[2].endswith(
            "still unreachable after 120 s (connection, 120 probe(s) failed); since it "
            "went down 240 request(s) were answered by the local fallback and 119 refused "
            "(fail closed)"
        )
        # The metrics still hear of every probe: open, then half_open/open each second.
        assert events.breaker == ["open"] + ["half_open", "open"] * 130

        own_redis.restart()
        clock.now += 1.0
        assert (await backend.hit([open_check])).source == "redis"  # the probe succeeds
        assert resilient.breaker_state == "closed"
        lines = _ours(caplog)
        assert len(lines) == 4
        back = lines[3]
        assert back.levelno == logging.INFO
        assert back.getMessage().endswith(
            "reachable again after 131 s, circuit breaker closed; meanwhile 261 request(s) "
            "were answered by the local fallback and 130 refused (fail closed)"
        )
        assert events.breaker[-2:] == ["half_open", "closed"]
        assert not any("half_open" in r.getMessage() for r in lines)

        # Healthy again: nothing more is logged, and a second outage is logged afresh.
        for _ in range(20):
            clock.now += 1.0
            assert (await backend.hit([open_check])).source == "redis"
        assert len(_ours(caplog)) == 4
        own_redis.kill9()
        for _ in range(5):
            await backend.hit([open_check])
        assert resilient.breaker_state == "open"
        lines = _ours(caplog)
        assert len(lines) == 5 and "circuit breaker open" in lines[4].getMessage()
    finally:
        await backend.close()


async def test_a_single_failed_call_is_not_an_outage(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fewer failures than the threshold: answered by the fallback, nothing logged above
    DEBUG (the breaker never opened)."""
    caplog.set_level(logging.DEBUG, logger="gateway.counters")
    clock = HandClock()
    events = RecordingEvents()
    backend = _stack(own_redis, clock, events)
    check = LimitCheck(new_key(), limit=1_000_000, window_ms=60_000, bucket_ms=1_000)
    try:
        own_redis.kill9()
        for _ in range(4):
            assert (await backend.hit([check])).source == "fallback"
        own_redis.restart()
        assert (await backend.hit([check])).source == "redis"
        assert events.breaker == []
        assert [r for r in _ours(caplog) if r.levelno > logging.DEBUG] == []
    finally:
        await backend.close()


async def test_wired_as_the_gateway_wires_it_a_probe_logs_nothing(
    own_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """With the gateway's own events (metrics, gateway/metrics.py): the breaker's moves
    are counted, and over a minute of probes only the outage's first and last lines are
    logged above DEBUG."""
    caplog.set_level(logging.DEBUG, logger="gateway.counters")
    clock = HandClock()
    metrics = Metrics()
    backend = _stack(own_redis, clock, metrics.counter_events("us"))
    check = LimitCheck(new_key(), limit=1_000_000, window_ms=60_000, bucket_ms=1_000)
    try:
        own_redis.kill9()
        for _ in range(5):
            await backend.hit([check])
        for _ in range(59):
            clock.now += 1.0
            assert (await backend.hit([check])).source == "fallback"
        own_redis.restart()
        clock.now += 1.0
        assert (await backend.hit([check])).source == "redis"
    finally:
        await backend.close()
    above = [r.getMessage() for r in caplog.records if r.levelno > logging.DEBUG]
    assert len(above) == 2, above
    assert above[0].startswith(f"counter store {NAME}: unreachable (connection)")
    assert above[1].startswith(f"counter store {NAME}: reachable again after 60 s")
    transitions = metrics.breaker_transitions
    assert transitions.labels("us", "half_open").value == 60
    assert transitions.labels("us", "open").value == 60
