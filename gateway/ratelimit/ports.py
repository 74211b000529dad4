"""The limiter's port: what it asks of wherever counts are kept (the limiter defines it;
the backends in ``gateway.counters`` implement it, so the layers point one way:
proxy -> ratelimit -> this port <- counters).

Every backend (in-process memory, Redis standalone, Redis Cluster, and the wrappers
that add a circuit breaker, a local fallback and a deny cache) implements
``CounterBackend``. One call checks every limit a request is subject to and counts
the request against all of them or none, so a rejected request uses up no quota.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class LimitCheck:
    """One limit to check for one identity.

    ``key`` is the counter key, already namespaced and hash-tagged
    (``rl:{<region>:<rule-id>:<identity-hash>}:<window>s:v2``); all checks passed to
    one ``hit`` call share the hash tag so they live in one Redis Cluster slot.
    """

    key: str
    limit: int
    window_ms: int
    bucket_ms: int
    # False for shadow rules: counted while they have room, never block the request.
    enforce: bool = True
    # What to do when the counter store is unavailable: admit (counting locally) or refuse.
    fail_open: bool = True

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        key: str,
        limit: int,
        window_ms: int,
        bucket_ms: int,
        enforce: bool = True,
        fail_open: bool = True,
    ) -> None:
        self.key = key
        self.limit = limit
        self.window_ms = window_ms
        self.bucket_ms = bucket_ms
        self.enforce = enforce
        self.fail_open = fail_open


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class LimitState:
    """What one limit looked like after the call."""

    allowed: bool  # the limit had room for this request
    remaining: int  # requests left in the trailing window after this call, >= 0
    reset_ms: int  # ms until the next slot frees (until one request fits, when full)

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(self, allowed: bool, remaining: int, reset_ms: int) -> None:
        self.allowed = allowed
        self.remaining = remaining
        self.reset_ms = reset_ms


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class HitResult:
    admitted: bool  # every enforced limit had room, so all of them were counted
    states: tuple[LimitState, ...]  # one per check, in the order given
    # Where the answer came from: "memory", "redis", "fallback" (local counting while
    # the shared store is unavailable) or "deny-cache" (known over limit, not asked).
    source: str = "memory"
    # For a refusal: for how long from now (ms) any request with these checks is sure
    # to be refused too (0: not known). Lets callers answer repeats without asking.
    certain_ms: int = 0

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        admitted: bool,
        states: tuple[LimitState, ...],
        source: str = "memory",
        certain_ms: int = 0,
    ) -> None:
        self.admitted = admitted
        self.states = states
        self.source = source
        self.certain_ms = certain_ms


# What a backend's ``submit`` hands its answer to: the result, or the exception ``hit``
# would have raised.
HitSettled: TypeAlias = Callable[[HitResult | Exception], None]


class CounterUnavailableError(Exception):
    """The counter store cannot answer and a check asked to fail closed."""


class CounterBackend(Protocol):
    """A place that keeps sliding-window counts."""

    @property
    def name(self) -> str:
        """Short description for logs and ``/info`` (never contains credentials)."""
        ...

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        """Check all ``checks`` and count the request in all or none of them.

        A backend may also offer ``hit_now(checks) -> HitResult | None``: the same
        answer when it is known without waiting (in-process counts, a cached refusal),
        None otherwise. The data plane uses it to answer without a task.

        And ``submit(checks, done: HitSettled) -> bool``: the same call, answered by
        calling ``done`` once, later (never before ``submit`` returns), with the result
        or the exception ``hit`` would raise. False means it cannot (then nothing was
        started and ``done`` is never called; use ``hit``). The data plane uses it to
        wait for the store without a task.

        The request is admitted when every enforced check has room; then every
        enforced check, and every shadow check that has room, is counted. When it is
        not admitted nothing is counted.
        """
        ...

    async def healthy(self) -> bool:
        """Whether the store answers right now (for ``/info``)."""
        ...

    async def close(self) -> None:
        """Release connections and background tasks."""
        ...


class CounterEvents(Protocol):
    """What the resilience wrappers report; ``app.py`` binds it to metrics and logs."""

    def store_error(self, kind: str) -> None:
        """A call to the shared store failed (``auth``: the credentials were refused,
        ``timeout``, ``connection``, ``error``)."""

    def breaker_changed(self, state: str) -> None:
        """The circuit breaker moved to ``closed``, ``open`` or ``half_open``."""

    def fallback_used(self) -> None:
        """A decision was taken by the local fallback counters."""

    def deny_cache_hit(self) -> None:
        """A request was refused from the local deny cache without asking the store."""


class NoEvents:
    """A ``CounterEvents`` that ignores everything (tests, tools)."""

    def store_error(self, kind: str) -> None:
        pass

    def breaker_changed(self, state: str) -> None:
        pass

    def fallback_used(self) -> None:
        pass

    def deny_cache_hit(self) -> None:
        pass
