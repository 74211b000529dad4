"""The sliding window never over-admits, whatever the arrival pattern (fake clock)."""

from __future__ import annotations

from bisect import bisect_left

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.counters.base import LimitCheck
from gateway.counters.memory import MemoryBackend
from gateway.ratelimit.window import bucket_ms_for


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now


def _max_in_any_window(times: list[int], window_ms: int) -> int:
    """Most admitted arrivals inside any half-open window (t - window, t]."""
    best = 0
    for i, t in enumerate(times):
        first = bisect_left(times, t - window_ms + 1)
        best = max(best, i - first + 1)
    return best


@settings(max_examples=300, deadline=None)
@given(
    limit=st.integers(1, 30),
    window_s=st.sampled_from([1, 2, 10, 60, 600]),
    gaps=st.lists(st.integers(0, 3000), min_size=1, max_size=400),
)
def test_never_admits_more_than_limit_in_any_trailing_window(limit, window_s, gaps):
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    window_ms = window_s * 1000
    check = LimitCheck("k", limit, window_ms, bucket_ms_for(window_ms))
    admitted: list[int] = []
    for gap in gaps:
        clock.now += gap * window_s // 10  # gaps scale with the window
        result = backend.hit_now([check])
        if result.admitted:
            admitted.append(clock.now)
        state = result.states[0]
        assert 0 <= state.remaining <= limit
        if not result.admitted:
            assert state.reset_ms > 0
    assert _max_in_any_window(admitted, window_ms) <= limit


@settings(max_examples=100, deadline=None)
@given(limit=st.integers(1, 50), window_s=st.sampled_from([1, 10, 60]))
def test_retry_after_is_never_early(limit, window_s):
    """After a refusal, waiting reset_ms admits; one ms earlier still refuses."""
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    window_ms = window_s * 1000
    check = LimitCheck("k", limit, window_ms, bucket_ms_for(window_ms))
    for _ in range(limit):
        assert backend.hit_now([check]).admitted
    refused = backend.hit_now([check])
    assert not refused.admitted
    wait = refused.states[0].reset_ms
    clock.now += wait - 1
    assert not backend.hit_now([check]).admitted
    clock.now += 1
    assert backend.hit_now([check]).admitted


def test_under_admission_is_bounded_by_one_bucket():
    """A steady stream gets at least limit - (one bucket's share) per window."""
    clock = FakeClock()
    backend = MemoryBackend(clock=clock)
    limit, window_ms = 600, 60_000
    check = LimitCheck("k", limit, window_ms, bucket_ms_for(window_ms))
    admitted = []
    for _ in range(12_000):  # one request every 25 ms for 5 minutes
        clock.now += 25
        if backend.hit_now([check]).admitted:
            admitted.append(clock.now)
    # Steady state (skip the first window): every 60 s window admits nearly the limit.
    steady = [t for t in admitted if t > admitted[0] + 2 * window_ms]
    per_window = len([t for t in steady if t <= steady[0] + window_ms])
    share = limit * bucket_ms_for(window_ms) // window_ms
    assert limit - 2 * share <= per_window <= limit


def test_memory_is_bounded_per_identity_and_idle_identities_are_evicted():
    clock = FakeClock()
    backend = MemoryBackend(clock=clock, max_keys=1000)
    check = LimitCheck("k", 10_000, 60_000, bucket_ms_for(60_000))
    for _ in range(20_000):
        clock.now += 7
        backend.hit_now([check])
    window = backend._windows["k"]
    assert len(window.flat) <= 2 * 62  # one pair per visible bucket, whatever the count
    for n in range(5000):
        backend.hit_now([LimitCheck(f"id{n}", 5, 1000, 100)])
    assert len(backend) <= 1000  # the LRU cap holds under many distinct clients
    clock.now += 120_000
    before = len(backend)
    assert backend.sweep() == before
    assert len(backend) == 0


def test_request_path_sweep_removes_idle_keys_without_scanning_everything():
    clock = FakeClock()
    backend = MemoryBackend(clock=clock, sweep_every=100)
    for n in range(3000):
        backend.hit_now([LimitCheck(f"idle{n}", 5, 1000, 100)])
    clock.now += 10_000  # every one of them is idle now
    for _ in range(200):  # two sweeps of at most 1000 keys each, from the LRU end
        backend.hit_now([LimitCheck("busy", 1000, 1000, 100)])
    assert 1000 <= len(backend) <= 3000 - 1000
    assert backend.sweep_oldest(clock.now, budget=10_000) >= 1
    assert len(backend) == 1  # only the busy key is left


def test_a_flood_of_throwaway_identities_cannot_reset_a_used_up_counter():
    clock = FakeClock()
    backend = MemoryBackend(clock=clock, max_keys=1000)
    victim = LimitCheck("used-up", 3, 60_000, bucket_ms_for(60_000))
    for _ in range(3):
        clock.now += 1
        assert backend.hit_now([victim]).admitted
    assert not backend.hit_now([victim]).admitted
    for n in range(5000):  # five times the cap, one request each
        clock.now += 1
        assert backend.hit_now([LimitCheck(f"throwaway{n}", 3, 60_000, 1000)]).admitted
    assert len(backend) <= 1000
    assert not backend.hit_now([victim]).admitted  # still refused: not forgotten
    # Once its window has passed it has room again, like any counter.
    clock.now += 61_000
    assert backend.hit_now([victim]).admitted


def test_when_every_counter_is_at_its_limit_memory_stays_bounded():
    clock = FakeClock()
    backend = MemoryBackend(clock=clock, max_keys=1000)
    for n in range(3000):
        check = LimitCheck(f"full{n}", 1, 60_000, 1000)
        assert backend.hit_now([check]).admitted
        assert not backend.hit_now([check]).admitted
    assert len(backend) <= 1000
    # The oldest of them were forgotten, the newest kept.
    assert backend.hit_now([LimitCheck("full0", 1, 60_000, 1000)]).admitted
    assert not backend.hit_now([LimitCheck("full2999", 1, 60_000, 1000)]).admitted
