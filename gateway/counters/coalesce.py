"""Coalescing of concurrent checks into pipelines.

A check that finds nothing in flight goes out at once. Checks that arrive while a
round trip is in flight wait in a queue and go out together in the next pipeline, so
the number of round trips per second is bounded by ``max_in_flight / round-trip
time`` however many requests arrive: under load each pipeline just carries more
checks.

Two clocks, kept apart (``call_timeout_seconds`` and ``queue_timeout_seconds``):

* the store timeout runs from when a round trip is sent until its reply, so it
  measures the store and the wire, not how long a check waited for its turn. When it
  runs out every check of that round trip fails with ``TimeoutError`` (a store
  failure) and the round trip stops holding its slot; it keeps running in the
  background (up to ``batch_timeout_seconds``) so a slow reply does not cost the
  connection. Time the event loop could not run the timer (a busy loop) is not
  blamed on the store: a timer that fires late is re-armed for as long as it was late.
* the wait in the queue has its own, longer bound; a check that waits longer fails
  with ``CoalescerOverloadedError``, which is local overload, not a store failure.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gateway.counters.base import CounterUnavailableError, HitResult, LimitCheck
from gateway.counters.errors import StoreTimeoutError

__all__ = ["CoalescerOverloadedError", "CoalescingBackend", "StoreTimeoutError"]

T = TypeVar("T")

# A timer that fires later than this was held up by the event loop, not the store.
LAG_SLACK_SECONDS = 0.002


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
    """Too many checks are waiting, or one waited too long for its turn (local overload)."""


@dataclass(slots=True)
class _Pending:
    checks: Sequence[LimitCheck]
    future: asyncio.Future[HitResult]
    deadline: float  # loop time after which it gives up waiting for a turn


def _watch(
    task: asyncio.Task[Any], timeout: float | None, hard_limit: float
) -> asyncio.Future[bool]:
    """A future: True when ``task`` ends within ``timeout`` of being sent, else False.

    The clock starts right after the task's first step (when the command has been
    written or is waiting for a connection). A timer that fires late because the
    loop was busy is re-armed for as long as it was late, up to ``hard_limit``.
    """
    loop = asyncio.get_running_loop()
    verdict: asyncio.Future[bool] = loop.create_future()
    handle: asyncio.TimerHandle | None = None

    def finished(_: object) -> None:
        if handle is not None:
            handle.cancel()
        if not verdict.done():
            verdict.set_result(True)

    def check(when: float, give_up: float) -> None:
        nonlocal handle
        if verdict.done() or task.done():
            return  # ``finished`` settles it
        now = loop.time()
        late = now - when
        if late > LAG_SLACK_SECONDS and now < give_up:
            again = min(now + late, give_up)
            handle = loop.call_at(again, check, again, give_up)
            return
        verdict.set_result(False)

    def arm() -> None:
        nonlocal handle
        if verdict.done() or timeout is None:
            return
        now = loop.time()
        handle = loop.call_at(now + timeout, check, now + timeout, now + hard_limit)

    task.add_done_callback(finished)
    loop.call_soon(arm)  # runs right after the task's first step
    return verdict


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
        call_timeout_seconds: float | None = None,
        queue_timeout_seconds: float | None = None,
    ) -> None:
        if max_batch < 1 or max_in_flight < 1 or max_pending < 1:
            raise ValueError("max_batch, max_in_flight and max_pending must be >= 1")
        if batch_timeout_seconds <= 0:
            raise ValueError("batch_timeout_seconds must be > 0")
        if call_timeout_seconds is not None and call_timeout_seconds <= 0:
            raise ValueError("call_timeout_seconds must be > 0")
        if queue_timeout_seconds is not None and queue_timeout_seconds <= 0:
            raise ValueError("queue_timeout_seconds must be > 0")
        self._inner = inner
        self._max_batch = max_batch
        self._max_in_flight = max_in_flight
        self._max_pending = max_pending
        # The hard bound on any round trip, even one that no longer holds a slot: a
        # pipeline that hangs (a stopped server) must not run forever.
        self._batch_timeout = batch_timeout_seconds
        self._call_timeout = call_timeout_seconds
        self._queue_timeout = queue_timeout_seconds
        self._pending: deque[_Pending] = deque()
        self._expiry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._alone: set[asyncio.Task[HitResult]] = set()
        # Round trips slots are held by (drains plus single calls); counted by hand: a
        # finished task leaves its set only in a later callback, and a check queued in
        # between would wait for a drain that never comes.
        self._draining = 0
        self._closed = False
        # Pipelines sent and checks carried; for benchmarks and /info.
        self.batches = 0
        self.batched_calls = 0
        # Round trips that ran past the store timeout, and checks that waited too long.
        self.wire_timeouts = 0
        self.queue_timeouts = 0

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def inner(self) -> BatchCounterBackend:
        return self._inner

    @property
    def max_wait_seconds(self) -> float | None:
        """The longest a ``hit`` can take when both clocks are set (else ``None``)."""
        if self._call_timeout is None or self._queue_timeout is None:
            return None
        return self._queue_timeout + self._batch_timeout

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if self._closed:
            raise CounterUnavailableError("the counter backend is closed")
        if len(self._pending) >= self._max_pending:
            raise CoalescerOverloadedError("too many counter checks waiting")
        if self._draining == 0 and not self._pending:
            return await self._hit_alone(checks)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[HitResult] = loop.create_future()
        deadline = loop.time() + (self._queue_timeout or 0.0)
        self._pending.append(_Pending(checks, future, deadline))
        if self._queue_timeout is not None and self._expiry is None:
            self._expiry = loop.call_at(deadline, self._expire)
        if self._draining < self._max_in_flight:
            self._start_drain()
        return await future

    def _expire(self) -> None:
        # The queue is in arrival order, so the oldest checks expire first.
        self._expiry = None
        now = asyncio.get_running_loop().time()
        while self._pending and self._pending[0].deadline <= now:
            item = self._pending.popleft()
            if not item.future.done():
                self.queue_timeouts += 1
                item.future.set_exception(
                    CoalescerOverloadedError(
                        f"a counter check waited over {self._queue_timeout:g}s for its turn"
                    )
                )
        if self._pending and not self._closed:
            head = self._pending[0].deadline
            self._expiry = asyncio.get_running_loop().call_at(head, self._expire)

    async def _bounded(self, call: Awaitable[T]) -> T:
        async with asyncio.timeout(self._batch_timeout):
            return await call

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
        task = asyncio.create_task(self._bounded(self._inner.hit(checks)))
        self._alone.add(task)
        task.add_done_callback(self._alone_done)
        verdict = _watch(task, self._call_timeout, self._batch_timeout)
        verdict.add_done_callback(self._slot_freed)
        if not await asyncio.shield(verdict):
            self.wire_timeouts += 1
            raise StoreTimeoutError(
                f"the counter store did not answer within {self._call_timeout:g}s"
            )
        return task.result()

    def _alone_done(self, task: asyncio.Task[HitResult]) -> None:
        self._alone.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here, since its caller may have gone

    def _slot_freed(self, _: object) -> None:
        # The single call answered or ran out of time (it may still be running).
        self._draining -= 1
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
                if not item.future.done():  # a caller that timed out or was cancelled
                    batch.append(item)
            if not batch:
                continue
            self.batches += 1
            self.batched_calls += len(batch)
            task = asyncio.create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            verdict = _watch(task, self._call_timeout, self._batch_timeout)
            try:
                in_time = await asyncio.shield(verdict)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if not in_time:
                # Every check of this round trip fails; the pipeline itself keeps
                # running (bounded) so its connection survives a slow reply, and
                # this slot moves on to the next batch.
                self.wire_timeouts += 1
                failure = StoreTimeoutError(
                    f"the counter store did not answer within {self._call_timeout:g}s"
                )
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(failure)

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            results = await self._bounded(self._inner.hit_many([item.checks for item in batch]))
        except asyncio.CancelledError:
            for item in batch:
                item.future.cancel()
            raise
        except Exception as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        for item, result in zip(batch, results, strict=True):
            if item.future.done():
                continue
            if isinstance(result, Exception):
                item.future.set_exception(result)
            else:
                item.future.set_result(result)

    async def healthy(self) -> bool:
        return await self._inner.healthy()

    async def close(self) -> None:
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._alone]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._pending:
            item = self._pending.popleft()
            if not item.future.done():
                item.future.set_exception(CounterUnavailableError("the counter backend is closed"))
        await self._inner.close()
