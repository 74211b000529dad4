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
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol, TypeVar

from gateway.counters.base import (
    CounterUnavailableError,
    HitResult,
    HitSettled,
    LimitCheck,
    hand_over,
)
from gateway.counters.errors import QueuedBehindTimeoutError, StoreTimeoutError, seconds_text

__all__ = ["CoalescerOverloadedError", "CoalescingBackend", "StoreTimeoutError"]

T = TypeVar("T")

# A timer that fires later than this was held up by the event loop, not the store.
LAG_SLACK_SECONDS: Final = 0.002


# What ``send_many`` hands back: one result or exception per entry, or why all failed.
BatchSettled = Callable[[list[HitResult | Exception] | Exception], None]


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


class _Pending:
    """One queued check: answered through its caller's future (``hit``) or callback
    (``submit``), exactly once."""

    __slots__ = ("checks", "deadline", "done", "future", "settled")

    def __init__(
        self,
        checks: Sequence[LimitCheck],
        deadline: float,  # loop time after which it gives up waiting for a turn
        future: asyncio.Future[HitResult] | None,
        done: HitSettled | None,
    ) -> None:
        self.checks = checks
        self.deadline = deadline
        self.future = future
        self.done = done
        self.settled = False

    def wanted(self) -> bool:
        """Not answered yet, and its caller still waits (a cancelled ``hit`` does not)."""
        future = self.future
        return not self.settled and (future is None or not future.done())

    def settle(self, outcome: HitResult | Exception) -> None:
        if not self.wanted():
            return
        self.settled = True
        hand_over(self.future, self.done, outcome)

    def cancel(self) -> None:
        if self.future is not None:
            self.future.cancel()
        else:
            self.settle(CounterUnavailableError("the counter backend is closed"))


def _late_rearm(when: float, now: float, give_up: float) -> float | None:
    """When a store-timeout timer due at ``when`` fires at ``now``: the time to check
    again if it fired late (the loop was busy, which is not the store's fault), capped at
    ``give_up``; None when the timeout has really run out."""
    late = now - when
    if late > LAG_SLACK_SECONDS and now < give_up:
        return min(now + late, give_up)
    return None


def _store_timeout(seconds: float | None) -> StoreTimeoutError:
    return StoreTimeoutError(f"the counter store did not answer within {seconds_text(seconds)}s")


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
        again = _late_rearm(when, loop.time(), give_up)
        if again is not None:
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


class _Round:
    """One pipeline sent without a task (``send_many``): its checks, and the two clocks
    of the awaited way, as timers. The store timeout runs from the send (re-armed for as
    long as its timer fired late, up to the hard bound); when it runs out every check
    fails with ``StoreTimeoutError`` and the round no longer holds its slot; at the hard
    bound the connection is dropped, as the awaited way cancels its round trip."""

    __slots__ = ("handle", "items", "owner", "sent_at")

    def __init__(self, owner: CoalescingBackend, items: list[_Pending]) -> None:
        self.owner = owner
        self.items = items
        self.handle: asyncio.TimerHandle | None = None
        self.sent_at = 0.0

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sent_at = now = loop.time()
        timeout = self.owner._call_timeout
        if timeout is not None:
            self.handle = loop.call_at(now + timeout, self._check, now + timeout)
        else:
            self.handle = loop.call_at(now + self.owner._batch_timeout, self._hard_bound)

    def replied(self, outcome: list[HitResult | Exception] | Exception) -> None:
        handle = self.handle
        if handle is not None:
            handle.cancel()
            self.handle = None
        self.owner._round_done(self)
        if isinstance(outcome, Exception):
            for item in self.items:
                item.settle(outcome)
        else:
            for item, result in zip(self.items, outcome, strict=True):
                item.settle(result)

    def _check(self, when: float) -> None:
        owner = self.owner
        loop = asyncio.get_running_loop()
        now = loop.time()
        give_up = self.sent_at + owner._batch_timeout
        again = _late_rearm(when, now, give_up)
        if again is not None:
            self.handle = loop.call_at(again, self._check, again)
            return
        owner.wire_timeouts += 1
        failure = _store_timeout(owner._call_timeout)
        for item in self.items:
            item.settle(failure)
        owner._fail_waiting()
        owner._round_done(self)  # it no longer holds a slot; the reply is still awaited
        self.handle = loop.call_at(max(give_up, now), self._hard_bound)

    def _hard_bound(self) -> None:
        self.handle = None
        owner = self.owner
        drop = owner._drop
        if drop is not None:
            drop("a pipeline to the counter store ran past its hard bound")
        else:  # pragma: no cover - send_many comes with drop_connection
            self.replied(StoreTimeoutError("the counter store did not answer"))


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
        # The lean way: pipelines written at the end of the loop turn that queued their
        # checks, answered from the read that completes them, no task on the way
        # (``RedisBackend.send_many`` over the lean connection; benchmarks/README.md,
        # "Counter callbacks"). Rounds in flight that still hold a slot, and the turn's
        # flush once scheduled.
        self._send_many: Callable[[Sequence[Sequence[LimitCheck]], BatchSettled], bool] | None = (
            getattr(inner, "send_many", None) if getattr(inner, "lean", False) else None
        )
        self._drop: Callable[[str], None] | None = getattr(inner, "drop_connection", None)
        self._rounds: set[_Round] = set()
        self._flush_handle: asyncio.Handle | None = None
        # Pipelines sent and checks carried; for benchmarks and /info.
        self.batches = 0
        self.batched_calls = 0
        # Round trips that ran past the store timeout, and checks that waited too long.
        self.wire_timeouts = 0
        self.queue_timeouts = 0
        # Checks failed while queued because the round trip ahead of them timed out.
        self.queue_failed = 0

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
        if self._draining == 0 and not self._pending and not self._rounds:
            return await self._hit_alone(checks)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[HitResult] = loop.create_future()
        self._queue(
            loop, _Pending(checks, loop.time() + (self._queue_timeout or 0.0), future, None)
        )
        return await future

    def submit(self, checks: Sequence[LimitCheck], done: HitSettled) -> bool:
        """``hit`` without a coroutine: ``done`` gets the result or the exception, once,
        later (never before this returns). Saves each request that waits for the store
        a task and a chain of coroutines (benchmarks/README.md, "Counter callbacks")."""
        loop = asyncio.get_running_loop()
        item = _Pending(checks, loop.time() + (self._queue_timeout or 0.0), None, done)
        if self._closed:
            loop.call_soon(item.settle, CounterUnavailableError("the counter backend is closed"))
        elif len(self._pending) >= self._max_pending:
            loop.call_soon(item.settle, CoalescerOverloadedError("too many counter checks waiting"))
        else:
            self._queue(loop, item)
        return True

    def _queue(self, loop: asyncio.AbstractEventLoop, item: _Pending) -> None:
        self._pending.append(item)
        if self._queue_timeout is not None and self._expiry is None:
            self._expiry = loop.call_at(item.deadline, self._expire)
        if self._send_many is not None:
            if self._flush_handle is None:
                self._flush_handle = loop.call_soon(self._flush)
        elif self._draining < self._max_in_flight:
            self._start_drain()

    def _flush(self) -> None:
        """Send what this loop turn queued, in pipelines of up to ``max_batch``, without
        a task; falls back to the awaited way when the lean connection is not open."""
        self._flush_handle = None
        send_many = self._send_many
        if self._closed or send_many is None:
            return
        loop = asyncio.get_running_loop()
        pending = self._pending
        while pending and len(self._rounds) + self._draining < self._max_in_flight:
            batch: list[_Pending] = []
            while pending and len(batch) < self._max_batch:
                item = pending.popleft()
                if item.wanted():
                    batch.append(item)
            if not batch:
                continue
            round_ = _Round(self, batch)
            try:
                sent = send_many([item.checks for item in batch], round_.replied)
            except Exception as exc:  # a bug: these checks still get an answer
                for item in batch:
                    item.settle(exc)
                continue
            if not sent:
                # No open connection (first use, or after a failure): the awaited way
                # connects. What was taken goes back to the head of the queue.
                pending.extendleft(reversed(batch))
                self._start_drain()
                return
            self.batches += 1
            self.batched_calls += len(batch)
            self._rounds.add(round_)
            round_.arm(loop)

    def _fail_waiting(self) -> None:
        """A round trip ran out of time: the checks queued behind it fail with it. Sent
        in the next round trip, they would wait for a store that answers no sooner, and
        an outage would add up to two store timeouts to them, not one (SPEC 4: at most
        the timeout; the breaker then answers the next ones without waiting). Only the
        checks queued now: one that a settled caller queues meanwhile (a pipelined
        request starting) goes out as usual."""
        if not self._pending:
            return
        waiting = list(self._pending)
        self._pending.clear()
        failure = QueuedBehindTimeoutError(
            f"the counter store did not answer a round trip ahead of this check within "
            f"{seconds_text(self._call_timeout)}s"
        )
        for item in waiting:
            if item.wanted():
                self.queue_failed += 1
                item.settle(failure)

    def _round_done(self, round_: _Round) -> None:
        # A round answered or timed out: its slot is free for what queued meanwhile.
        if round_ in self._rounds:
            self._rounds.discard(round_)
            if self._pending and self._flush_handle is None and not self._closed:
                self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    def _expire(self) -> None:
        # The queue is in arrival order, so the oldest checks expire first.
        self._expiry = None
        now = asyncio.get_running_loop().time()
        while self._pending and self._pending[0].deadline <= now:
            item = self._pending.popleft()
            if item.wanted():
                self.queue_timeouts += 1
                item.settle(
                    CoalescerOverloadedError(
                        "a counter check waited over "
                        f"{seconds_text(self._queue_timeout)}s for its turn"
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
            raise _store_timeout(self._call_timeout)
        return task.result()

    def _alone_done(self, task: asyncio.Task[HitResult]) -> None:
        self._alone.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here, since its caller may have gone

    def _slot_freed(self, verdict: asyncio.Future[bool]) -> None:
        # The single call answered or ran out of time (it may still be running). Out of
        # time: what queued behind it fails with it, before anything is sent again.
        self._draining -= 1
        if not verdict.cancelled() and not verdict.result():
            self._fail_waiting()
        if self._pending and self._draining < self._max_in_flight and not self._closed:
            if self._send_many is not None:
                self._flush()
            else:
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
            # The lean way takes over again once the awaited way has connected.
            if (
                self._send_many is not None
                and self._pending
                and not self._closed
                and self._flush_handle is None
            ):
                self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)

    async def _drain_queue(self) -> None:
        # Runs on a later loop turn than the ``hit`` that started it, so every check
        # submitted in the meantime joins the first pipeline.
        while self._pending:
            batch: list[_Pending] = []
            while self._pending and len(batch) < self._max_batch:
                item = self._pending.popleft()
                if item.wanted():  # not a caller that timed out or was cancelled
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
                failure = _store_timeout(self._call_timeout)
                for item in batch:
                    item.settle(failure)
                self._fail_waiting()

    async def _send(self, batch: list[_Pending]) -> None:
        try:
            results = await self._bounded(self._inner.hit_many([item.checks for item in batch]))
        except asyncio.CancelledError:
            for item in batch:
                item.cancel()
            raise
        except Exception as exc:
            for item in batch:
                item.settle(exc)
            return
        for item, result in zip(batch, results, strict=True):
            item.settle(result)

    async def healthy(self) -> bool:
        return await self._inner.healthy()

    async def close(self) -> None:
        self._closed = True
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        closed = CounterUnavailableError("the counter backend is closed")
        for round_ in list(self._rounds):
            round_.replied(closed)
        tasks: list[asyncio.Task[Any]] = [*self._tasks, *self._alone]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        while self._pending:
            self._pending.popleft().settle(CounterUnavailableError("the counter backend is closed"))
        await self._inner.close()
