"""Coalescing of concurrent checks into pipelines.

A check that finds nothing in flight goes out at once. Checks that arrive while a
round trip is in flight wait in a queue and go out together in the next pipeline, so
the number of round trips per second is bounded by ``max_in_flight / round-trip
time`` however many requests arrive: under load each pipeline just carries more
checks.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from gateway.counters.base import CounterUnavailableError, HitResult, LimitCheck


class BatchCounterBackend(Protocol):
    """A backend that can run many independent ``hit`` calls in one round trip."""

    @property
    def name(self) -> str: ...

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult: ...

    async def hit_many(
        self, batch: Sequence[Sequence[LimitCheck]]
    ) -> list[HitResult | Exception]: ...

    async def healthy(self) -> bool: ...

    async def close(self) -> None: ...


class CoalescerOverloadedError(CounterUnavailableError):
    """More checks are waiting than the coalescer is allowed to queue."""


_Pending = tuple[Sequence[LimitCheck], "asyncio.Future[HitResult]"]


class CoalescingBackend:
    """A ``CounterBackend`` that batches concurrent ``hit`` calls into pipelines."""

    def __init__(
        self,
        inner: BatchCounterBackend,
        *,
        max_batch: int = 256,
        max_in_flight: int = 1,
        max_pending: int = 50_000,
        batch_timeout_seconds: float = 1.0,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1 or max_pending < 1:
            raise ValueError("max_batch, max_in_flight and max_pending must be >= 1")
        self._inner = inner
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._max_pending = max_pending
        # A pipeline that hangs (a stopped server) must not hold the queue forever;
        # callers have their own, shorter timeout in ResilientBackend.
        self._batch_timeout = batch_timeout_seconds
        self._pending: deque[_Pending] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._alone: set[asyncio.Task[HitResult]] = set()
        # Counted by hand: a finished task leaves ``_tasks`` only in a later callback,
        # and a check queued in between would wait for a drain that never comes.
        self._draining = 0
        self._closed = False
        # Pipelines sent and checks carried; for benchmarks and /info.
        self.batches = 0
        self.batched_calls = 0

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> BatchCounterBackend:
        return self._inner

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if self._closed:
            raise CounterUnavailableError("the counter backend is closed")
        if len(self._pending) >= self._max_pending:
            raise CoalescerOverloadedError("too many counter checks waiting")
        if self._draining == 0 and not self._pending:
            return await self._hit_alone(checks)
        future: asyncio.Future[HitResult] = asyncio.get_running_loop().create_future()
        self._pending.append((checks, future))
        if self._draining < self._max_in_flight:
            self._start_drain()
        return await future

    async def _hit_alone(self, checks: Sequence[LimitCheck]) -> HitResult:
        # Nothing in flight: send this one at once as a plain call (a pipeline costs
        # more than it saves for one check). Checks arriving meanwhile queue up and
        # leave together as soon as it is back. The call runs in its own task and
        # the caller waits through a shield: a caller that gives up (timeout) must
        # not cancel the command mid-reply, which would cost the connection and,
        # under load, turn slowness into a reconnect storm.
        self._draining += 1
        self.batches += 1
        self.batched_calls += 1
        task = asyncio.create_task(self._inner.hit(checks))
        self._alone.add(task)
        task.add_done_callback(self._alone_done)
        return await asyncio.shield(task)

    def _alone_done(self, task: asyncio.Task[HitResult]) -> None:
        self._alone.discard(task)
        self._draining -= 1
        if not task.cancelled():
            task.exception()  # retrieved here, since its caller may have gone
        if self._pending and self._draining < self._max_in_flight and not self._closed:
            self._start_drain()

    def _start_drain(self) -> None:
        self._draining += 1
        task = asyncio.create_task(self._drain())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self) -> None:
        try:
            await self._drain_queue()
        finally:
            self._draining -= 1

    async def _drain_queue(self) -> None:
        # Runs on a later loop turn than the ``hit`` that started it, so every check
        # submitted in the meantime joins the first pipeline.
        while self._pending:
            batch: list[_Pending] = []
            while self._pending and len(batch) < self._max_batch:
                item = self._pending.popleft()
                if not item[1].done():  # a caller that timed out or was cancelled
                    batch.append(item)
            if not batch:
                continue
            self.batches += 1
            self.batched_calls += len(batch)
            try:
                async with asyncio.timeout(self._batch_timeout):
                    results = await self._inner.hit_many([checks for checks, _ in batch])
            except asyncio.CancelledError:
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, Exception):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def healthy(self) -> bool:
        return await self._inner.healthy()

    async def close(self) -> None:
        self._closed = True
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._alone]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._pending:
            _, future = self._pending.popleft()
            if not future.done():
                future.set_exception(CounterUnavailableError("the counter backend is closed"))
        await self._inner.close()
