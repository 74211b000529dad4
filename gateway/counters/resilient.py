"""Timeout, circuit breaker and local fallback in front of a shared counter store.

An outage of the store adds at most one timeout to a request; once the breaker is
open it adds nothing. While the store is unavailable, checks that may fail open are
answered by an in-process ``MemoryBackend`` (so each instance still bounds what it
lets through) and a call with an enforced fail-closed check raises
``CounterUnavailableError``. After ``reset_seconds`` one probe call goes to the store
again; when it succeeds the breaker closes and traffic returns to the store, with no
restart.

The timeout is the store's: with a ``CoalescingBackend`` built with
``call_timeout_seconds`` it runs from when a round trip is sent until its reply, so
time a check spends waiting for its turn under a burst is not taken for an outage.
That wait has its own, longer bound; running past it (``CoalescerOverloadedError``)
is local overload: the check is answered like an outage (fallback or fail closed)
but the breaker does not count it, and no store error is reported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.counters.base import (
    CounterBackend,
    CounterEvents,
    CounterUnavailableError,
    HitResult,
    HitSettled,
    LimitCheck,
    NoEvents,
)
from gateway.counters.coalesce import CoalescerOverloadedError, CoalescingBackend
from gateway.counters.memory import MemoryBackend

log = logging.getLogger("gateway.counters")

# At most one log line this often about checks that waited too long locally.
OVERLOAD_LOG_SECONDS: Final = 10.0
# Added to the inner backend's own bound: the outer timeout is only a safety net.
SAFETY_MARGIN_SECONDS: Final = 0.5

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


def failure_kind(exc: BaseException) -> str:
    """How a failed call is reported: ``timeout``, ``connection`` or ``error``."""
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "connection"
    return "error"


class CircuitBreaker:
    """Consecutive-failure breaker with a single probe call when half open."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        reset_seconds: float = 1.0,
        events: CounterEvents | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or reset_seconds < 0:
            raise ValueError("failure_threshold must be >= 1 and reset_seconds >= 0")
        self._threshold = failure_threshold
        self._reset = reset_seconds
        self._events: CounterEvents = events or NoEvents()
        self._monotonic = monotonic
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False

    @property
    def state(self) -> str:
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to the store now (claims the probe when half open)."""
        if self._state == CLOSED:
            return True
        if self._state == OPEN:
            if self._monotonic() - self._opened_at < self._reset:
                return False
            self._move(HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        self._failures = 0
        self._probing = False
        if self._state != CLOSED:
            self._move(CLOSED)

    def failure(self) -> None:
        self._probing = False
        self._failures += 1
        if self._state == HALF_OPEN or (
            self._state == CLOSED and self._failures >= self._threshold
        ):
            self._opened_at = self._monotonic()
            self._move(OPEN)

    def release(self) -> None:
        """A call that was allowed ended without a verdict (cancelled)."""
        self._probing = False

    def _move(self, state: str) -> None:
        self._state = state
        self._events.breaker_changed(state)


class ResilientBackend:
    """Wraps a shared store with a timeout, a breaker and a local fallback."""

    def __init__(
        self,
        inner: CounterBackend,
        *,
        timeout_seconds: float = 0.05,
        failure_threshold: int = 5,
        reset_seconds: float = 1.0,
        fallback: MemoryBackend | None = None,
        events: CounterEvents | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        self._inner = inner
        self._timeout = timeout_seconds
        # When the inner backend times the store on the wire itself, waiting outside
        # the store is bounded there too and this is only an outer safety net.
        inner_bound = inner.max_wait_seconds if isinstance(inner, CoalescingBackend) else None
        self._deadline = (
            timeout_seconds if inner_bound is None else inner_bound + SAFETY_MARGIN_SECONDS
        )
        # A coalescer with both clocks set ends every call within its own bound (a
        # watched round trip, a queue expiry), so the outer timer (a Timeout object and
        # a timer handle per request, ~7% of the Redis row's profile) is not armed.
        self._outer_timeout = inner_bound is None
        # ``submit`` needs every call to end by itself: only over a coalescer with both
        # clocks set (no outer timer to arm).
        self._inner_submit = inner.submit if isinstance(inner, CoalescingBackend) else None
        if self._outer_timeout:
            self._inner_submit = None
        self._monotonic = monotonic
        self._overloaded = 0
        self._overload_logged_at: float | None = None
        self._events: CounterEvents = events or NoEvents()
        self._fallback = fallback if fallback is not None else MemoryBackend(label="fallback")
        self._breaker = CircuitBreaker(
            failure_threshold=failure_threshold,
            reset_seconds=reset_seconds,
            events=self._events,
            monotonic=monotonic,
        )

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> CounterBackend:
        return self._inner

    @property
    def breaker_state(self) -> str:
        """``closed`` (store in use), ``open`` (fallback) or ``half_open`` (probing)."""
        return self._breaker.state

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if self._breaker.allow():
            try:
                if self._outer_timeout:
                    async with asyncio.timeout(self._deadline):
                        result = await self._inner.hit(checks)
                else:
                    result = await self._inner.hit(checks)
            except asyncio.CancelledError:
                self._breaker.release()
                raise
            except Exception as exc:
                if self._failed(exc):
                    raise
            else:
                self._breaker.success()
                return result
        return self._fallback_hit(checks)

    def submit(self, checks: Sequence[LimitCheck], done: HitSettled) -> bool:
        """``hit`` by callback (``CounterBackend``): the same breaker, fallback and
        error handling, with no coroutine while the store answers."""
        inner_submit = self._inner_submit
        if inner_submit is None:
            return False
        if self._breaker.allow():

            def settled(outcome: HitResult | Exception) -> None:
                if isinstance(outcome, HitResult):
                    self._breaker.success()
                    done(outcome)
                elif self._failed(outcome):
                    done(outcome)
                else:
                    done(self._fallback_outcome(checks))

            if inner_submit(checks, settled):
                return True
            self._breaker.release()
            return False
        asyncio.get_running_loop().call_soon(done, self._fallback_outcome(checks))
        return True

    def _failed(self, exc: Exception) -> bool:
        """Book a failed store call. True: the caller's own fault, raised as it is;
        False: answered by the fallback (or refused when the check fails closed)."""
        if isinstance(exc, ValueError | TypeError):
            # A malformed check is the caller's bug, not an outage of the store.
            self._breaker.release()
            return True
        if isinstance(exc, CoalescerOverloadedError):
            # Waited too long for a turn here: local overload, not the store's fault.
            self._breaker.release()
            self._note_overload()
            return False
        kind = failure_kind(exc)
        self._events.store_error(kind)
        log.debug("counter store call failed: %s (%s)", kind, type(exc).__name__)
        self._breaker.failure()
        return False

    def _fallback_outcome(self, checks: Sequence[LimitCheck]) -> HitResult | Exception:
        try:
            return self._fallback_hit(checks)
        except CounterUnavailableError as exc:
            return exc

    def _note_overload(self) -> None:
        self._overloaded += 1
        now = self._monotonic()
        last = self._overload_logged_at
        if last is None or now - last >= OVERLOAD_LOG_SECONDS:
            self._overload_logged_at = now
            log.warning(
                "counter checks waited too long for a turn to the store (%d so far); "
                "answered by the local fallback or refused (fail closed)",
                self._overloaded,
            )

    def _fallback_hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if any(check.enforce and not check.fail_open for check in checks):
            raise CounterUnavailableError("the counter store is unavailable")
        self._events.fallback_used()
        result = self._fallback.hit_now(checks)
        return HitResult(result.admitted, result.states, source="fallback")

    async def healthy(self) -> bool:
        try:
            async with asyncio.timeout(max(self._timeout, 0.5)):
                return await self._inner.healthy()
        except Exception:
            return False

    async def close(self) -> None:
        await self._inner.close()
        await self._fallback.close()
