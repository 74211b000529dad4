"""The event loop's time for parsing request bodies, shared out per client address and in all.

Parsing a JSON body and checking its values run on the event loop that every other client
of the process shares (the built-in upstreams share it with the proxy port too): a 200 KB
body of nested arrays holds the loop ~0.1-0.3 s, and one address sending such bodies back
to back held it most of the time (every other client waited: SECURITY.md, "Limits and
timeouts"). So each body's parse is timed (CPU) and charged to its client address, and a
body whose address (or, for a body that is not small, the process over all addresses) has
used up its share is refused before it is read or parsed, with the time after which it
would be taken.

Token buckets of loop seconds: an address's fills at ``per_address`` seconds a second (its
share of the loop on average) up to ``burst_seconds``; all addresses together have one
that fills at ``total`` seconds a second up to ``total_burst``. Every parse is charged, to
both; a body is taken while its address is not in debt and, unless it is small, the total
is not either (into debt: a body's cost is known only once it is parsed). Small bodies
(``SMALL_BODY`` bytes at most: a few milliseconds at worst) are exempt from the total's
refusal, so that addresses spending their shares together cannot shut out every other
client's ordinary writes; an address's own share still counts them.

No aiohttp here: the clock is injected, so the arithmetic is tested without sleeping.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# A body of at most this many bytes is not refused for the total's debt (its own address's
# still refuses it): parsing it costs a few milliseconds at worst.
SMALL_BODY = 16 * 1024


@dataclass(frozen=True)
class ParseShare:
    """How much of the event loop's time bodies may take to parse."""

    per_address: float = 0.1  # of the loop, on average, for one client address's bodies
    total: float = 0.5  # of the loop, on average, for all of them
    burst_seconds: float = 0.25  # an idle address may take this much at once
    # ... and all of them together (None: as long to fill as an address's, 1.25 s)
    total_burst_seconds: float | None = None
    max_addresses: int = 4096  # addresses whose buckets are not full, kept at most

    def __post_init__(self) -> None:
        if not 0 < self.per_address <= self.total <= 1:
            raise ValueError(
                "body parse shares must satisfy 0 < per_address <= total <= 1, "
                f"not per_address={self.per_address}, total={self.total}"
            )
        for name, value in (
            ("burst_seconds", self.burst_seconds),
            ("total_burst_seconds", self.total_burst),
        ):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be > 0, not {value}")
        if self.max_addresses < 1:
            raise ValueError(f"max_addresses must be >= 1, not {self.max_addresses}")

    @property
    def total_burst(self) -> float:
        if self.total_burst_seconds is not None:
            return self.total_burst_seconds
        return self.burst_seconds * self.total / self.per_address


@dataclass(frozen=True)
class ParseRefusal:
    """Why a body is not parsed now: 429 (its address's share is used up) or 503 (all
    addresses' together), and the whole seconds after which it would be taken."""

    status: int
    retry_after: int
    detail: str


class _Bucket:
    __slots__ = ("at", "level")

    def __init__(self, level: float, at: float) -> None:
        self.level = level
        self.at = at


class ParseBudget:
    """Loop seconds for parsing bodies, by client address (see the module's docstring)."""

    def __init__(
        self, share: ParseShare | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.share = ParseShare() if share is None else share
        self._clock = clock
        # Only addresses in the middle of refilling: a full bucket is no entry. Oldest
        # first, so the one evicted past max_addresses is the one that touched it least
        # recently (evicted, it starts full again; the total bucket still holds).
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self._total = _Bucket(self.share.total_burst, clock())
        # What operators read off /metrics (http_api/parse_metrics.py): bodies refused, by
        # status (429: the address's share; 503: the total), loop seconds charged, and
        # how often an address went past its share.
        self.refused: dict[int, int] = {429: 0, 503: 0}
        self.charged_seconds = 0.0
        self.debts = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def refusal(self, address: str, size: int | None = None) -> ParseRefusal | None:
        """None when a body of ``address`` may be parsed now; else why not, and when.
        ``size``: the body's bytes when known (a small one is not refused for the total)."""
        now = self._clock()
        share = self.share
        total = self._refill(self._total, now, share.total, share.total_burst)
        if size is not None and size <= SMALL_BODY:
            total = 0.0
        bucket = self._buckets.get(address)
        own = share.burst_seconds
        if bucket is not None:
            own = self._refill(bucket, now, share.per_address, share.burst_seconds)
            if own >= share.burst_seconds:
                del self._buckets[address]
            else:
                self._buckets.move_to_end(address)  # a retrying address is kept longest
        if own >= 0 and total >= 0:
            return None
        status = 429 if own < 0 else 503
        self.refused[status] += 1
        # When both are in debt, the later of the two: retrying sooner would only be refused
        # again by the other.
        wait = max(-own / share.per_address, -total / share.total)
        if status == 429:
            return ParseRefusal(
                429,
                _whole_seconds(wait),
                "this client address has used its share of the server's time for parsing "
                "request bodies (large or deeply nested JSON costs the most); retry after "
                "the time Retry-After gives",
            )
        return ParseRefusal(
            503,
            _whole_seconds(wait),
            "the server is busy parsing other clients' request bodies; retry after the "
            "time Retry-After gives",
        )

    def charge(self, address: str, seconds: float) -> bool:
        """``address``'s body took ``seconds`` of the loop to parse. True when this put the
        address in debt (its next bodies are refused for a while: worth a log line)."""
        if not seconds > 0:  # (NaN too: nothing measured, nothing charged)
            return False
        now = self._clock()
        share = self.share
        self.charged_seconds += seconds
        self._refill(self._total, now, share.total, share.total_burst)
        self._total.level -= seconds
        bucket = self._buckets.get(address)
        if bucket is None:
            bucket = self._buckets[address] = _Bucket(share.burst_seconds, now)
        else:
            self._refill(bucket, now, share.per_address, share.burst_seconds)
            self._buckets.move_to_end(address)
        was = bucket.level
        bucket.level -= seconds
        while len(self._buckets) > share.max_addresses:
            self._buckets.popitem(last=False)
        into_debt = was >= 0 > bucket.level
        if into_debt:
            self.debts += 1
        return into_debt

    @staticmethod
    def _refill(bucket: _Bucket, now: float, rate: float, burst: float) -> float:
        elapsed = now - bucket.at
        if elapsed > 0:
            bucket.level = min(burst, bucket.level + elapsed * rate)
        bucket.at = max(bucket.at, now)
        return bucket.level


def _whole_seconds(seconds: float) -> int:
    """Retry-After's whole seconds: at least 1, never earlier than the bucket allows."""
    return max(1, math.ceil(seconds))
