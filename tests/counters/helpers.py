"""Small helpers shared by the counter tests."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable


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
    return f"rl:{{{region}:{rule}:{uuid.uuid4().hex[:16]}}}:{window_s}s"


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
