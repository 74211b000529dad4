"""The in-process counters' two-limit path (a rule and a ceiling, the default table's
shape) against their general path: the same results, call after call, for any limits,
windows, enforcement and timing (a differential property test)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.counters.base import LimitCheck
from gateway.counters.memory import MemoryBackend
from gateway.ratelimit.window import bucket_ms_for


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


def check(key: str, limit: int, seconds: int, enforce: bool) -> LimitCheck:
    return LimitCheck(
        key=key,
        limit=limit,
        window_ms=seconds * 1000,
        bucket_ms=bucket_ms_for(seconds * 1000),
        enforce=enforce,
        fail_open=True,
    )


limits = st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 10, 60]), st.booleans())
steps = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 2500)),  # (which rule identity, ms later)
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(first=limits, second=limits, steps=steps)
def test_two_limits_count_as_the_general_path_does(first, second, steps):
    clocks = Clock(), Clock()
    fast, general = MemoryBackend(clock=clocks[0]), MemoryBackend(clock=clocks[1])
    for who, later in steps:
        for clock in clocks:
            clock.now += later
        pair = [check(f"rule:{who}", *first), check("ceiling", *second)]
        got = fast.hit_now(pair)
        want = general._hit_many(pair, clocks[1].now)
        assert got == want, (who, later)
