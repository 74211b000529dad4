"""One behaviour contract, run against memory, Redis, the Redis stack and Redis Cluster."""

from __future__ import annotations

import asyncio
import time

from gateway.counters.base import CounterBackend, LimitCheck
from tests.counters.helpers import keys_sharing_tag, new_key


class TestCounterContract:
    async def test_admits_exactly_limit_then_refuses(self, backend: CounterBackend) -> None:
        check = LimitCheck(new_key(), limit=5, window_ms=60_000, bucket_ms=1_000)
        results = [await backend.hit([check]) for _ in range(7)]
        assert [r.admitted for r in results] == [True] * 5 + [False] * 2
        assert [r.states[0].remaining for r in results] == [4, 3, 2, 1, 0, 0, 0]
        assert [r.states[0].allowed for r in results] == [True] * 5 + [False] * 2

    async def test_reset_is_time_until_the_oldest_bucket_leaves(
        self, backend: CounterBackend
    ) -> None:
        check = LimitCheck(new_key(), limit=2, window_ms=60_000, bucket_ms=1_000)
        first = await backend.hit([check])
        # With room left, reset is when the remaining count next grows: when the
        # bucket of the first request leaves the window.
        assert 58_000 < first.states[0].reset_ms <= 61_000
        await backend.hit([check])
        refused = await backend.hit([check])
        assert not refused.admitted
        assert 58_000 < refused.states[0].reset_ms <= 61_000

    async def test_sliding_window_frees_only_expired_buckets(self, backend: CounterBackend) -> None:
        # A 1 s window with 100 ms buckets keeps this short, but its steps must each land
        # within a window of the earlier ones. A slow, loaded machine can stall past that:
        # then the scenario runs again on a fresh key (a stall three times running fails).
        for attempt in range(1, 4):
            steps = await self._free_one_expired_bucket(backend)
            if steps["in_time"] or attempt == 3:
                break
        assert steps["in_time"], f"the machine stalled past the 1 s window: {steps}"
        assert steps["fill"] == [True, True, True, True]
        assert not steps["refused"]
        assert steps["again"]  # exactly the one expired request's slot came free...
        assert steps["again_remaining"] == 0
        assert not steps["still_full"]  # ...not the three later ones
        assert steps["still_full_reset_ms"] > 0

    @staticmethod
    async def _free_one_expired_bucket(backend: CounterBackend) -> dict[str, object]:
        """One request, three more 500 ms later to fill the limit of 4, then again once the
        first one's bucket has left (when the refusal's reset says). With what each step
        answered and whether every step came within the 1 s window of the ones it relies
        on (the times bound the backend's clock: a bucket is counted for at least the
        window after any request in it)."""
        window = 1.0
        check = LimitCheck(new_key(1), limit=4, window_ms=1_000, bucket_ms=100)
        first_sent = time.monotonic()
        fill = [(await backend.hit([check])).admitted]  # one request in an early bucket
        await asyncio.sleep(0.5)
        later_sent = time.monotonic()
        for _ in range(3):  # three more, 500 ms later (another bucket), fill the limit
            fill.append((await backend.hit([check])).admitted)
        refused = await backend.hit([check])
        refused_back = time.monotonic()
        # The first request's bucket leaves first; its reset is what the backend says.
        await asyncio.sleep(refused.states[0].reset_ms / 1000 + 0.08)
        again = await backend.hit([check])
        still_full = await backend.hit([check])
        still_full_back = time.monotonic()
        margin = 0.02  # the backends' clocks count whole milliseconds
        return {
            "in_time": refused_back - first_sent < window - margin
            and still_full_back - later_sent < window - margin,
            "fill": fill,
            "refused": refused.admitted,
            "again": again.admitted,
            "again_remaining": again.states[0].remaining,
            "still_full": still_full.admitted,
            "still_full_reset_ms": still_full.states[0].reset_ms,
        }

    async def test_all_or_nothing(self, backend: CounterBackend) -> None:
        wide_key, narrow_key = keys_sharing_tag(2)
        wide = LimitCheck(wide_key, limit=5, window_ms=60_000, bucket_ms=1_000)
        narrow = LimitCheck(narrow_key, limit=2, window_ms=60_000, bucket_ms=1_000)
        for _ in range(2):
            assert (await backend.hit([wide, narrow])).admitted
        for _ in range(3):
            refused = await backend.hit([wide, narrow])
            assert not refused.admitted
            assert refused.states[0].allowed and not refused.states[1].allowed
            assert refused.states[0].remaining == 3  # the refusals used no quota
        alone = await backend.hit([wide])
        assert alone.admitted and alone.states[0].remaining == 2

    async def test_shadow_checks_never_block(self, backend: CounterBackend) -> None:
        enforced_key, shadow_key = keys_sharing_tag(2)
        enforced = LimitCheck(enforced_key, limit=10, window_ms=60_000, bucket_ms=1_000)
        shadow = LimitCheck(shadow_key, 2, 60_000, 1_000, enforce=False)
        results = [await backend.hit([enforced, shadow]) for _ in range(4)]
        assert all(r.admitted for r in results)
        assert [r.states[1].allowed for r in results] == [True, True, False, False]
        assert [r.states[1].remaining for r in results] == [1, 0, 0, 0]
        assert [r.states[0].remaining for r in results] == [9, 8, 7, 6]
        only_shadow = await backend.hit([shadow])
        assert only_shadow.admitted and not only_shadow.states[0].allowed

    async def test_refused_request_does_not_count_shadow(self, backend: CounterBackend) -> None:
        enforced_key, shadow_key = keys_sharing_tag(2)
        enforced = LimitCheck(enforced_key, limit=1, window_ms=60_000, bucket_ms=1_000)
        shadow = LimitCheck(shadow_key, 5, 60_000, 1_000, enforce=False)
        await backend.hit([enforced, shadow])
        for _ in range(3):
            assert not (await backend.hit([enforced, shadow])).admitted
        assert (await backend.hit([shadow])).states[0].remaining == 3

    async def test_concurrent_burst_admits_exactly_the_limit(self, backend: CounterBackend) -> None:
        check = LimitCheck(new_key(), limit=50, window_ms=60_000, bucket_ms=1_000)
        results = await asyncio.gather(*(backend.hit([check]) for _ in range(200)))
        assert sum(r.admitted for r in results) == 50

    async def test_identities_and_windows_are_independent(self, backend: CounterBackend) -> None:
        a = LimitCheck(new_key(), limit=1, window_ms=60_000, bucket_ms=1_000)
        b = LimitCheck(new_key(), limit=1, window_ms=60_000, bucket_ms=1_000)
        assert (await backend.hit([a])).admitted
        assert not (await backend.hit([a])).admitted
        assert (await backend.hit([b])).admitted

    async def test_zero_limit_refuses_everything(self, backend: CounterBackend) -> None:
        check = LimitCheck(new_key(), limit=0, window_ms=60_000, bucket_ms=1_000)
        result = await backend.hit([check])
        assert not result.admitted and result.states[0].remaining == 0

    async def test_empty_call_is_admitted(self, backend: CounterBackend) -> None:
        result = await backend.hit([])
        assert result.admitted and result.states == ()

    async def test_reports_health(self, backend: CounterBackend) -> None:
        assert await backend.healthy()
