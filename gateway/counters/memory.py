"""In-process counters: the embedded default, and the local fallback during outages.

Each counter keeps at most one entry per sub-bucket that the window can still see, so
memory per identity is bounded by the bucket count (about 60), not by the limit.
Idle counters are dropped once their whole window has passed, and the number of
counters is capped, so a flood of distinct clients cannot grow memory without bound.

Which counter goes when the cap is reached: the least recently used one that still has
room. A counter at its limit (an identity being refused) is forgotten only when every
counter kept is at its limit: otherwise an identity that used up its limit could reset
its own counter by sending ``max_keys`` throwaway identities (one request each), where
now it would have to push ``max_keys`` identities over their limits within one window.

All work in ``hit`` happens without an ``await``, which is what makes the
check-then-increment atomic on one event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from gateway.counters.base import HitResult, LimitCheck, LimitState
from gateway.ratelimit.window import (
    bucket_leaves_at,
    current_bucket,
    ms_until_room,
    oldest_counted_bucket,
)

Clock = Callable[[], int]


def monotonic_ms() -> int:
    # Monotonic: a wall-clock step (NTP) must neither forget nor stretch a window.
    return time.monotonic_ns() // 1_000_000


class _Window:
    """Counted buckets, oldest first, as one flat list ``[bucket, count, bucket, count…]``
    (a flat list costs a fraction of a deque of pairs; at most ~61 pairs, so trimming
    the front by slicing is cheap), their running sum, and when the whole window
    expires. Every count in the list is at least 1."""

    __slots__ = ("count", "expires_ms", "flat", "full")

    def __init__(self) -> None:
        self.flat: list[int] = []
        self.count = 0  # the sum of the counts in ``flat``: no summing per request
        self.expires_ms = 0
        self.full = False  # at its limit: kept in MemoryBackend._full

    def prune(self, oldest: int) -> None:
        flat = self.flat
        if not flat or flat[0] >= oldest:
            return  # the common case: nothing has left the window
        drop = 0
        dropped = 0
        while drop < len(flat) and flat[drop] < oldest:
            dropped += flat[drop + 1]
            drop += 2
        del flat[:drop]
        self.count -= dropped

    def pairs(self) -> Iterator[tuple[int, int]]:
        flat = self.flat
        return zip(flat[0::2], flat[1::2], strict=True)

    def add(self, bucket: int) -> None:
        flat = self.flat
        if flat and flat[-2] == bucket:
            flat[-1] += 1
        else:
            flat += (bucket, 1)
        self.count += 1

    def until_room(self, total: int, limit: int, now: int, window_ms: int, bucket_ms: int) -> int:
        """``ms_until_room`` over this window. With room left (the common case) the next
        slot frees when the oldest bucket leaves, since every count is at least 1."""
        flat = self.flat
        if total < limit and flat:
            return max(0, bucket_leaves_at(flat[0], window_ms, bucket_ms) - now)
        return ms_until_room(self.pairs(), total, limit, now, window_ms, bucket_ms)


class MemoryBackend:
    """Sliding-window counters in a dict; one event loop, one process."""

    def __init__(
        self,
        clock: Clock = monotonic_ms,
        max_keys: int = 1_000_000,
        sweep_every: int = 10_000,
        label: str = "memory",
    ) -> None:
        self._clock = clock
        self._max_keys = max_keys
        self._sweep_every = sweep_every
        self._calls = 0
        # Counters with room, least recently used first; counters at their limit apart,
        # forgotten last (see the module's docstring).
        self._windows: OrderedDict[str, _Window] = OrderedDict()
        self._full: OrderedDict[str, _Window] = OrderedDict()
        self._label = label

    @property
    def name(self) -> str:
        return self._label

    @property
    def max_keys(self) -> int:
        return self._max_keys

    def now_ms(self) -> int:
        """This backend's clock (ms)."""
        return self._clock()

    def __len__(self) -> int:
        return len(self._windows) + len(self._full)

    @property
    def calls(self) -> int:
        """Counter calls answered so far (``hit_now``, also through ``hit``)."""
        return self._calls

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        return self.hit_now(checks)

    def hit_now(self, checks: Sequence[LimitCheck]) -> HitResult:
        """The synchronous body of ``hit`` (also used by the fallback wrapper)."""
        now = self._clock()
        self._calls += 1
        if self._calls % self._sweep_every == 0:
            self.sweep_oldest(now)
        if len(checks) == 1:
            return self._hit_one(checks[0], now)
        if len(checks) == 2:
            return self._hit_two(checks[0], checks[1], now)
        return self._hit_many(checks, now)

    def _hit_many(self, checks: Sequence[LimitCheck], now: int) -> HitResult:
        windows: list[_Window] = []
        totals: list[int] = []
        admitted = True
        for check in checks:
            window = self._window(check.key)
            window.prune(oldest_counted_bucket(now, check.window_ms, check.bucket_ms))
            total = window.count
            windows.append(window)
            totals.append(total)
            if check.enforce and total >= check.limit:
                admitted = False
        states: list[LimitState] = []
        for check, window, total in zip(checks, windows, totals, strict=True):
            has_room = total < check.limit
            if admitted and has_room:
                window.add(current_bucket(now, check.bucket_ms))
                window.expires_ms = max(window.expires_ms, now + check.window_ms + check.bucket_ms)
                total += 1
            reset = window.until_room(total, check.limit, now, check.window_ms, check.bucket_ms)
            states.append(LimitState(has_room, max(0, check.limit - total), reset))
            if not window.flat:
                self._forget(check.key, window)
            elif window.full != (total >= check.limit):
                self._refile(check.key, window)
        certain = 0
        if not admitted:
            # A full window frees its next slot after reset_ms, and refused requests are
            # not counted: until then every request with these checks is refused.
            certain = min(
                (st.reset_ms for c, st in zip(checks, states, strict=True)
                 if c.enforce and not st.allowed),
                default=0,
            )  # fmt: skip
        return HitResult(admitted, tuple(states), source=self._label, certain_ms=certain)

    def _hit_one(self, check: LimitCheck, now: int) -> HitResult:
        """``hit_now`` for the common single limit, without the per-check lists (the
        same arithmetic; about half the cost on the data plane's hot path)."""
        key = check.key
        window = self._window(key)
        window_ms, bucket_ms, limit = check.window_ms, check.bucket_ms, check.limit
        window.prune(oldest_counted_bucket(now, window_ms, bucket_ms))
        total = window.count
        has_room = total < limit
        admitted = has_room or not check.enforce
        if has_room:
            window.add(current_bucket(now, bucket_ms))
            expires = now + window_ms + bucket_ms
            if expires > window.expires_ms:
                window.expires_ms = expires
            total += 1
        reset = window.until_room(total, limit, now, window_ms, bucket_ms)
        if not window.flat:
            self._forget(key, window)
        elif window.full != (total >= limit):
            self._refile(key, window)
        state = LimitState(has_room, limit - total if total < limit else 0, reset)
        return HitResult(
            admitted, (state,), source=self._label, certain_ms=0 if admitted else reset
        )

    def _hit_two(self, first: LimitCheck, second: LimitCheck, now: int) -> HitResult:
        """``hit_now`` for two limits counted all or nothing (a rule and a ceiling, the
        default table's shape): the same arithmetic, without the per-check lists."""
        w1 = self._window(first.key)
        w1.prune(oldest_counted_bucket(now, first.window_ms, first.bucket_ms))
        w2 = self._window(second.key)
        w2.prune(oldest_counted_bucket(now, second.window_ms, second.bucket_ms))
        t1, t2 = w1.count, w2.count
        room1, room2 = t1 < first.limit, t2 < second.limit
        admitted = (room1 or not first.enforce) and (room2 or not second.enforce)
        s1 = self._settle(first, w1, t1, room1, admitted, now)
        s2 = self._settle(second, w2, t2, room2, admitted, now)
        certain = 0
        if not admitted:
            # As hit_now: the soonest an enforced full window frees a slot.
            if first.enforce and not room1:
                certain = s1.reset_ms
            if second.enforce and not room2 and (certain == 0 or s2.reset_ms < certain):
                certain = s2.reset_ms
        return HitResult(admitted, (s1, s2), source=self._label, certain_ms=certain)

    def _settle(
        self, check: LimitCheck, window: _Window, total: int, room: bool, admitted: bool, now: int
    ) -> LimitState:
        """One check of a call already decided: counted when admitted (and it has room)."""
        limit = check.limit
        if admitted and room:
            window.add(current_bucket(now, check.bucket_ms))
            expires = now + check.window_ms + check.bucket_ms
            if expires > window.expires_ms:
                window.expires_ms = expires
            total += 1
        reset = window.until_room(total, limit, now, check.window_ms, check.bucket_ms)
        if not window.flat:
            self._forget(check.key, window)
        elif window.full != (total >= limit):
            self._refile(check.key, window)
        return LimitState(room, limit - total if total < limit else 0, reset)

    def holds_any(self, checks: Sequence[LimitCheck]) -> bool:
        """Whether a counter is kept for any of the checks' keys (nothing changes)."""
        windows, full = self._windows, self._full
        return any(check.key in windows or check.key in full for check in checks)

    def refusal(self, checks: Sequence[LimitCheck]) -> HitResult | None:
        """The refusal ``hit_now`` would answer right now, without counting anything or
        creating a counter; None when every enforced check has room here (a key with
        no counter has room). The resilience wrapper asks this before it asks the store
        for requests whose counts it carries over from an outage."""
        now = self._clock()
        found: list[_Window | None] = []
        refused = False
        for check in checks:
            window = self._windows.get(check.key)
            if window is None:
                window = self._full.get(check.key)
            if window is not None:
                window.prune(oldest_counted_bucket(now, check.window_ms, check.bucket_ms))
                if check.enforce and window.count >= check.limit:
                    refused = True
            found.append(window)
        if not refused:
            return None
        states: list[LimitState] = []
        blocking: list[int] = []  # the resets of the enforced checks that refuse
        for check, window in zip(checks, found, strict=True):
            if window is None:
                states.append(LimitState(True, check.limit, 0))
                continue
            total = window.count
            reset = window.until_room(total, check.limit, now, check.window_ms, check.bucket_ms)
            states.append(LimitState(total < check.limit, max(0, check.limit - total), reset))
            if check.enforce and total >= check.limit:
                blocking.append(reset)
        return HitResult(
            False, tuple(states), source=self._label, certain_ms=min(blocking, default=0)
        )

    def _window(self, key: str) -> _Window:
        windows = self._windows
        window = windows.get(key)
        if window is not None:
            windows.move_to_end(key)
            return window
        window = self._full.get(key)
        if window is not None:
            self._full.move_to_end(key)
            return window
        window = windows[key] = _Window()
        if len(windows) + len(self._full) > self._max_keys:
            # The cap keeps memory bounded: the least recently used counter with room
            # goes (it forgets past requests of an idle identity); one at its limit only
            # when all are (the new one is never the one dropped).
            if len(windows) > 1:
                windows.popitem(last=False)
            else:
                self._full.popitem(last=False)
        return window

    def _refile(self, key: str, window: _Window) -> None:
        """Move a counter between the two tables when it reaches its limit or has room
        again (it stays the most recently used of its table)."""
        if window.full:
            window.full = False
            self._full.pop(key, None)
            self._windows[key] = window
        else:
            window.full = True
            self._windows.pop(key, None)
            self._full[key] = window

    def _forget(self, key: str, window: _Window) -> None:
        (self._full if window.full else self._windows).pop(key, None)

    def sweep_oldest(self, now_ms: int, budget: int = 1000) -> int:
        """Drop expired counters from the least recently used end, at most ``budget``.

        Called on the request path, so it never scans the whole table (that would stall
        the event loop with a million keys); the LRU order puts idle keys first.
        """
        removed = 0
        for windows in (self._windows, self._full):
            while windows and removed < budget:
                key, window = next(iter(windows.items()))
                if window.expires_ms > now_ms:
                    break
                del windows[key]
                removed += 1
        return removed

    def sweep(self, now_ms: int | None = None) -> int:
        """Drop counters whose whole window has passed; returns how many."""
        now = self._clock() if now_ms is None else now_ms
        removed = 0
        for windows in (self._windows, self._full):
            dead = [key for key, w in windows.items() if w.expires_ms <= now]
            for key in dead:
                del windows[key]
            removed += len(dead)
        return removed

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        self._windows.clear()
        self._full.clear()
