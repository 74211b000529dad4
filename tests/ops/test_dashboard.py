"""deploy/grafana/gateway-dashboard.json queries only metrics (and labels) the gateway
exports."""

from __future__ import annotations

import json
import re

import aiohttp
from prometheus_client import generate_latest

from tests.ops.helpers import (
    DASHBOARD,
    exported_names,
    metric_families,
    sample_index,
)
from tests.support.gateway import running_gateway

METRIC = re.compile(r"\bgateway_[a-z0-9_]+")
SELECTOR = re.compile(r"\b(gateway_[a-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Added by Prometheus at scrape time, or by the histogram itself.
SCRAPE_LABELS = {"instance", "job"}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def _queries(dashboard: dict) -> list[str]:
    queries = [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            query = query.get("query")
        if variable.get("type") == "query" and query:
            queries.append(query)
    return queries


def test_dashboard_is_grafana_json_with_a_datasource_variable():
    dashboard = _dashboard()
    assert dashboard["title"] and dashboard["uid"]
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert "datasource" in names
    ids = [p["id"] for p in _panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in _panels(dashboard):
        if panel["type"] != "row":
            assert panel["targets"], panel["title"]
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


async def test_every_queried_metric_exists_in_a_live_gateway_or_metrics_py(upstream):
    families = metric_families()
    known = sample_index(families)
    # A live gateway's /metrics after some traffic: what Prometheus really scrapes.
    async with running_gateway(upstream=upstream) as gw, aiohttp.ClientSession() as session:
        for _ in range(3):
            async with session.post(gw.url + "/runs/query", headers={"x-api-key": "k"}) as r:
                await r.read()
        live = exported_names(generate_latest(gw.metrics.registry).decode())
    assert "gateway_requests_total" in live and "gateway_overhead_seconds_bucket" in live
    assert live <= set(known) | {f.name for f in families.values()}

    queried = {m for q in _queries(_dashboard()) for m in METRIC.findall(q)}
    assert len(queried) >= 12, "the dashboard covers the gateway's metrics"
    missing = queried - (live | set(known))
    assert not missing, f"the dashboard queries metrics nobody exports: {sorted(missing)}"


def test_every_label_the_dashboard_uses_exists_on_its_metric():
    known = sample_index(metric_families())
    for query in _queries(_dashboard()):
        used = set()
        for name, matchers in SELECTOR.findall(query):
            labels = set(known[name].labels) | SCRAPE_LABELS
            bad = set(MATCHER.findall(matchers)) - labels
            assert not bad, f"{name} has no label(s) {sorted(bad)}: {query}"
            used.add(name)
        used |= set(METRIC.findall(query))
        available = set(SCRAPE_LABELS)
        for name in used:
            available |= set(known[name].labels)
            if name.endswith("_bucket"):
                available.add("le")
        for group in BY.findall(query):
            bad = {label.strip() for label in group.split(",") if label.strip()} - available
            assert not bad, f"grouping by unknown label(s) {sorted(bad)}: {query}"


def test_every_metric_in_metrics_py_has_a_panel():
    queried = {m for q in _queries(_dashboard()) for m in METRIC.findall(q)}
    index = sample_index(metric_families())
    shown = {index[m].name for m in queried}
    assert shown == set(metric_families()), set(metric_families()) - shown
