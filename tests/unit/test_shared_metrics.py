"""--workers: each worker's metrics in prometheus-client multiprocess files, one scrape."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import Metrics, SharedMetricsWriter, shared_registry, worker_gone


def _samples(registry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _worker(requests: int, latencies: list[float], breaker: int, inflight: int) -> Metrics:
    m = Metrics()
    m.requests.labels("us", "r1", "api_key", "allowed").inc(requests)
    m.requests.labels("us", "r1", "api_key", "limited").inc(1)
    for value in latencies:
        m.overhead.labels("us").observe(value)
    m.breaker_state.labels("us").set(breaker)
    m.inflight.set(inflight)
    m.rules_loaded.set(1000 + breaker)
    return m


def test_counters_sum_histograms_merge_gauges_follow_their_mode(tmp_path):
    a, b = _worker(5, [0.0002, 0.003], 0, 2), _worker(7, [0.003, 0.7], 1, 3)
    SharedMetricsWriter(a, str(tmp_path), pid=101).write()
    writer_b = SharedMetricsWriter(b, str(tmp_path), pid=102)
    writer_b.write()
    got = _samples(shared_registry(str(tmp_path)))
    labels = (("decision", "allowed"), ("identity", "api_key"), ("region", "us"), ("rule", "r1"))
    assert got[("gateway_requests_total", labels)] == 12
    # one histogram: the buckets of both workers added, then cumulated as Prometheus wants
    region = (("region", "us"),)
    assert got[("gateway_overhead_seconds_count", region)] == 4
    assert got[("gateway_overhead_seconds_bucket", (("le", "0.00025"), *region))] == 1
    assert got[("gateway_overhead_seconds_bucket", (("le", "0.005"), *region))] == 3
    assert got[("gateway_overhead_seconds_bucket", (("le", "+Inf"), *region))] == 4
    assert abs(got[("gateway_overhead_seconds_sum", region)] - 0.7062) < 1e-9
    # breaker state per worker, in-flight requests summed, load time the latest
    assert got[("gateway_counter_breaker_state", (("pid", "101"), *region))] == 0
    assert got[("gateway_counter_breaker_state", (("pid", "102"), *region))] == 1
    assert got[("gateway_inflight_requests", ())] == 5
    assert got[("gateway_rules_loaded_timestamp_seconds", ())] == 1001

    # later writes replace a worker's numbers (never add them twice)
    b.requests.labels("us", "r1", "api_key", "allowed").inc(3)
    writer_b.write()
    writer_b.write()
    assert _samples(shared_registry(str(tmp_path)))[("gateway_requests_total", labels)] == 15

    # a worker that died: its counts stay, its live gauges go
    worker_gone(102, str(tmp_path))
    got = _samples(shared_registry(str(tmp_path)))
    assert got[("gateway_requests_total", labels)] == 15
    assert ("gateway_counter_breaker_state", (("pid", "102"), *region)) not in got
    assert got[("gateway_inflight_requests", ())] == 2


def test_one_process_exports_the_same_names_as_the_shared_scrape(tmp_path):
    m = _worker(5, [0.01], 0, 1)
    SharedMetricsWriter(m, str(tmp_path), pid=7).write()
    single = {name for name, _ in _samples(m.registry)}
    shared = {name for name, _ in _samples(shared_registry(str(tmp_path)))}
    assert single == shared
