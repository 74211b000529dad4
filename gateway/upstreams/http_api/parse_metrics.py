"""The built-in APIs' parse budget (``parse_budget.py``) on the admin port's ``/metrics``:
read off the budget when scraped, so the request path adds nothing and the same collector
serves one process (the gateway's registry) and ``--workers`` (the supervisor's, where the
built-in APIs run). Label values are fixed words: no address is ever a label."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.upstreams.http_api.parse_budget import ParseBudget


class ParseBudgetCollector:
    """A prometheus-client ``Collector`` by shape (``collect``), for ``registry.register``."""

    def __init__(self, budget: ParseBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[Metric]:
        budget = self._budget
        refused = CounterMetricFamily(
            "gateway_builtin_body_refusals",
            "Request bodies the built-in Store and control plane refused before reading or "
            "parsing them: 429, the client address had used its share of the event loop "
            "for parsing (store.body_parse_share); 503, all addresses together had "
            "(store.body_parse_total_share)",
            labels=["status"],
        )
        for status, count in sorted(budget.refused.items()):
            refused.add_metric([str(status)], count)
        yield refused
        yield CounterMetricFamily(
            "gateway_builtin_body_parse_seconds",
            "Event-loop (CPU) seconds the built-in Store and control plane spent parsing "
            "request bodies",
            value=budget.charged_seconds,
        )
        yield CounterMetricFamily(
            "gateway_builtin_body_parse_debts",
            "Times a client address went past its share of parsing time (its next bodies "
            "are refused for a while; the log says so once each time)",
            value=budget.debts,
        )
        yield GaugeMetricFamily(
            "gateway_builtin_body_parse_addresses",
            "Client addresses whose parse share is refilling (bounded by max_addresses)",
            value=len(budget),
        )
