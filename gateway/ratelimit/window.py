"""Sub-bucket sliding-window arithmetic shared by every counter backend.

A window of ``window_ms`` is split into buckets of ``bucket_ms``. At time ``now`` the
count is the sum of every bucket from ``floor((now - window) / bucket)`` to
``floor(now / bucket)``: the oldest bucket may lie only partly inside the trailing
window and is counted whole, so the count can only over-estimate what really
happened in the window. That is why the limiter never over-admits, and why it may
under-admit by at most one bucket's share. The Lua script in
``gateway/counters/lua/sliding_window.lua`` implements the very same arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

MIN_BUCKET_MS: Final = 100
TARGET_BUCKETS: Final = 60


def bucket_ms_for(window_ms: int) -> int:
    """Bucket width for a window: about 60 buckets, never narrower than 100 ms."""
    return max(-(-window_ms // TARGET_BUCKETS), MIN_BUCKET_MS)


def current_bucket(now_ms: int, bucket_ms: int) -> int:
    return now_ms // bucket_ms


def oldest_counted_bucket(now_ms: int, window_ms: int, bucket_ms: int) -> int:
    return (now_ms - window_ms) // bucket_ms


def bucket_leaves_at(bucket: int, window_ms: int, bucket_ms: int) -> int:
    """The first instant (ms) at which ``bucket`` is no longer counted."""
    return (bucket + 1) * bucket_ms + window_ms


def ms_until_room(
    buckets: Iterable[tuple[int, int]],
    total: int,
    limit: int,
    now_ms: int,
    window_ms: int,
    bucket_ms: int,
) -> int:
    """Milliseconds until the window's count allows one more request than now.

    ``buckets`` are the counted ``(bucket, count)`` pairs, oldest first, and
    ``total`` their sum. When the limit still has room this is the time until the
    remaining count next grows; when it is full it is the time until one request
    fits again. 0 when nothing is counted.
    """
    need = max(1, total - limit + 1)
    freed = 0
    for bucket, count in buckets:
        if count <= 0:
            continue
        freed += count
        if freed >= need:
            return max(0, bucket_leaves_at(bucket, window_ms, bucket_ms) - now_ms)
    return 0
