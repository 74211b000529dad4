"""Small helpers shared by the counter tests."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence

from gateway.counters.base import CounterBackend, HitResult, LimitCheck


class RecordingEvents:
    """A ``CounterEvents`` that keeps everything it is told, in order."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.breaker: list[str] = []
        self.fallbacks = 0
        self.deny_hits = 0

    def store_error(self, kind: str) -> None:
        self.errors.append(kind)

    def breaker_changed(self, state: str) -> None:
        self.breaker.append(state)

    def fallback_used(self) -> None:
        self.fallbacks += 1

    def deny_cache_hit(self) -> None:
        self.deny_hits += 1


def new_key(window_s: int | float = 60, region: str = "us", rule: str = "rule") -> str:
    """A fresh key in the lead's format, unique per call."""
    return f"rl:{{{region}:{rule}:{uuid.uuid4().hex[:16]}}}:{window_s}s:v2"


def keys_sharing_tag(count: int, region: str = "us") -> list[str]:
    """``count`` keys of one identity (one hash tag, so one cluster slot)."""
    tag = f"{region}:rule:{uuid.uuid4().hex[:16]}"
    return [f"rl:{{{tag}}}:{i}" for i in range(count)]


async def eventually(seconds: float, condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition()`` holds, failing with ``what`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds}s: {what}")
        await asyncio.sleep(0.02)


class ViaSubmit:
    """A backend called through ``submit`` (how the data plane waits for the store)
    instead of ``hit``; checks that every answer comes once, and never before
    ``submit`` has returned."""

    def __init__(self, backend: CounterBackend) -> None:
        self.backend = backend
        self.inner = getattr(backend, "inner", None)

    @property
    def name(self) -> str:
        return self.backend.name

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        future: asyncio.Future[HitResult] = asyncio.get_running_loop().create_future()
        returned = False

        def done(outcome: HitResult | Exception) -> None:
            assert returned, "submit answered before it returned"
            assert not future.done(), "submit answered twice"
            if isinstance(outcome, Exception):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        submit = getattr(self.backend, "submit", None)
        assert submit is not None, f"{self.backend!r} has no submit"
        assert submit(checks, done), "submit declined"
        returned = True
        return await future

    async def healthy(self) -> bool:
        return await self.backend.healthy()

    async def close(self) -> None:
        await self.backend.close()


def called(backend: CounterBackend, via: str) -> CounterBackend:
    """``backend`` as the tests call it: by ``hit`` or through ``submit``."""
    return ViaSubmit(backend) if via == "submit" else backend


class LoopLag:
    """How late the event loop ran a 10 ms timer while in use (``async with``, or
    ``start`` and ``stop``): ``worst`` is the largest lateness, ``stalled`` the sum of
    every lateness over 2 ms (the time a slow, loaded machine did not run the loop). A
    wall-clock bound plus a multiple of ``stalled`` tolerates such stalls and still
    tells a real defect apart on a machine that ran the loop on time."""

    TICK = 0.01
    SLACK = 0.002  # (the coalescer's LAG_SLACK_SECONDS: later than this is a stall)

    def __init__(self) -> None:
        self.worst = 0.0
        self.stalled = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopLag:
        self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.TICK
            await asyncio.sleep(self.TICK)
            late = loop.time() - due
            self.worst = max(self.worst, late)
            if late > self.SLACK:
                self.stalled += late
