"""A local cache of refusals, so a flood from one identity does not reach the store.

When the store refuses a request, each enforced limit it found full is remembered
until its reset time: until then no request can fit in that limit (other instances
only add to the count), so the answer is the same as the store's, without the round
trip. The cache never admits anything; it only refuses earlier, and only while the
refusal is certain.

Two readings of the store's reset, each on its safe side: an entry is valid until
the reset measured from when the call was sent (the store decided later than that,
so the entry never outlives the store's own reset), while the reset reported to
callers (``Retry-After``) is measured from when the answer arrived (the store decided
earlier than that, so it is never earlier than the real reset).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.counters.base import (
    CounterBackend,
    CounterEvents,
    HitResult,
    HitSettled,
    LimitCheck,
    LimitState,
    NoEvents,
)


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


@dataclass(slots=True)
class _Entry:
    until_ms: int  # the entry is valid until then (measured from the send)
    reset_at_ms: int  # reported reset: when the limit next frees a slot, at the latest
    remaining: int
    allowed: bool  # the limit had room when the store last answered
    denied: bool  # an enforced limit that was full: this entry refuses on its own
    limit: int
    window_ms: int

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        until_ms: int,
        reset_at_ms: int,
        remaining: int,
        allowed: bool,
        denied: bool,
        limit: int,
        window_ms: int,
    ) -> None:
        self.until_ms = until_ms
        self.reset_at_ms = reset_at_ms
        self.remaining = remaining
        self.allowed = allowed
        self.denied = denied
        self.limit = limit
        self.window_ms = window_ms


class DenyCacheBackend:
    """Answers known refusals from memory; everything else goes to ``inner``."""

    def __init__(
        self,
        inner: CounterBackend,
        *,
        max_entries: int = 100_000,
        events: CounterEvents | None = None,
        clock_ms: Callable[[], int] = monotonic_ms,
        cache_sources: frozenset[str] = frozenset({"redis"}),
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self._inner = inner
        self._max = max_entries
        self._events: CounterEvents = events or NoEvents()
        self._clock = clock_ms
        # Fallback answers are local already; caching them would only keep an outage's
        # refusals alive after the store is back.
        self._sources = cache_sources
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self.hits = 0
        self._inner_submit: Callable[[Sequence[LimitCheck], HitSettled], bool] | None = getattr(
            inner, "submit", None
        )

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> CounterBackend:
        return self._inner

    def __len__(self) -> int:
        return len(self._entries)

    def hit_now(self, checks: Sequence[LimitCheck]) -> HitResult | None:
        """A refusal known without asking the store, or None (then call ``hit``): lets
        the data plane answer a flood without a task or an await."""
        cached = self._lookup(checks, self._clock())
        if cached is not None:
            self.hits += 1
            self._events.deny_cache_hit()
        return cached

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        now = self._clock()
        cached = self._lookup(checks, now)
        if cached is not None:
            self.hits += 1
            self._events.deny_cache_hit()
            return cached
        result = await self._inner.hit(checks)
        if not result.admitted and result.source in self._sources:
            self._remember(checks, result, now, self._clock())
        return result

    def submit(self, checks: Sequence[LimitCheck], done: HitSettled) -> bool:
        """``hit`` by callback (``CounterBackend``): refusals are remembered the same way."""
        inner_submit = self._inner_submit
        if inner_submit is None:
            return False
        now = self._clock()
        cached = self._lookup(checks, now)
        if cached is not None:
            self.hits += 1
            self._events.deny_cache_hit()
            asyncio.get_running_loop().call_soon(done, cached)
            return True

        def settled(outcome: HitResult | Exception) -> None:
            if (
                isinstance(outcome, HitResult)
                and not outcome.admitted
                and outcome.source in self._sources
            ):
                self._remember(checks, outcome, now, self._clock())
            done(outcome)

        return inner_submit(checks, settled)

    def _lookup(self, checks: Sequence[LimitCheck], now: int) -> HitResult | None:
        if not checks or not self._entries:
            return None
        denied = False
        certain = 0
        states: list[LimitState] = []
        for check in checks:
            entry = self._entries.get(check.key)
            if entry is None:
                return None
            if (
                entry.until_ms <= now
                or entry.limit != check.limit
                or entry.window_ms != check.window_ms
            ):
                del self._entries[check.key]
                return None
            if entry.denied and check.enforce:
                denied = True
                left = entry.until_ms - now
                certain = left if not certain else min(certain, left)
            states.append(
                LimitState(entry.allowed, entry.remaining, max(0, entry.reset_at_ms - now))
            )
        if not denied:
            return None
        return HitResult(False, tuple(states), source="deny-cache", certain_ms=certain)

    def _remember(
        self, checks: Sequence[LimitCheck], result: HitResult, sent_at: int, answered_at: int
    ) -> None:
        until = sent_at
        for check, state in zip(checks, result.states, strict=True):
            if check.enforce and not state.allowed:
                until = max(until, sent_at + state.reset_ms)
        if until <= sent_at:
            return
        # The other limits of the call are kept too, for the headers of cached
        # answers; their numbers are the store's last word and only age.
        for check, state in zip(checks, result.states, strict=True):
            denied = check.enforce and not state.allowed
            entry_until = sent_at + state.reset_ms if denied else until
            self._entries[check.key] = _Entry(
                entry_until,
                max(sent_at, answered_at) + state.reset_ms,
                state.remaining,
                state.allowed,
                denied,
                check.limit,
                check.window_ms,
            )
            self._entries.move_to_end(check.key)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)

    async def healthy(self) -> bool:
        return await self._inner.healthy()

    async def close(self) -> None:
        self._entries.clear()
        await self._inner.close()
