"""The operator console's memory of the last minutes: rates per rule, the counter stores'
health, the identities limited most, in a ring of fixed time buckets.

The gateway already counts every decision in ``gateway_requests_total{region, rule,
identity, decision}`` (``gateway.metrics``). The console's sampler reads those totals
every ``SAMPLE_SECONDS`` from the registry the console is given, which is what
``/metrics`` serves: this process's own numbers, or with ``--workers N`` the supervisor's
``MultiProcessCollector`` over every worker's files, summed (the workers write them about
once a second). What grew since the previous sample is added to the bucket of the
sample's time (``BUCKET_SECONDS`` wide, the last ``BUCKETS`` kept), spread over the
buckets in between when samples were further apart; each bucket also keeps how many
seconds its samples covered, so a rate is counted / covered and a bucket nobody sampled
shows as "no data", not as zero.

The same tick reads the refusals the gateway keeps for the console (the last few hundred
per process, newest first), and tallies the ones it has not seen before per region and
identity, as logged (``<kind>:<12 hex>``, never a key). Another tick asks each region's
counter store whether it answers, every ``HEALTH_SECONDS``.

Everything is bounded: ``BUCKETS`` buckets, at most ``MAX_SERIES`` (region, rule) pairs
followed, ``MAX_REGIONS`` regions, ``MAX_IDENTITIES`` identities per region and bucket,
and the JSON ``snapshot`` gives one region, at most ``MAX_RULES_SHOWN`` rules and
``TOP_IDENTITIES`` identities.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client import CollectorRegistry

from gateway.identity.keys import Consumer
from gateway.identity.verified import counted_consumer
from gateway.policy.model import IdentityKind
from gateway.ratelimit.identity import IdentityHasher

log = logging.getLogger("gateway.console")

SAMPLE_SECONDS: Final = 2.0
HEALTH_SECONDS: Final = 5.0
HEALTH_TIMEOUT_SECONDS: Final = 10.0  # each store's own check gives up after 1 s
BUCKET_SECONDS: Final = 10.0
BUCKETS: Final = 60  # ten minutes of ten-second buckets
MAX_SERIES: Final = 1024  # (region, rule) pairs followed; rule ids come from the rule files
MAX_REGIONS: Final = 64
MAX_IDENTITIES: Final = 100  # per region and bucket; the rest counted as "others"
MAX_RULES_PER_IDENTITY: Final = 5
MAX_RULES_SHOWN: Final = 60  # charted per snapshot (a 30-rule table fits): filter for others
TOP_IDENTITIES: Final = 10
MAX_NAME_CHARS: Final = 128  # consumer and tier names (the key file allows 128)
NOW_BUCKETS: Final = 6  # "now" rates: over the last minute
CONSUMER_HASHES_PER_CALL: Final = 2000  # keeps one lookup from stalling the event loop
MAX_CONSUMERS: Final = 100_000

SERIES: Final = ("allowed", "limited", "shadow")
# gateway_requests_total's decision label -> the chart series it adds to. "allowed" is
# every request let through (counted, by the fallback counters, or exempt), "limited"
# every request refused (over a limit, or its store down and the rule failing closed).
SERIES_OF: Final = {
    "allowed": 0, "fallback": 0, "exempt": 0,
    "limited": 1, "unavailable": 1,
    "shadow_limited": 2,
}  # fmt: skip

HEALTH_UP: Final = "u"
HEALTH_DOWN: Final = "d"
HEALTH_PARTLY: Final = "p"  # some checks in the bucket failed, some answered
HEALTH_UNKNOWN: Final = "-"  # not checked in that bucket

Totals = dict[tuple[str, str, str], float]  # (region, rule, decision) -> total
# A refusal as the console reads it: (epoch s, region, rule, identity as logged) and,
# when the gateway knows them, the consumer and the tier (optional trailing items).
RefusalKey = tuple[float, str, str, str, str | None, str | None]


def request_totals(registry: CollectorRegistry) -> Totals:
    """``gateway_requests_total`` summed over identity kinds (and, with ``--workers``, the
    collector has already summed the workers)."""
    totals: Totals = {}
    for metric in registry.collect():
        if metric.name != "gateway_requests":
            continue
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            labels = sample.labels
            key = (labels.get("region", ""), labels.get("rule", ""), labels.get("decision", ""))
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


@dataclass(slots=True)
class Tally:
    """One identity's refusals in one bucket."""

    refusals: int = 0
    last: float = 0.0
    rules: dict[str, int] = field(default_factory=dict)  # rule -> refusals (a few rules)
    consumer: str | None = None
    tier: str | None = None


@dataclass(slots=True)
class Bucket:
    start: float  # epoch seconds, a multiple of the bucket width
    covered: float = 0.0  # seconds of this bucket the samples covered
    counts: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # sparse
    health: dict[str, list[int]] = field(default_factory=dict)  # region -> [up, down]
    refused: dict[str, dict[str, Tally]] = field(default_factory=dict)  # region -> id -> ...
    refused_other: dict[str, int] = field(default_factory=dict)  # region -> untallied


def _name(value: object) -> str | None:
    """An optional consumer or tier name as carried by a refusal: a short string or none."""
    if isinstance(value, str) and 0 < len(value) <= MAX_NAME_CHARS and value.isprintable():
        return value
    return None


def refusal_key(entry: Sequence[object]) -> RefusalKey | None:
    """A refusal (a tuple from the gateway, or a list read back from a worker's JSON) in
    one hashable shape; None when it is not one."""
    if len(entry) < 4:
        return None
    at, region, rule, identity = entry[0], entry[1], entry[2], entry[3]
    if not isinstance(at, int | float) or not isinstance(region, str):
        return None
    return (
        float(at), region, rule if isinstance(rule, str) else "-",
        identity if isinstance(identity, str) else "-",
        _name(entry[4]) if len(entry) > 4 else None,
        _name(entry[5]) if len(entry) > 5 else None,
    )  # fmt: skip


class ConsoleHistory:
    """The ring of buckets; fed by the sampler, read by the console's JSON."""

    def __init__(self, bucket_seconds: float = BUCKET_SECONDS, buckets: int = BUCKETS) -> None:
        self.bucket_seconds = bucket_seconds
        self.size = buckets
        self.buckets: deque[Bucket] = deque(maxlen=buckets)  # oldest first
        self._totals: Totals | None = None
        self.sampled_at: float | None = None  # the latest sample of the totals (epoch s)
        self._series: set[tuple[str, str]] = set()
        self._regions: list[str] = []  # every region with counts or checks, first seen first
        self.served: list[str] = []  # the regions of the latest health check, default first
        self.dropped_series = 0  # (region, rule) pairs with counts the last sample left out
        self._seen: Counter[RefusalKey] = Counter()  # the refusals list as last read

    # --- writing ---------------------------------------------------------------------

    def _start(self, at: float) -> float:
        return math.floor(at / self.bucket_seconds) * self.bucket_seconds

    def _bucket(self, at: float, create: bool) -> Bucket | None:
        """The bucket holding time ``at``. ``create``: made when newer than the newest,
        and the newest for an older time it does not hold (the wall clock went back);
        else None for a time older than the ring or in a gap nobody sampled."""
        start = self._start(at)
        buckets = self.buckets
        if not buckets or start > buckets[-1].start:
            if not create:
                return None
            bucket = Bucket(start)
            buckets.append(bucket)  # the deque's maxlen drops the oldest
            return bucket
        for bucket in reversed(buckets):
            if bucket.start == start:
                return bucket
            if bucket.start < start:
                break
        return buckets[-1] if create else None

    def _follow(self, region: str, rule: str) -> bool:
        pair = (region, rule)
        if pair in self._series:
            return True
        if len(self._series) >= MAX_SERIES or not self._region(region):
            return False
        self._series.add(pair)
        return True

    def _region(self, region: str) -> bool:
        if region in self._regions:
            return True
        if len(self._regions) >= MAX_REGIONS:
            return False
        self._regions.append(region)
        return True

    def record_totals(self, totals: Totals, now: float) -> None:
        """Add what grew since the previous sample, spread evenly over the time between
        the two samples (the first sample only sets the baseline)."""
        previous, self._totals = self._totals, dict(totals)
        since, self.sampled_at = self.sampled_at, now
        if previous is None or since is None or now <= since:
            self._bucket(now, create=True)
            return
        grown: dict[tuple[str, str], list[float]] = {}
        dropped: set[tuple[str, str]] = set()
        for (region, rule, decision), value in totals.items():
            series = SERIES_OF.get(decision)
            if series is None:
                continue
            delta = value - previous.get((region, rule, decision), 0.0)
            if delta <= 0:  # unchanged, or a counter that restarted: nothing to add
                continue
            if not self._follow(region, rule):
                dropped.add((region, rule))
                continue
            grown.setdefault((region, rule), [0.0, 0.0, 0.0])[series] += delta
        self.dropped_series = len(dropped)
        # Older than the ring: only the part inside it is kept (at the same rate).
        span = now - since
        begin = max(since, now - self.bucket_seconds * self.size)
        at = begin
        while at < now:
            end = min(now, self._start(at) + self.bucket_seconds)
            bucket = self._bucket(at, create=True)
            if end <= at or bucket is None:
                break
            share = (end - at) / span
            bucket.covered += end - at
            for pair, deltas in grown.items():
                counts = bucket.counts.get(pair)
                if counts is None:
                    counts = bucket.counts[pair] = [0.0, 0.0, 0.0]
                for i in range(3):
                    counts[i] += deltas[i] * share
            at = end
        self._bucket(now, create=True)  # the refusals read next may fall in it

    def record_refusals(self, entries: Iterable[Sequence[object]], now: float) -> None:
        """Tally the refusals not in the previous read (the list is the gateway's bounded
        memory of its latest refusals, so one missing from it was evicted, not repeated)."""
        current: Counter[RefusalKey] = Counter()
        for entry in entries:
            key = refusal_key(entry)
            if key is not None:
                current[key] += 1
        new, self._seen = current - self._seen, current
        window_start = self._start(now) - (self.size - 1) * self.bucket_seconds
        for key, times in new.items():
            at, region, rule, identity, consumer, tier = key
            bucket = self._bucket(min(at, now), create=False)
            if bucket is None and self.buckets and window_start <= at < self.buckets[0].start:
                # From before the history began (the first read): kept with the oldest
                # bucket, so it leaves the top list a little late rather than never shows.
                bucket = self.buckets[0]
            if bucket is None or not self._region(region):
                continue  # older than the window
            tallies = bucket.refused.setdefault(region, {})
            tally = tallies.get(identity)
            if tally is None:
                if len(tallies) >= MAX_IDENTITIES:
                    bucket.refused_other[region] = bucket.refused_other.get(region, 0) + times
                    continue
                tally = tallies[identity] = Tally()
            tally.refusals += times
            tally.last = max(tally.last, at)
            if rule in tally.rules or len(tally.rules) < MAX_RULES_PER_IDENTITY:
                tally.rules[rule] = tally.rules.get(rule, 0) + times
            tally.consumer = tally.consumer or consumer
            tally.tier = tally.tier or tier

    def record_health(self, regions: Iterable[Mapping[str, object]], now: float) -> None:
        """One check of each region's counter store (``{"name", "healthy"}`` items)."""
        bucket = self._bucket(now, create=True)
        assert bucket is not None
        served = []
        for region in regions:
            name = str(region.get("name", ""))
            if not name or not self._region(name):
                continue
            served.append(name)
            checks = bucket.health.setdefault(name, [0, 0])
            checks[0 if region.get("healthy") else 1] += 1
        self.served = served

    # --- reading ---------------------------------------------------------------------

    def snapshot(
        self,
        region: str,
        rules: Sequence[str],
        rule_filter: str = "",
        now: float | None = None,
        consumer_of: Callable[[str], Consumer | None] | None = None,
    ) -> dict[str, Any]:
        """What the console draws for ``region``: per rule the allowed / limited /
        shadow-limited rate (per second) of each bucket, oldest first (a series that is
        all zero left out; ``covered`` says which buckets were sampled at all), every
        region's store health per bucket, and the identities limited most.

        ``rules``: the rule ids in table order; rules with counts there but not in it (a
        rule a reload removed, ``-`` for requests no rule matched) follow them."""
        now = time.time() if now is None else now
        width, size = self.bucket_seconds, self.size
        first = self._start(now) - (size - 1) * width
        by_start = {b.start: b for b in self.buckets if b.start >= first}
        slots = [by_start.get(first + i * width) for i in range(size)]
        covered = [0.0 if b is None else b.covered for b in slots]

        wanted = rule_filter.casefold()
        ordered = list(dict.fromkeys(rules))
        known = set(ordered)
        ordered += sorted({r for g, r in self._series if g == region and r not in known})
        matching = [r for r in ordered if wanted in r.casefold()]
        shown = [self._rule_rates(region, rule, slots, covered) for rule in matching]

        return {
            "region": region,
            "bucket_s": width,
            "start": first,
            "now": now,
            "sampled_at": self.sampled_at,
            "covered": [round(c, 1) for c in covered],
            "rules": shown[:MAX_RULES_SHOWN],
            "rules_matching": len(matching),
            "rules_omitted": max(0, len(shown) - MAX_RULES_SHOWN),
            "health": [
                {"region": name, "states": "".join(_health_state(b, name) for b in slots)}
                for name in self._regions
                if any(b is not None and name in b.health for b in self.buckets)
            ],
            **self._top_limited(region, slots, consumer_of),
            "dropped_series": self.dropped_series,
        }

    def _rule_rates(
        self, region: str, rule: str, slots: list[Bucket | None], covered: list[float]
    ) -> dict[str, Any]:
        counts = [None if b is None else b.counts.get((region, rule)) for b in slots]
        totals = [sum(c[i] for c in counts if c is not None) for i in range(3)]
        row: dict[str, Any] = {"rule": rule}
        if not any(totals):
            row["idle"] = True  # no arrays of zeros: keeps the JSON of a quiet table short
            return row
        for i, name in enumerate(SERIES):
            if totals[i]:  # a series absent is all zero (most rules never shadow-limit)
                row[name] = [
                    0 if c is None or seconds <= 0 else _rate(c[i] / seconds)
                    for c, seconds in zip(counts, covered, strict=True)
                ]
        recent = list(zip(counts, covered, strict=True))[-NOW_BUCKETS:]
        seconds = sum(s for _, s in recent)
        row["now"] = {
            name: 0.0 if seconds <= 0 else
            round(sum(0.0 if c is None else c[i] for c, _ in recent) / seconds, 2)
            for i, name in enumerate(SERIES)
        }  # fmt: skip
        row["total"] = {name: round(totals[i]) for i, name in enumerate(SERIES)}
        return row

    def _top_limited(
        self,
        region: str,
        slots: list[Bucket | None],
        consumer_of: Callable[[str], Consumer | None] | None,
    ) -> dict[str, Any]:
        merged: dict[str, Tally] = {}
        others = 0
        for bucket in slots:
            if bucket is None:
                continue
            others += bucket.refused_other.get(region, 0)
            for identity, tally in bucket.refused.get(region, {}).items():
                into = merged.get(identity)
                if into is None:
                    into = merged[identity] = Tally()
                into.refusals += tally.refusals
                into.last = max(into.last, tally.last)
                for rule, times in tally.rules.items():
                    if rule in into.rules or len(into.rules) < MAX_RULES_PER_IDENTITY:
                        into.rules[rule] = into.rules.get(rule, 0) + times
                into.consumer = tally.consumer or into.consumer
                into.tier = tally.tier or into.tier
        ranked = sorted(merged.items(), key=lambda item: (-item[1].refusals, -item[1].last))
        top = []
        for identity, tally in ranked[:TOP_IDENTITIES]:
            consumer, tier = tally.consumer, tally.tier
            if consumer is None and consumer_of is not None:
                known = consumer_of(identity)
                if known is not None:
                    consumer, tier = known.name, tier or known.tier
            top.append({
                "identity": identity,
                "kind": identity.partition(":")[0] if ":" in identity else None,
                "consumer": consumer,
                "tier": tier,
                "refusals": tally.refusals,
                "rules": sorted(tally.rules, key=lambda r: (-tally.rules[r], r)),  # most first
                "last": tally.last,
            })  # fmt: skip
        others += sum(t.refusals for _, t in ranked[TOP_IDENTITIES:])
        return {"top_limited": top, "top_limited_others": others}


def _rate(value: float) -> float | int:
    """Three significant digits (at most two decimals): all a 34-pixel bar can show, and
    the snapshot's largest part is these numbers."""
    if value <= 0:
        return 0
    digits = max(0, min(2, 2 - math.floor(math.log10(value))))
    return round(value, digits) if digits else round(value)


def _health_state(bucket: Bucket | None, region: str) -> str:
    checks = None if bucket is None else bucket.health.get(region)
    if not checks:
        return HEALTH_UNKNOWN
    up, down = checks
    if down == 0:
        return HEALTH_UP
    return HEALTH_DOWN if up == 0 else HEALTH_PARTLY


class ConsumerNames:
    """Finds the consumer behind a logged ``api_key:<12 hex>`` identity.

    A known key is counted as its consumer (``counted_consumer``), so every key of one
    consumer is logged as the keyed hash of that one value: hashing the key file's
    consumer names, never a key, finds it. Hashes are kept per name across key file
    reloads and made at most ``CONSUMER_HASHES_PER_CALL`` per call (a key file of many
    thousand consumers is not hashed in one go on the event loop)."""

    def __init__(self, hasher: IdentityHasher) -> None:
        self._hasher = hasher
        self._source: Mapping[str, Consumer] | None = None
        self._hashed: dict[str, str] = {}  # consumer name -> logged identity
        self._by_identity: dict[str, Consumer] = {}
        self._pending: list[str] = []

    def update(self, consumers: Mapping[str, Consumer]) -> None:
        if consumers is not self._source:
            self._source = consumers
            self._hashed = {n: h for n, h in self._hashed.items() if n in consumers}
            self._pending = [n for n in consumers if n not in self._hashed]
            self._by_identity = {h: consumers[n] for n, h in self._hashed.items()}
        if not self._pending:
            return
        batch, self._pending = (
            self._pending[:CONSUMER_HASHES_PER_CALL], self._pending[CONSUMER_HASHES_PER_CALL:]
        )  # fmt: skip
        for name in batch:
            if len(self._hashed) >= MAX_CONSUMERS:
                self._pending = []
                break
            consumer = consumers[name]
            digest = self._hasher.digest(IdentityKind.API_KEY, counted_consumer(consumer))
            logged = f"{IdentityKind.API_KEY.value}:{digest[:12]}"
            self._hashed[name] = logged
            self._by_identity[logged] = consumer

    def lookup(self, identity: str) -> Consumer | None:
        return self._by_identity.get(identity)


# --- the sampler -----------------------------------------------------------------------------


async def sample_forever(
    history: ConsoleHistory,
    registry: CollectorRegistry,
    recent: Callable[[], Sequence[Sequence[object]]],
    also: Callable[[Totals], None] | None = None,
    interval: float = SAMPLE_SECONDS,
) -> None:
    """Every ``interval``: the request totals and the latest refusals into ``history``
    (and the totals to ``also``, the console's older per-minute rates)."""
    while True:
        # A failed collection or a worker file half written must not stop the sampling.
        try:
            totals = request_totals(registry)
            now = time.time()
            history.record_totals(totals, now)
            if also is not None:
                also(totals)
            history.record_refusals(recent(), now)
        except Exception:
            log.debug("console sample failed", exc_info=True)
        await asyncio.sleep(interval)


async def check_health_forever(
    history: ConsoleHistory,
    regions: Callable[[], Awaitable[list[dict[str, object]]]],
    interval: float = HEALTH_SECONDS,
) -> None:
    """Every ``interval``: whether each region's counter store answers."""
    while True:
        with suppress(Exception):  # no answer at all: the bucket stays "not checked"
            found = await asyncio.wait_for(regions(), HEALTH_TIMEOUT_SECONDS)
            history.record_health(found, time.time())
        await asyncio.sleep(interval)
