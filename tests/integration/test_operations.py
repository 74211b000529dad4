"""Hot reload, shadow rules, metrics and access logs, through real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import aiohttp

from tests.support.gateway import running_gateway

RULES = """
rules:
  - id: limited
    match: {{prefix: /limited}}
    identity: api_key
    limits: {{default: {count}/60}}
  - id: other
    match: {{prefix: /other}}
    identity: ip
    limits: {{default: {other}/60}}
  - id: catch-all
    identity: ip
    limits: {{default: 1000/60}}
"""


def write_rules(path, count=50, other=10, extra=""):
    path.write_text(RULES.format(count=count, other=other) + extra)


async def test_reload_under_traffic_fails_nothing_and_keeps_counters(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    write_rules(rules)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        statuses: list[int] = []

        async def traffic(http):
            for _ in range(120):
                async with http.get(gw.url + "/limited", headers={"x-api-key": "k1"}) as r:
                    statuses.append(r.status)
                await asyncio.sleep(0)

        async with aiohttp.ClientSession() as http:
            task = asyncio.create_task(traffic(http))
            for other in range(11, 31):  # twenty reloads while traffic flows
                write_rules(rules, other=other)
                assert gw.rules.reload("test")
                await asyncio.sleep(0.005)
            await task
            assert set(statuses) <= {200, 429}
            assert statuses.count(200) == 50  # no reload reset the window
            # A changed limit applies to the existing window: 10 more, then refused again.
            write_rules(rules, count=60, other=99)
            assert gw.rules.reload("test")
            admitted = 0
            for _ in range(15):
                async with http.get(gw.url + "/limited", headers={"x-api-key": "k1"}) as r:
                    admitted += r.status == 200
            assert admitted == 10


async def test_bad_file_is_refused_and_old_table_keeps_serving(tmp_path, upstream, caplog):
    rules = tmp_path / "rules.yaml"
    write_rules(rules, count=3)
    async with running_gateway(upstream, rules=[str(rules)]) as gw:
        old = gw.rules.table.digest
        rules.write_text(RULES.format(count="lots", other=1))
        with caplog.at_level(logging.ERROR, logger="gateway.rules"):
            assert not gw.rules.reload("test")
        assert "limits.default" in caplog.text and "'limited'" in caplog.text
        assert str(rules) in caplog.text
        assert gw.rules.table.digest == old
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.get(gw.url + "/limited", headers={"x-api-key": "k"}) as r:
                    assert r.status == 200
            async with http.get(gw.url + "/limited", headers={"x-api-key": "k"}) as r:
                assert r.status == 429
            info = await gw.proxy.info()  # the admin port's /info
            assert info["rules"]["hash"] == old
            assert "limits.default" in info["rules"]["last_reload_error"]
        metrics = gw.metrics.registry
        assert metrics.get_sample_value("gateway_rule_reloads_total", {"outcome": "error"}) == 1


async def test_file_watcher_picks_up_an_edit(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    write_rules(rules, count=1)
    async with (
        running_gateway(upstream, rules=[str(rules)], watch_rules=True, watch_interval=0.05) as gw,
        aiohttp.ClientSession() as http,
    ):
        old = gw.rules.table.digest
        write_rules(rules, count=2)
        deadline = time.monotonic() + 10
        while gw.rules.table.digest == old and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert gw.rules.table.digest != old
        async with http.get(gw.url + "/limited", headers={"x-api-key": "k"}) as r:
            assert r.headers["RateLimit-Policy"] == '"limited";q=2;w=60'


SHADOW = """
  - id: shadow-strict
    match: {prefix: /shadowed}
    identity: ip
    shadow: true
    limits: {default: 2/60}
"""


async def test_shadow_rules_are_reported_but_never_reject(tmp_path, upstream):
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:" + SHADOW + RULES.format(count=5, other=1).split("rules:", 1)[1])
    async with running_gateway(upstream, rules=[str(rules)]) as gw, aiohttp.ClientSession() as http:
        for n in range(10):
            async with http.get(gw.url + "/shadowed/x") as r:
                assert r.status == 200  # the enforced catch-all allows 1000
                policy = r.headers["RateLimit-Policy"]
                assert '"catch-all";q=1000;w=60' in policy
                assert '"shadow-strict";q=2;w=60' in policy
                state = r.headers["RateLimit"]
                assert f'"shadow-strict";r={max(0, 2 - n - 1)};' in state
        sample = gw.metrics.registry.get_sample_value
        labels = {"region": "us", "rule": "shadow-strict", "identity": "ip"}
        assert sample("gateway_requests_total", {**labels, "decision": "shadow_limited"}) == 8
        assert sample("gateway_requests_total", {**labels, "decision": "allowed"}) is None


async def test_metrics_move_and_never_carry_raw_identities(tmp_path, upstream, caplog):
    rules = tmp_path / "rules.yaml"
    write_rules(rules, count=2)
    secret_key = "sk-live-SUPERSECRET-123"
    user = "user-PRIVATE-42"
    async with running_gateway(upstream, rules=[str(rules)], access_log="json") as gw:
        with caplog.at_level(logging.INFO):
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    async with http.get(
                        gw.url + "/limited?token=QUERYSECRET",
                        headers={"x-api-key": secret_key, "x-user-id": user},
                    ):
                        pass
                async with http.get(gw.url + "/ok"):
                    pass
            gw.gateway.access_log.flush()  # lines are written in batches (within 50 ms)
        sample = gw.metrics.registry.get_sample_value
        labels = {"region": "us", "rule": "limited", "identity": "api_key"}
        assert sample("gateway_requests_total", {**labels, "decision": "allowed"}) == 2
        assert sample("gateway_requests_total", {**labels, "decision": "limited"}) == 1
        assert sample("gateway_near_limit_total", {"region": "us", "rule": "limited"}) == 1
        assert sample("gateway_overhead_seconds_count", {"region": "us"}) >= 3
        assert sample("gateway_upstream_seconds_count", {"upstream": "default"}) == 2
        assert sample("gateway_responses_total", {"region": "us", "status_class": "4xx"}) == 1
        from prometheus_client import generate_latest

        exported = generate_latest(gw.metrics.registry).decode()
        for secret in (secret_key, user, "QUERYSECRET"):
            assert secret not in exported
            assert secret not in caplog.text
        lines = [
            json.loads(line)
            for r in caplog.records
            if r.name == "gateway.access"
            for line in r.getMessage().split("\n")
        ]
        assert [line["status"] for line in lines] == [200, 200, 429, 200]
        assert lines[0]["rule"] == "limited" and lines[0]["identity"].startswith("api_key:")
        assert lines[2]["decision"] == "limited" and lines[0]["path"] == "/limited"
