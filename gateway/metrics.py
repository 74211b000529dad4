"""Prometheus metrics in the gateway's own registry (one per app, so tests can run many).

Labels never carry raw API keys or user ids: identities appear only as their kind
(``ip``, ``api_key``, ``user_ip``).
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = logging.getLogger("gateway.counters")

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

MetricT = TypeVar("MetricT", Counter, Gauge, Histogram)

BREAKER_STATES = {"closed": 0, "open": 1, "half_open": 2}


class Metrics:
    """Every metric the gateway exports."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests seen by the gateway, by rate-limit decision.",
            ["region", "rule", "identity", "decision"],
            registry=r,
        )
        self.near_limit = Counter(
            "gateway_near_limit",
            "Admitted requests that left less than 20% of a limit.",
            ["region", "rule"],
            registry=r,
        )
        self.overhead = Histogram(
            "gateway_overhead_seconds",
            "Time the gateway spent before forwarding (identity, rules, counters).",
            ["region"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_latency = Histogram(
            "gateway_upstream_seconds",
            "Time from forwarding a request to receiving the upstream's response headers.",
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "gateway_upstream_errors",
            "Requests the upstream could not answer (unreachable, timeout, broken stream).",
            ["upstream", "kind"],
            registry=r,
        )
        self.responses = Counter(
            "gateway_responses",
            "Responses sent, by status class.",
            ["region", "status_class"],
            registry=r,
        )
        self.counter_errors = Counter(
            "gateway_counter_store_errors",
            "Failed calls to the shared counter store.",
            ["region", "kind"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "gateway_counter_breaker_state",
            "Circuit breaker in front of the counter store: 0 closed, 1 open, 2 half-open.",
            ["region"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "gateway_counter_breaker_transitions",
            "Changes of the counter-store circuit breaker, by the state entered.",
            ["region", "state"],
            registry=r,
        )
        self.fallback_decisions = Counter(
            "gateway_fallback_decisions",
            "Decisions taken by the local fallback counters while the store was unavailable.",
            ["region"],
            registry=r,
        )
        self.deny_cache_hits = Counter(
            "gateway_deny_cache_hits",
            "Requests refused from the local deny cache without asking the counter store.",
            ["region"],
            registry=r,
        )
        self.rule_reloads = Counter(
            "gateway_rule_reloads",
            "Rule table (re)loads, by outcome (ok, error, unchanged).",
            ["outcome"],
            registry=r,
        )
        self.rules_loaded = Gauge(
            "gateway_rules_loaded_timestamp_seconds",
            "When the running rule table was loaded.",
            registry=r,
        )
        self.rules_count = Gauge("gateway_rules", "Rules in the running table.", registry=r)
        self.inflight = Gauge(
            "gateway_inflight_requests", "Requests being handled right now.", registry=r
        )

    def child(self, metric: MetricT, *labels: str) -> MetricT:
        """``metric.labels(*labels)``, memoised: prometheus-client's own lookup costs more
        than the rest of a counter increment, and the hot path does several per request.
        Label values come from configuration (regions, rule ids, upstreams), so the memo is
        bounded."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

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
        level = logging.INFO if state == "closed" else logging.WARNING
        log.log(level, "counter store for region %s: circuit breaker %s", self._region, state)

    def fallback_used(self) -> None:
        self._m.fallback_decisions.labels(self._region).inc()

    def deny_cache_hit(self) -> None:
        self._m.deny_cache_hits.labels(self._region).inc()
