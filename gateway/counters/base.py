"""What the counter backends share: the limiter's port (``gateway.ratelimit.ports``,
re-exported here for them) and ``hand_over``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from gateway.ratelimit.ports import CounterBackend as CounterBackend
from gateway.ratelimit.ports import CounterEvents as CounterEvents
from gateway.ratelimit.ports import CounterUnavailableError as CounterUnavailableError
from gateway.ratelimit.ports import HitResult as HitResult
from gateway.ratelimit.ports import HitSettled as HitSettled
from gateway.ratelimit.ports import LimitCheck as LimitCheck
from gateway.ratelimit.ports import LimitState as LimitState
from gateway.ratelimit.ports import NoEvents as NoEvents

T = TypeVar("T")
log = logging.getLogger("gateway.counters")


def hand_over(
    future: asyncio.Future[T] | None,
    callback: Callable[[T | Exception], None] | None,
    outcome: T | Exception,
) -> None:
    """Give ``outcome`` to whoever waits for it: a future (unless already done: its caller
    gave up) or a callback. A callback that raises is logged, not propagated: it runs
    inside a read or a batch that other callers share."""
    if future is not None:
        if future.done():
            return
        if isinstance(outcome, Exception):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
        return
    if callback is None:
        return
    try:
        callback(outcome)
    except Exception:
        log.exception("a counter store callback failed")
