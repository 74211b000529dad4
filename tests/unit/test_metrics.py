"""gateway.metrics: plain adds on the request path, Prometheus text at scrape time."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import LATENCY_BUCKETS, Counter, Histogram, Metrics

# Every family the gateway exports: exposition name, type, label names, help text. A
# dashboard (deploy/grafana) and alert examples (docs/deployment.md) rely on these.
FAMILIES = [
    ("gateway_requests_total", "counter", ("region", "rule", "identity", "decision"),
     "Requests seen by the gateway, by rate-limit decision."),
    ("gateway_near_limit_total", "counter", ("region", "rule"),
     "Admitted requests that left less than 20% of a limit."),
    ("gateway_overhead_seconds", "histogram", ("region",),
     "Time the gateway spent before forwarding (identity, rules, counters)."),
    ("gateway_upstream_seconds", "histogram", ("upstream",),
     "Time from forwarding a request to receiving the upstream's response headers."),
    ("gateway_upstream_errors_total", "counter", ("upstream", "kind"),
     "Requests the upstream could not answer (unreachable, timeout, broken stream, "
     "body_too_large), or that would have held too many of its connections "
     "(uploads_per_client, uploads_total)."),
    ("gateway_responses_total", "counter", ("region", "status_class"),
     "Responses sent, by status class."),
    ("gateway_counter_store_errors_total", "counter", ("region", "kind"),
     "Failed calls to the shared counter store."),
    ("gateway_counter_breaker_state", "gauge", ("region",),
     "Circuit breaker in front of the counter store: 0 closed, 1 open, 2 half-open."),
    ("gateway_counter_breaker_transitions_total", "counter", ("region", "state"),
     "Changes of the counter-store circuit breaker, by the state entered."),
    ("gateway_fallback_decisions_total", "counter", ("region",),
     "Decisions taken by the local fallback counters while the store was unavailable."),
    ("gateway_deny_cache_hits_total", "counter", ("region",),
     "Requests refused from the local deny cache without asking the counter store."),
    ("gateway_token_failures_total", "counter", ("reason",),
     "Bearer tokens that did not verify, by reason (signature, expired, issuer ...)."),
    ("gateway_tunnels_opened_total", "counter", (),
     "Upgraded connections (WebSocket ...) joined after the upstream's 101."),
    ("gateway_tunnels_closed_total", "counter", ("reason",),
     "Upgraded connections that ended, by reason (closed, idle, max_bytes, max_seconds, "
     "stopping)."),
    ("gateway_consumer_requests_total", "counter", ("region", "consumer", "tier", "decision"),
     "Decisions on requests of a verified identity, by consumer (a known key's, '-' for a "
     "token's user) and tier ('-': none); never a key or a token."),
    ("gateway_identity_refusals_total", "counter", ("reason",),
     "Requests answered 401: an unknown API key (unknown_key) or a token that did not "
     "verify (its reason), with identity.*: reject."),
    ("gateway_rule_reloads_total", "counter", ("outcome",),
     "Rule table (re)loads, by outcome (ok, error, unchanged)."),
    ("gateway_rules_loaded_timestamp_seconds", "gauge", (),
     "When the running rule table was loaded."),
    ("gateway_rules", "gauge", (), "Rules in the running table."),
    ("gateway_inflight_requests", "gauge", (), "Requests being handled right now."),
    ("gateway_tls_reloads_total", "counter", ("listener", "outcome"),
     "TLS certificate reloads (the files changed, or SIGHUP), by listener (proxy, admin) and "
     "outcome: ok (a new pair in force), unchanged, refused (the pair in force kept)."),
    ("gateway_tls_certificate_expiry_timestamp_seconds", "gauge", ("listener",),
     "When the TLS certificate in force expires (its notAfter, Unix time), by listener "
     "(proxy, admin)."),
]  # fmt: skip

LE = [
    "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
    "0.25", "0.5", "1.0", "2.5", "5.0", "10.0", "30.0", "+Inf",
]  # fmt: skip


def scrape(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_fresh_registry_declares_every_family_with_its_help_and_type():
    text = scrape(Metrics())
    declared = [line for line in text.splitlines() if line.startswith("#")]
    expected = []
    for name, kind, _labels, help_text in FAMILIES:
        expected += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    assert declared == expected
    # Labelled families have no series until used; unlabelled ones start at 0.
    values = [line for line in text.splitlines() if not line.startswith("#")]
    assert values == [
        "gateway_tunnels_opened_total 0.0",
        "gateway_rules_loaded_timestamp_seconds 0.0",
        "gateway_rules 0.0",
        "gateway_inflight_requests 0.0",
    ]


def test_counters_export_totals_with_sorted_labels_and_no_created_series():
    m = Metrics()
    m.child(m.requests, "us", "r1", "ip", "allowed").inc()
    m.child(m.requests, "us", "r1", "ip", "allowed").inc(2)
    m.child(m.requests, "eu", "r2", "api_key", "limited").inc()
    m.upstream_errors.labels("default", "timeout").inc()
    text = scrape(m)
    assert (
        'gateway_requests_total{decision="allowed",identity="ip",region="us",rule="r1"} 3.0\n'
        'gateway_requests_total{decision="limited",identity="api_key",region="eu",rule="r2"} 1.0\n'
    ) in text
    assert 'gateway_upstream_errors_total{kind="timeout",upstream="default"} 1.0\n' in text
    assert "_created" not in text
    sample = m.registry.get_sample_value
    labels = {"region": "us", "rule": "r1", "identity": "ip", "decision": "allowed"}
    assert sample("gateway_requests_total", labels) == 3
    assert sample("gateway_requests_total", {**labels, "decision": "limited"}) is None
    assert sample("gateway_upstream_errors_total", {"upstream": "default", "kind": "timeout"}) == 1


def test_histogram_buckets_are_cumulative_and_inclusive_of_their_bound():
    m = Metrics()
    h = m.child(m.overhead, "us")
    for value in (0.00005, 0.0001, 0.0003, 0.002, 0.7, 5.0, 31.0):
        h.observe(value)
    text = scrape(m)
    got = samples(text)
    buckets = [got[("gateway_overhead_seconds_bucket", frozenset({("region", "us"), ("le", le)}))]
               for le in LE]  # fmt: skip
    # 0.0001 falls in le=0.0001 (bounds are inclusive); 31 only in +Inf.
    assert buckets == [2, 2, 3, 3, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 6, 6, 6, 7]
    sample = m.registry.get_sample_value
    assert sample("gateway_overhead_seconds_count", {"region": "us"}) == 7
    assert sample("gateway_overhead_seconds_sum", {"region": "us"}) == pytest.approx(36.70245)
    assert sample("gateway_overhead_seconds_bucket", {"region": "us", "le": "+Inf"}) == 7
    # The exact lines prometheus-client wrote before: le spelled its way, then count, sum.
    assert 'gateway_overhead_seconds_bucket{le="0.0001",region="us"} 2.0\n' in text
    assert 'gateway_overhead_seconds_bucket{le="1.0",region="us"} 5.0\n' in text
    assert (
        'gateway_overhead_seconds_bucket{le="+Inf",region="us"} 7.0\n'
        'gateway_overhead_seconds_count{region="us"} 7.0\n'
        'gateway_overhead_seconds_sum{region="us"} 36.70245\n'
    ) in text


def test_both_histograms_use_the_latency_buckets():
    m = Metrics()
    m.child(m.overhead, "us").observe(0.01)
    m.child(m.upstream_latency, "default").observe(0.01)
    got = samples(scrape(m))
    for name, label in (("gateway_overhead_seconds", ("region", "us")),
                        ("gateway_upstream_seconds", ("upstream", "default"))):  # fmt: skip
        les = sorted(
            (float(dict(labels)["le"]) for (n, labels) in got if n == f"{name}_bucket"),
        )
        assert les == [*LATENCY_BUCKETS, math.inf]
        assert got[(f"{name}_bucket", frozenset({label, ("le", "0.005")}))] == 0
        assert got[(f"{name}_bucket", frozenset({label, ("le", "0.01")}))] == 1


def test_gauges_and_breaker_events():
    m = Metrics()
    m.inflight.inc()
    m.inflight.inc()
    m.inflight.dec()
    m.rules_count.set(30)
    m.rules_loaded.set(1700000000.5)
    us = m.counter_events("us")
    m.counter_events("eu")
    us.store_error("connection")
    us.breaker_changed("open")
    us.breaker_changed("half_open")
    us.fallback_used()
    us.deny_cache_hit()
    text = scrape(m)
    for line in (
        "gateway_inflight_requests 1.0",
        "gateway_rules 30.0",
        "gateway_rules_loaded_timestamp_seconds 1.7000000005e+09",
        'gateway_counter_breaker_state{region="us"} 2.0',
        'gateway_counter_breaker_state{region="eu"} 0.0',
        'gateway_counter_store_errors_total{kind="connection",region="us"} 1.0',
        'gateway_counter_breaker_transitions_total{region="us",state="open"} 1.0',
        'gateway_counter_breaker_transitions_total{region="us",state="half_open"} 1.0',
        'gateway_fallback_decisions_total{region="us"} 1.0',
        'gateway_deny_cache_hits_total{region="us"} 1.0',
    ):
        assert line + "\n" in text, line


def test_the_exposition_parses_with_the_declared_label_names():
    m = Metrics()
    m.child(m.requests, "us", "r", "ip", "allowed").inc()
    m.child(m.near_limit, "us", "r").inc()
    m.child(m.overhead, "us").observe(0.001)
    m.child(m.upstream_latency, "default").observe(0.2)
    m.upstream_errors.labels("default", "timeout").inc()
    m.child(m.responses, "us", "2xx").inc()
    m.counter_events("us").breaker_changed("open")
    m.counter_events("us").store_error("timeout")
    m.counter_events("us").fallback_used()
    m.counter_events("us").deny_cache_hit()
    m.rule_reloads.labels("ok").inc()
    m.child(m.token_failures, "expired").inc()
    m.child(m.identity_refusals, "unknown_key").inc()
    m.child(m.consumer_requests, "us", "acme", "gold", "allowed").inc()
    m.child(m.tunnels_closed, "idle").inc()
    m.child(m.tls_reloads, "proxy", "ok").inc()
    m.child(m.tls_expiry, "proxy").set(1.8e9)
    parsed = {f.name: f for f in text_string_to_metric_families(scrape(m))}
    for name, kind, labels, help_text in FAMILIES:
        family = parsed[name.removesuffix("_total")]
        assert (family.type, family.documentation) == (kind, help_text)
        assert family.samples, name
        for s in family.samples:
            assert set(s.labels) - {"le"} == set(labels), (name, s)


def test_children_are_kept_and_label_counts_checked():
    m = Metrics()
    child = m.child(m.requests, "us", "r", "ip", "allowed")
    assert m.child(m.requests, "us", "r", "ip", "allowed") is child
    assert m.requests.labels("us", "r", "ip", "allowed") is child
    with pytest.raises(ValueError, match="labels"):
        m.requests.labels("us", "r")
    with pytest.raises(ValueError):
        child.inc(-1)
    assert m.child(m.requests, "us", "r", "ip", "allowed").value == 0


def test_each_metrics_object_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.child(a.responses, "us", "2xx").inc()
    labels = {"region": "us", "status_class": "2xx"}
    assert a.registry.get_sample_value("gateway_responses_total", labels) == 1
    assert b.registry.get_sample_value("gateway_responses_total", labels) is None


def test_families_check_their_definition():
    with pytest.raises(ValueError, match="increasing"):
        Histogram("h", "help", ["x"], buckets=(1.0, 0.5))
    counter = Counter("c", "help", [])  # no labels: one series, there from the start
    assert counter.labels() is counter.labels()
    assert counter.export().samples[0].value == 0


@given(
    st.lists(st.floats(allow_nan=False, allow_infinity=True, width=64), max_size=30),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=50),
)
def test_an_observation_lands_in_the_bucket_bisect_left_gives(bounds, amounts):
    """The histogram's scan against ``bisect_left``: any sorted bounds, any amounts (NaN and
    infinities included), the same counts and sum."""
    from bisect import bisect_left

    from gateway.metrics import HistogramChild

    ordered = tuple(sorted(bounds))
    child = HistogramChild(ordered)
    expected = [0] * (len(ordered) + 1)
    for amount in amounts:
        child.observe(amount)
        expected[bisect_left(ordered, amount)] += 1
    assert child.counts == expected
    total = 0.0
    for amount in amounts:
        total += amount
    assert child.sum == total or (math.isnan(child.sum) and math.isnan(total))
