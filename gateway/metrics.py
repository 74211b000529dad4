"""Prometheus metrics in the gateway's own registry (one per app, so tests can run many).

The request path only adds to plain numbers on small objects of ours; one collector turns
them into Prometheus metric families when ``/metrics`` is scraped. prometheus-client's own
Counter/Gauge/Histogram take a lock on every increment, which costs more than the
increment itself. Our numbers are touched only from the event loop's thread (the data
plane, the rule reloader, the breaker and the scrape all run there), so they need none.

Labels never carry raw API keys or user ids: identities appear only as their kind
(``ip``, ``api_key``, ``user_ip``). Label values come from configuration (regions, rule
ids, upstream names) or from fixed words in the code, so the children per metric are
bounded.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import accumulate
from typing import Any, Final, Generic, Protocol, TypeVar, cast

from prometheus_client import CollectorRegistry, mmap_dict, multiprocess
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger("gateway.counters")

LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

BREAKER_STATES: Final = {"closed": 0, "open": 1, "half_open": 2}

_go_float: Callable[[float], str] = floatToGoString  # untyped upstream
# prometheus-client's multiprocess pieces, untyped upstream too
_MmapedDict: Callable[[str], Any] = mmap_dict.MmapedDict
_mmap_key: Callable[..., str] = mmap_dict.mmap_key
_MultiProcessCollector: Callable[..., Any] = multiprocess.MultiProcessCollector
_mark_process_dead: Callable[[int, str], None] = multiprocess.mark_process_dead


# --- what the request path touches -----------------------------------------------------------


class CounterChild:
    """One labelled series of a counter."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0.0

    def inc(self, amount: float = 1) -> None:
        if amount < 0:  # a counter that goes down breaks rate() in every query
            raise ValueError("counters can only be incremented by non-negative amounts")
        self.value += amount


class GaugeChild:
    """One labelled series of a gauge (or an unlabelled gauge itself)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class HistogramChild:
    """One labelled series of a histogram: a count per bucket (not cumulative; the last
    one is ``+Inf``) and the sum. Cumulated only at scrape time."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        # Buckets are "less than or equal": the first bound >= amount is the bucket (as
        # bisect_left finds it; NaN the first). A scan of native floats: compiled, a few
        # comparisons for the latencies a request has, where calling bisect_left cost
        # about a thousand instructions an observation (two a request).
        bounds = self.bounds
        index = 0
        count = len(bounds)
        while index < count and bounds[index] < amount:
            index += 1
        self.counts[index] += 1
        self.sum += amount


# --- families: name, help, label names, and their export --------------------------------------

ChildT = TypeVar("ChildT", CounterChild, GaugeChild, HistogramChild)


class Family(Protocol):
    """A metric as Prometheus sees it: a name, a help text, label names, a type. (A
    protocol, not a base class: ScalarGauge is a gauge child too, and compiled classes
    take one base.)"""

    kind: str  # counter, gauge, histogram
    name: str
    documentation: str
    labelnames: tuple[str, ...]

    def export(self) -> Metric:
        """The metric family with every current sample (called at scrape time)."""

    def describe(self) -> Metric:
        """The metric family without samples (for the registry's name checks)."""


class LabelledFamily(Generic[ChildT]):
    """A metric with label names; ``labels(*values)`` gives (and keeps) one child per set of
    values."""

    __slots__ = ("children", "documentation", "labelnames", "name")

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.children: dict[tuple[str, ...], ChildT] = {}
        if not self.labelnames:
            self.labels()  # exported (as 0) from the start, as prometheus-client does

    def labels(self, *values: str) -> ChildT:
        found = self.children.get(values)
        if found is None:
            if len(values) != len(self.labelnames):
                raise ValueError(
                    f"{self.name} takes labels {self.labelnames}, got {len(values)} values"
                )
            found = self.children[values] = self._new_child()
        return found

    def _new_child(self) -> ChildT:
        raise NotImplementedError


class Counter(LabelledFamily[CounterChild]):
    kind = "counter"
    __slots__ = ()

    def _new_child(self) -> CounterChild:
        return CounterChild()

    def describe(self) -> Metric:
        return CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def export(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, float(child.value))
        return family


class Gauge(LabelledFamily[GaugeChild]):
    kind = "gauge"
    __slots__ = ("mode",)

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], mode: str = "liveall"
    ) -> None:
        # How ``--workers`` combines the workers' values (prometheus-client's multiprocess
        # modes): "liveall" one series per live worker (a ``pid`` label), "livesum" summed
        # over live workers, "max" the largest any worker wrote.
        self.mode = mode
        super().__init__(name, documentation, labelnames)

    def _new_child(self) -> GaugeChild:
        return GaugeChild()

    def describe(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def export(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(values, float(child.value))
        return family


class Histogram(LabelledFamily[HistogramChild]):
    kind = "histogram"
    __slots__ = ("_le", "bounds")

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        bounds = tuple(float(b) for b in buckets)
        if bounds and bounds[-1] == float("inf"):
            bounds = bounds[:-1]  # +Inf is always there
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be increasing and not empty")
        self.bounds = bounds
        # The ``le`` values exactly as prometheus-client spells them ("0.0001", "1.0", "+Inf").
        self._le = (*(_go_float(b) for b in bounds), "+Inf")
        super().__init__(name, documentation, labelnames)

    def _new_child(self) -> HistogramChild:
        return HistogramChild(self.bounds)

    def describe(self) -> Metric:
        return HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def export(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            cumulative = [float(n) for n in accumulate(child.counts)]
            family.add_metric(values, list(zip(self._le, cumulative, strict=True)), child.sum)
        return family


class ScalarGauge(GaugeChild):
    """A gauge without labels: the metric is its own (only) series, so ``inc``/``set`` on it
    cost no lookup at all."""

    kind = "gauge"
    __slots__ = ("documentation", "mode", "name")
    labelnames: tuple[str, ...] = ()

    def __init__(self, name: str, documentation: str, mode: str = "liveall") -> None:
        super().__init__()
        self.name = name
        self.documentation = documentation
        self.mode = mode  # as ``Gauge.mode``

    def describe(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, labels=())

    def export(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, value=float(self.value))


class FamilyCollector:
    """Exports a fixed list of families, in order, whenever the registry is collected.

    A ``Collector`` by shape, not by subclassing: this module is compiled (mypyc), and a
    compiled class cannot take prometheus-client's class as its base."""

    def __init__(self, families: Iterable[Family]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.export()

    def describe(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.describe()


# --- the gateway's metrics ---------------------------------------------------------------------


class Metrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self.requests = Counter(
            "gateway_requests",
            "Requests seen by the gateway, by rate-limit decision.",
            ["region", "rule", "identity", "decision"],
        )
        self.near_limit = Counter(
            "gateway_near_limit",
            "Admitted requests that left less than 20% of a limit.",
            ["region", "rule"],
        )
        self.overhead = Histogram(
            "gateway_overhead_seconds",
            "Time the gateway spent before forwarding (identity, rules, counters).",
            ["region"],
            buckets=LATENCY_BUCKETS,
        )
        self.upstream_latency = Histogram(
            "gateway_upstream_seconds",
            "Time from forwarding a request to receiving the upstream's response headers.",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Requests the upstream could not answer (unreachable, timeout, broken stream, "
            "body_too_large), or that would have held too many of its connections "
            "(uploads_per_client, uploads_total).",
            ["upstream", "kind"],
        )
        self.responses = Counter(
            "gateway_responses",
            "Responses sent, by status class.",
            ["region", "status_class"],
        )
        self.counter_errors = Counter(
            "gateway_counter_store_errors",
            "Failed calls to the shared counter store.",
            ["region", "kind"],
        )
        self.breaker_state = Gauge(
            "gateway_counter_breaker_state",
            "Circuit breaker in front of the counter store: 0 closed, 1 open, 2 half-open.",
            ["region"],
        )
        self.breaker_transitions = Counter(
            "gateway_counter_breaker_transitions",
            "Changes of the counter-store circuit breaker, by the state entered.",
            ["region", "state"],
        )
        self.fallback_decisions = Counter(
            "gateway_fallback_decisions",
            "Decisions taken by the local fallback counters while the store was unavailable.",
            ["region"],
        )
        self.deny_cache_hits = Counter(
            "gateway_deny_cache_hits",
            "Requests refused from the local deny cache without asking the counter store.",
            ["region"],
        )
        self.token_failures = Counter(
            "gateway_token_failures",
            "Bearer tokens that did not verify, by reason (signature, expired, issuer ...).",
            ["reason"],
        )
        self.tunnels_opened = Counter(
            "gateway_tunnels_opened",
            "Upgraded connections (WebSocket ...) joined after the upstream's 101.",
            [],
        )
        self.tunnels_closed = Counter(
            "gateway_tunnels_closed",
            "Upgraded connections that ended, by reason (closed, idle, max_bytes, "
            "max_seconds, stopping).",
            ["reason"],
        )
        self.consumer_requests = Counter(
            "gateway_consumer_requests",
            "Decisions on requests of a verified identity, by consumer (a known key's, '-' "
            "for a token's user) and tier ('-': none); never a key or a token.",
            ["region", "consumer", "tier", "decision"],
        )
        self.identity_refusals = Counter(
            "gateway_identity_refusals",
            "Requests answered 401: an unknown API key (unknown_key) or a token that did "
            "not verify (its reason), with identity.*: reject.",
            ["reason"],
        )
        self.rule_reloads = Counter(
            "gateway_rule_reloads",
            "Rule table (re)loads, by outcome (ok, error, unchanged).",
            ["outcome"],
        )
        self.rules_loaded = ScalarGauge(
            "gateway_rules_loaded_timestamp_seconds",
            "When the running rule table was loaded.",
            mode="max",
        )
        self.rules_count = ScalarGauge("gateway_rules", "Rules in the running table.")
        self.inflight = ScalarGauge(
            "gateway_inflight_requests", "Requests being handled right now.", mode="livesum"
        )
        # Labelled, so a gateway without TLS exports no series (an unlabelled expiry
        # gauge would read 0, "expired in 1970", and fire every expiry alert).
        self.tls_reloads = Counter(
            "gateway_tls_reloads",
            "TLS certificate reloads (the files changed, or SIGHUP), by listener (proxy, "
            "admin) and outcome: ok (a new pair in force), unchanged, refused (the pair "
            "in force kept).",
            ["listener", "outcome"],
        )
        # With --workers: the earliest any live worker serves (one that refused a
        # rotation still serves the old certificate, and that is the one to alert on).
        self.tls_expiry = Gauge(
            "gateway_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate in force expires (its notAfter, Unix time), by "
            "listener (proxy, admin).",
            ["listener"],
            mode="livemin",
        )
        # Export order = definition order above (what prometheus-client did too).
        self.families: tuple[Family, ...] = (
            self.requests, self.near_limit, self.overhead, self.upstream_latency,
            self.upstream_errors, self.responses, self.counter_errors, self.breaker_state,
            self.breaker_transitions, self.fallback_decisions, self.deny_cache_hits,
            self.token_failures, self.tunnels_opened, self.tunnels_closed,
            self.consumer_requests, self.identity_refusals,
            self.rule_reloads, self.rules_loaded, self.rules_count, self.inflight,
            self.tls_reloads, self.tls_expiry,
        )  # fmt: skip
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(cast(Collector, FamilyCollector(self.families)))

    def child(self, metric: LabelledFamily[ChildT], *labels: str) -> ChildT:
        """``metric.labels(*labels)``: one dict lookup once the child exists. Kept so the
        request path can name the metric and its labels in one call."""
        found = metric.children.get(labels)
        return found if found is not None else metric.labels(*labels)

    def counter_events(self, region: str) -> RegionCounterEvents:
        return RegionCounterEvents(self, region)


class RegionCounterEvents:
    """``CounterEvents`` for one region: metrics plus a log line on every breaker change."""

    def __init__(self, metrics: Metrics, region: str) -> None:
        self._m = metrics
        self._region = region
        metrics.breaker_state.labels(region).set(0)

    def store_error(self, kind: str) -> None:
        self._m.counter_errors.labels(self._region, kind).inc()

    def breaker_changed(self, state: str) -> None:
        self._m.breaker_state.labels(self._region).set(BREAKER_STATES.get(state, 1))
        self._m.breaker_transitions.labels(self._region, state).inc()
        # DEBUG only: during an outage the breaker probes every second (half_open, then
        # open again), and a line per move was two lines a second per process. The
        # outage itself is logged by ResilientBackend: when it begins, once a minute
        # while it lasts, and when it ends (gateway/counters/resilient.py).
        log.debug("counter store for region %s: circuit breaker %s", self._region, state)

    def fallback_used(self) -> None:
        self._m.fallback_decisions.labels(self._region).inc()

    def deny_cache_hit(self) -> None:
        self._m.deny_cache_hits.labels(self._region).inc()


# --- --workers N: one scrape for every worker ---------------------------------------------------
#
# Each worker writes its numbers into prometheus-client's multiprocess files (one mmap file
# per process and metric type, keys in prometheus-client's own format) about once a second
# and when it stops; the admin port, served by the supervising process, collects the
# directory with prometheus-client's ``MultiProcessCollector``, which sums counters,
# merges histograms and combines gauges by their mode. The request path is untouched: it
# still only adds to plain numbers. A dead worker's counter and histogram files stay (its
# counts are not lost; its replacement writes files of its own, so nothing is counted
# twice); its "live" gauges are dropped (``worker_gone``).

SYNC_INTERVAL_SECONDS: Final = 1.0


class SharedMetricsWriter:
    """Writes one process's ``Metrics`` into a multiprocess directory."""

    def __init__(self, metrics: Metrics, directory: str, pid: int | None = None) -> None:
        self._metrics = metrics
        self._directory = directory
        self._pid = os.getpid() if pid is None else pid
        self._files: dict[str, Any] = {}  # file name -> MmapedDict
        self._keys: dict[tuple[str, str, tuple[str, ...], str], str] = {}
        self._written: dict[str, float] = {}

    def _file(self, family: Family) -> Any:
        if family.kind == "gauge":
            name = f"gauge_{getattr(family, 'mode', 'liveall')}_{self._pid}.db"
        else:
            name = f"{family.kind}_{self._pid}.db"
        found = self._files.get(name)
        if found is None:
            found = self._files[name] = _MmapedDict(os.path.join(self._directory, name))
        return found

    def _key(self, family: Family, sample: str, labels: tuple[str, ...], le: str = "") -> str:
        cache_key = (family.name, sample, labels, le)
        found = self._keys.get(cache_key)
        if found is None:
            names = list(family.labelnames)
            values = list(labels)
            if le:
                names.append("le")
                values.append(le)
            found = _mmap_key(family.name, sample, names, values, family.documentation)
            self._keys[cache_key] = found
        return found

    def _put(self, file: Any, key: str, value: float) -> None:
        if self._written.get(key) != value:
            file.write_value(key, value, 0.0)
            self._written[key] = value

    def write(self) -> None:
        """Write every value that changed since the last call."""
        for family in self._metrics.families:
            file = self._file(family)
            if isinstance(family, Histogram):
                les = family._le
                for labels, child in list(family.children.items()):
                    for le, count in zip(les, child.counts, strict=True):
                        key = self._key(family, family.name + "_bucket", labels, le)
                        self._put(file, key, float(count))
                    self._put(file, self._key(family, family.name + "_sum", labels), child.sum)
            elif isinstance(family, ScalarGauge):
                self._put(file, self._key(family, family.name, ()), float(family.value))
            elif isinstance(family, Counter):
                for labels, value in [(k, c.value) for k, c in list(family.children.items())]:
                    self._put(file, self._key(family, family.name + "_total", labels), value)
            elif isinstance(family, Gauge):
                sample = family.name
                gauges: dict[tuple[str, ...], GaugeChild] = family.children
                for labels, value in [(k, c.value) for k, c in list(gauges.items())]:
                    self._put(file, self._key(family, sample, labels), float(value))

    def close(self) -> None:
        self.write()
        for file in self._files.values():
            file.close()
        self._files.clear()


def shared_registry(directory: str) -> CollectorRegistry:
    """A registry that collects every worker's metrics from ``directory``."""
    registry = CollectorRegistry()
    _MultiProcessCollector(registry, path=directory)
    return registry


def worker_gone(pid: int, directory: str) -> None:
    """Drop a dead worker's live gauges (its counters and histograms stay counted)."""
    _mark_process_dead(pid, directory)


def write_recent(directory: str, pid: int, recent: object) -> None:
    """A worker's recently limited identities, for the console (replaced atomically)."""
    target = os.path.join(directory, f"recent_{pid}.json")
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(recent, handle)
    os.replace(tmp, target)
