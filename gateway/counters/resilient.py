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

What the fallback admitted is not forgotten when the store answers again: the store
never saw those requests, so on its own it would let the same identity through again
(up to twice the limit in one window from one process). Until every window that holds
a fallback admission has passed, a request whose keys the fallback counts must pass
both: it is refused here, without asking the store, when the fallback's count is full,
and a request the store admits is counted by the fallback too (and refused after all
if a concurrent one took the fallback's last slot meanwhile: the store then counted a
request that was not let through, which errs on the safe side). So each process admits
at most the limit in any trailing window that starts after an outage began, across the
outage and its end (N processes: N x limit). Requests whose keys the fallback does not
count, and every request once those windows have passed, take the usual path: the only
cost outside that time is one attribute test.

What this does not cover: the fallback starts from zero when an outage begins, not
knowing what the store admitted just before (knowing it would mean counting every
request locally as well, on the healthy path). A window that reaches back before the
outage may also hold those admissions: at most the limit more, shared by all processes.

A store that refuses the credentials (a wrong password, no password where one is
required, an ACL without the script's commands) is reported as ``auth``, not as a
connection failure, with a log line that says so (never the password).

An outage is logged as it is lived: one line when the breaker opens (the store is down),
one summary every ``outage_summary_seconds`` while it stays open (how long, how many
requests the fallback answered and how many fail-closed ones were refused, how many
probes failed), and one line when it closes again. The probes in between (one every
``reset_seconds``, each a move to ``half_open`` and, failing, back to ``open``) are
counted by the metrics, not logged: at one probe a second they were two log lines a
second per process, which buried everything else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Final

from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    NoPermissionError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.counters.base import (
    CounterBackend,
    CounterEvents,
    CounterUnavailableError,
    HitResult,
    HitSettled,
    LimitCheck,
    LimitState,
    NoEvents,
)
from gateway.counters.coalesce import CoalescerOverloadedError, CoalescingBackend
from gateway.counters.errors import QueuedBehindTimeoutError
from gateway.counters.memory import MemoryBackend

log = logging.getLogger("gateway.counters")

# At most one log line this often about checks that waited too long locally, and about
# refused credentials.
OVERLOAD_LOG_SECONDS: Final = 10.0
AUTH_LOG_SECONDS: Final = 10.0
# While the store stays down, one summary line this often (see the module docstring).
OUTAGE_SUMMARY_SECONDS: Final = 60.0
# Added to the inner backend's own bound: the outer timeout is only a safety net.
SAFETY_MARGIN_SECONDS: Final = 0.5

CLOSED: Final = "closed"
OPEN: Final = "open"
HALF_OPEN: Final = "half_open"


def refused_credentials(exc: BaseException) -> BaseException | None:
    """The refused authentication behind ``exc`` (itself, or what it was raised from:
    redis-py wraps it in a ``ConnectionError`` on some connections), or None."""
    seen: BaseException | None = exc
    for _ in range(3):
        if seen is None:
            return None
        # The test narrows a second name, not ``seen``: the compiled build sees redis's
        # classes as Any, and a value narrowed to Any cannot be returned as typed.
        probe: object = seen
        if isinstance(probe, AuthenticationError | AuthenticationWrongNumberOfArgsError):
            return seen
        if isinstance(probe, NoPermissionError):
            return seen
        seen = seen.__cause__
    return None


def failure_kind(exc: BaseException) -> str:
    """How a failed call is reported: ``auth``, ``timeout``, ``connection`` or ``error``."""
    # Before ``connection``: redis-py's AuthenticationError is a ConnectionError.
    if refused_credentials(exc) is not None:
        return "auth"
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "connection"
    return "error"


def auth_problem(exc: BaseException) -> str:
    """What a refused authentication means, for the log. Built from the server's error
    code, never from the credentials (neither Redis nor redis-py puts them in the text,
    but the text is not echoed either)."""
    exc = refused_credentials(exc) or exc
    text = str(exc)
    if isinstance(exc, NoPermissionError) or "NOPERM" in text:
        return "the user may not run the counter script (NOPERM): check its ACL"
    if (
        "NOAUTH" in text
        or "Authentication required" in text
        or "already authenticated" in text  # redis-py's HELLO without credentials
    ):
        return "the server requires a password and the counter URL has none"
    if isinstance(exc, AuthenticationWrongNumberOfArgsError):
        return "the server has no users: give only a password in the counter URL"
    return "wrong user name or password"


def _merged(store: LimitState, local: LimitState) -> LimitState:
    """One limit as the store and the carried-over local count see it together."""
    return LimitState(
        store.allowed and local.allowed,
        min(store.remaining, local.remaining),
        max(store.reset_ms, local.reset_ms),
    )


class CircuitBreaker:
    """Consecutive-failure breaker with a single probe call when half open."""

    def __init__(
        self,
        *,
        failure_threshold: int = 5,
        reset_seconds: float = 1.0,
        events: CounterEvents | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        moved: Callable[[str], None] | None = None,
    ) -> None:
        """``moved`` is told every state entered, after ``events`` (the backend's
        outage log)."""
        if failure_threshold < 1 or reset_seconds < 0:
            raise ValueError("failure_threshold must be >= 1 and reset_seconds >= 0")
        self._threshold = failure_threshold
        self._reset = reset_seconds
        self._events: CounterEvents = events or NoEvents()
        self._monotonic = monotonic
        self._moved = moved
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
        if self._moved is not None:
            self._moved(state)


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
        outage_summary_seconds: float = OUTAGE_SUMMARY_SECONDS,
    ) -> None:
        if timeout_seconds <= 0:
            raise ValueError("timeout_seconds must be > 0")
        if outage_summary_seconds <= 0:
            raise ValueError("outage_summary_seconds must be > 0")
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
        self._auth_failures = 0
        self._auth_logged_at: float | None = None
        self._events: CounterEvents = events or NoEvents()
        self._fallback = fallback if fallback is not None else MemoryBackend(label="fallback")
        # Until then (the fallback's clock, ms) the fallback's admissions are carried over
        # (see the module's docstring); 0: none to carry, the usual path.
        self._carry_until = 0
        # The outage being lived (see the module docstring); None: the store is not down.
        self._down_since: float | None = None
        self._last_failure = "error"  # the kind of the latest failed call, for the log
        self._reset_seconds = reset_seconds
        self._summary_seconds = outage_summary_seconds
        self._summary_due = 0.0
        self._down_served = 0  # answered by the fallback since the outage began
        self._down_refused = 0  # fail-closed checks refused since then
        self._down_probes = 0  # probes that failed since then
        self._breaker = CircuitBreaker(
            failure_threshold=failure_threshold,
            reset_seconds=reset_seconds,
            events=self._events,
            monotonic=monotonic,
            moved=self._breaker_moved,
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

    @property
    def fallback(self) -> MemoryBackend:
        return self._fallback

    @property
    def carrying(self) -> bool:
        """Whether fallback admissions are still carried over (a window holding one
        has not passed yet)."""
        return self._carry_until != 0 and self._fallback.now_ms() < self._carry_until

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if self._breaker.allow():
            if self._carry_until:
                refused = self._carried_refusal(checks)
                if refused is not None:
                    self._breaker.release()
                    return refused
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
                if self._carry_until:
                    return self._carried(checks, result)
                return result
        return self._fallback_hit(checks)

    def submit(self, checks: Sequence[LimitCheck], done: HitSettled) -> bool:
        """``hit`` by callback (``CounterBackend``): the same breaker, fallback and
        error handling, with no coroutine while the store answers."""
        inner_submit = self._inner_submit
        if inner_submit is None:
            return False
        if self._breaker.allow():
            # While fallback admissions are carried over, the local count is asked first
            # and counts what the store admits.
            carried = bool(self._carry_until)
            if carried:
                refused = self._carried_refusal(checks)
                if refused is not None:
                    self._breaker.release()
                    asyncio.get_running_loop().call_soon(done, refused)
                    return True

            def settled(outcome: HitResult | Exception) -> None:
                if isinstance(outcome, HitResult):
                    self._breaker.success()
                    done(self._carried(checks, outcome) if carried else outcome)
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

    def _carried_refusal(self, checks: Sequence[LimitCheck]) -> HitResult | None:
        """While fallback admissions are carried over: the refusal the fallback's count
        gives these checks (nothing counted), or None (ask the store). Ends the carrying
        once every window holding a fallback admission has passed."""
        fallback = self._fallback
        if fallback.now_ms() >= self._carry_until:
            self._carry_until = 0
            return None
        local = fallback.refusal(checks)
        if local is None:
            return None
        self._events.fallback_used()
        return HitResult(False, local.states, source="fallback", certain_ms=local.certain_ms)

    def _carried(self, checks: Sequence[LimitCheck], result: HitResult) -> HitResult:
        """The store's answer while fallback admissions are carried over: an admission
        is counted by the fallback too when it counts any of these keys, and refused
        when that count has no room left (a concurrent request took the last slot)."""
        fallback = self._fallback
        if not result.admitted or not fallback.holds_any(checks):
            return result
        local = fallback.hit_now(checks)
        states = tuple(
            _merged(store, mine) for store, mine in zip(result.states, local.states, strict=True)
        )
        if local.admitted:
            return HitResult(True, states, source=result.source)
        self._events.fallback_used()
        return HitResult(False, states, source="fallback", certain_ms=local.certain_ms)

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
        if isinstance(exc, QueuedBehindTimeoutError):
            # Never sent: the round trip ahead of it timed out, and its own checks are
            # what the breaker counts (one slow reply is one failure a check it carried,
            # not one more for every check that happened to queue behind it).
            self._breaker.release()
            return False
        kind = failure_kind(exc)
        self._last_failure = kind
        self._events.store_error(kind)
        log.debug("counter store call failed: %s (%s)", kind, type(exc).__name__)
        if kind == "auth":
            self._note_auth(exc)
        self._breaker.failure()
        return False

    def _note_auth(self, exc: Exception) -> None:
        """Log a refused authentication, at most once per ``AUTH_LOG_SECONDS``: it does
        not go away by itself, unlike an outage (no credentials in the line)."""
        self._auth_failures += 1
        now = self._monotonic()
        last = self._auth_logged_at
        if last is None or now - last >= AUTH_LOG_SECONDS:
            self._auth_logged_at = now
            log.error(
                "counter store %s: authentication failed: %s; check the user and password "
                "in the counter URL (redis_url). Failed calls so far: %d; fail-open rules "
                "are counted locally, fail-closed ones answer 503",
                self._inner.name,
                auth_problem(exc),
                self._auth_failures,
            )

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

    def _breaker_moved(self, state: str) -> None:
        """The outage's first and last log lines (probes in between are not logged)."""
        if state == OPEN and self._down_since is None:
            now = self._monotonic()
            self._down_since = now
            self._summary_due = now + self._summary_seconds
            self._down_served = self._down_refused = self._down_probes = 0
            log.warning(
                "counter store %s: unreachable (%s), circuit breaker open; until a probe "
                "(one every %g s) reaches it, fail-open rules are counted by this process "
                "alone and fail-closed rules answer 503",
                self._inner.name,
                self._last_failure,
                self._reset_seconds,
            )
        elif state == OPEN:
            self._down_probes += 1
        elif state == CLOSED and self._down_since is not None:
            log.info(
                "counter store %s: reachable again after %.0f s, circuit breaker closed; "
                "meanwhile %d request(s) were answered by the local fallback and %d "
                "refused (fail closed)",
                self._inner.name,
                self._monotonic() - self._down_since,
                self._down_served,
                self._down_refused,
            )
            self._down_since = None

    def _count_outage(self, served: bool) -> None:
        """A decision taken without the store while it is down: counted, and the
        periodic summary written when one is due."""
        since = self._down_since
        if since is None:
            return  # not an outage (a single failed call, local overload)
        if served:
            self._down_served += 1
        else:
            self._down_refused += 1
        now = self._monotonic()
        if now < self._summary_due:
            return
        self._summary_due = now + self._summary_seconds
        log.warning(
            "counter store %s: still unreachable after %.0f s (%s, %d probe(s) failed); "
            "since it went down %d request(s) were answered by the local fallback and %d "
            "refused (fail closed)",
            self._inner.name,
            now - since,
            self._last_failure,
            self._down_probes,
            self._down_served,
            self._down_refused,
        )

    def _fallback_hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if any(check.enforce and not check.fail_open for check in checks):
            self._count_outage(served=False)
            raise CounterUnavailableError("the counter store is unavailable")
        self._count_outage(served=True)
        self._events.fallback_used()
        fallback = self._fallback
        result = fallback.hit_now(checks)
        if result.admitted:
            # Carried over until the last window holding this admission has passed.
            now = fallback.now_ms()
            for check in checks:
                until = now + check.window_ms + check.bucket_ms
                if until > self._carry_until:
                    self._carry_until = until
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
