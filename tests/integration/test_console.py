"""The operator console on the admin port: what it shows, who may see it, its headers."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import pytest

from gateway.app import request_reader
from gateway.explain import ReadRequest
from gateway.metrics import Metrics
from gateway.policy.loader import load_rules_from_texts
from gateway.policy.model import RuleTable
from gateway.proxy.admin import create_admin_app
from gateway.proxy.console import CSP, ConsoleSource, RateSampler
from gateway.ratelimit.identity import IdentityHasher
from gateway.replay.saved import save_report
from gateway.settings import Settings
from tests.support.gateway import running_app

RULES = """
rules:
  - id: q-shadow
    match: {prefix: /q}
    identity: api_key
    shadow: true
    limits: {default: 3/60}
  - id: q-key
    match: {prefix: /q}
    identity: api_key
    limits: {us: 5/2, eu: 7/2}
  - id: by-ip
    identity: ip
    limits: {default: 6/2}
"""
TOKEN = "console-token-0123456789"


async def _history(http, url, query="", until=lambda data: True):
    """The console's history JSON once ``until`` holds (the sampler reads every 2 s)."""
    deadline = time.monotonic() + 30
    while True:
        async with http.get(url + "/console/api/history" + query) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
        if until(data):
            return data
        assert time.monotonic() < deadline, data
        await asyncio.sleep(0.2)


def data_plane_reader(hasher: IdentityHasher, settings: Settings | None = None, verified=None):
    """``ConsoleSource.reader``: the data plane's reading, as ``gateway.app`` wires it."""

    async def reader(table: RuleTable) -> ReadRequest:
        return request_reader(settings or Settings(), table, hasher, verified)

    return reader


def _source(tmp_path: Path, metrics: Metrics, host: str, token: str | None) -> ConsoleSource:
    table = load_rules_from_texts([("rules/a.yaml", RULES)])
    refused_at = time.time()  # within the console's ten minutes

    async def regions():
        return [
            {"name": "us", "counter_backend": "memory", "healthy": True},
            {"name": "eu", "counter_backend": "redis://eu:6379/0", "healthy": False},
        ]

    return ConsoleSource(
        table=lambda: table,
        last_reload_error=lambda: None,
        regions=regions,
        registry=metrics.registry,
        recent=lambda: [(refused_at, "us", "q-key", "api_key:0123456789ab")],
        hasher=IdentityHasher(b"s" * 32),
        secret_source="a test secret",
        reader=data_plane_reader(IdentityHasher(b"s" * 32)),
        data_dir=tmp_path,
        admin_host=host,
        admin_token=token,
    )


@pytest.fixture
def metrics():
    return Metrics()


async def _console(tmp_path, metrics, host="127.0.0.1", token=None):
    app = create_admin_app(metrics.registry, None, _source(tmp_path, metrics, host, token))
    return running_app(app)


async def test_on_loopback_without_a_token_the_console_shows_everything(tmp_path, metrics):
    save_report({"replayed": 12, "logs": ["a.log"], "from": "x", "to": "y",
                 "new": {"digest": "abcdef0123456789", "rules": [
                     {"id": "q-key", "matched": 12, "limited": 4, "identities_limited": 1,
                      "top_limited": [{"identity": "api_key:feedfeedfeed"}]}]},
                 "baseline": None, "diff": None}, tmp_path)  # fmt: skip
    async with await _console(tmp_path, metrics) as url, aiohttp.ClientSession() as http:
        await _history(http, url, until=lambda data: data["top_limited"])
        async with http.get(url + "/console") as r:
            assert r.status == 200
            assert r.headers["Content-Security-Policy"] == CSP
            assert r.headers["X-Content-Type-Options"] == "nosniff"
            page = await r.text()
        # rules in table order for the selected region (the default one shown, the
        # other hidden), the shadow rule marked, the file named
        us = page.split('<table class="rules" data-region="us">')[1].split("</table>")[0]
        assert [m for m in re.findall(r"<td>(q-shadow|q-key|by-ip)</td>", us)] == [
            "q-shadow", "q-key", "by-ip"]  # fmt: skip
        assert '<tr class="shadow" data-rule="q-shadow">' in us and "rules/a.yaml" in us
        assert '<table class="rules" data-region="eu" hidden>' in page
        assert "5/2" in us and "7/2" in page.split('data-region="eu"')[-1]
        assert "NOT ANSWERING" in page and "healthy" in page
        assert "api_key:0123456789ab" in page  # the top limited identities, hashed
        assert "api_key:feedfeedfeed" in page and "12 requests" in page  # the saved replay
        assert "<script" in page and "onclick" not in page and "style=" not in page
        for asset, kind in (("console.js", "javascript"), ("console.css", "css")):
            async with http.get(f"{url}/console/static/{asset}") as r:
                assert r.status == 200 and kind in r.headers["Content-Type"]
        # /metrics and /ok stay open
        async with http.get(url + "/metrics") as r:
            assert r.status == 200


async def test_explain_answers_json_and_refuses_bad_input(tmp_path, metrics):
    async with await _console(tmp_path, metrics) as url, aiohttp.ClientSession() as http:
        body = {"method": "GET", "path": "/q/1", "headers": "x-api-key: sk-live-1",
                "region": "eu", "client_ip": "198.51.100.1"}  # fmt: skip
        async with http.post(url + "/console/api/explain", json=body) as r:
            assert r.status == 200
            text = (await r.json())["text"]
        assert "q-key: MATCHES" in text and "7/2" in text and "sk-live-1" not in text
        assert "q-shadow: shadow rule" in text
        for bad, status in [
            ({**body, "path": "/a%2Fb"}, 422),
            ({**body, "method": "G E T"}, 422),
            ({**body, "headers": "no colon here"}, 422),
            ({**body, "region": "mars"}, 422),
            ({**body, "path": 7}, 422),
            ([1, 2], 422),
        ]:
            async with http.post(url + "/console/api/explain", json=bad) as r:
                assert r.status == status, bad
                assert "detail" in await r.json()
        async with http.post(url + "/console/api/explain", data="method=GET") as r:
            assert r.status == 415  # a cross-site form cannot post JSON
        async with http.post(url + "/console/api/explain", data=b"{",
                             headers={"Content-Type": "application/json"}) as r:  # fmt: skip
            assert r.status == 400 and "detail" in await r.json()


async def test_off_loopback_without_a_token_the_console_is_off(tmp_path, metrics):
    async with await _console(tmp_path, metrics, host="0.0.0.0") as url:
        async with aiohttp.ClientSession() as http:
            for path in ("/console", "/console/api/rates"):
                async with http.get(url + path) as r:
                    assert r.status == 403
                    assert "GATEWAY_ADMIN_TOKEN" in (await r.json())["detail"]
            async with http.get(url + "/metrics") as r:
                assert r.status == 200
            async with http.get(url + "/ok") as r:
                assert r.status == 200


async def test_with_a_token_a_browser_signs_in_by_post_and_gets_a_strict_cookie(tmp_path, metrics):
    async with await _console(tmp_path, metrics, host="0.0.0.0", token=TOKEN) as url:
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(cookie_jar=jar) as http:
            async with http.get(url + "/console", allow_redirects=False) as r:
                assert r.status == 303 and r.headers["Location"] == "/console/login"
            async with http.get(url + "/console/api/rates") as r:
                assert r.status == 401 and "detail" in await r.json()
            async with http.post(url + "/console/login", data={"token": "wrong" * 5}) as r:
                assert r.status == 401
            async with http.post(url + "/console/login", data={"token": TOKEN},
                                 allow_redirects=False) as r:  # fmt: skip
                assert r.status == 303
                cookie = r.headers["Set-Cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
            async with http.get(url + "/console") as r:
                assert r.status == 200 and "q-key" in await r.text()
        async with aiohttp.ClientSession() as http:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(url + "/console/api/recent", headers=auth) as r:
                assert r.status == 200
                (item,) = await r.json()
                assert item["identity"] == "api_key:0123456789ab" and item["refusals"] == 1
            async with http.get(url + "/metrics") as r:
                assert r.status == 200  # scrapers need no token


def test_rates_come_from_the_metrics_over_the_last_minute(metrics):
    sampler = RateSampler(metrics.registry)
    allowed = metrics.requests.labels("us", "q-key", "api_key", "allowed")
    limited = metrics.requests.labels("us", "q-key", "api_key", "limited")
    shadow = metrics.requests.labels("us", "q-shadow", "api_key", "shadow_limited")
    sampler.take(now=1000.0)
    allowed.inc(120)
    limited.inc(30)
    shadow.inc(6)
    sampler.take(now=1060.0)
    rows = {r["rule"]: r for r in sampler.rates()}
    assert rows["q-key"]["allowed_60s"] == 2.0 and rows["q-key"]["limited_60s"] == 0.5
    assert rows["q-shadow"]["shadow_limited_60s"] == 0.1
    assert rows["q-key"]["allowed_total"] == 120
    sampler.take(now=1120.0)  # nothing new in the last minute
    assert {r["rule"]: r for r in sampler.rates()}["q-key"]["allowed_60s"] == 0.0
    assert json.dumps(sampler.rates())  # what the page's script reads


def test_recent_refusals_are_grouped_by_identity_newest_first():
    from gateway.proxy.console import recent_identities

    recent = [(30.0, "us", "r", "ip:a"), (20.0, "us", "r", "ip:b"), (10.0, "us", "r", "ip:a")]
    assert [(i["identity"], i["time"], i["refusals"]) for i in recent_identities(recent)] == [
        ("ip:a", 30.0, 2), ("ip:b", 20.0, 1)]  # fmt: skip
    assert len(recent_identities(recent, limit=1)) == 1


async def test_history_shows_one_region_bounded_and_refuses_a_bad_view(tmp_path, metrics):
    async with await _console(tmp_path, metrics) as url, aiohttp.ClientSession() as http:
        await _history(http, url, until=lambda d: d["sampled_at"])  # the baseline taken
        metrics.requests.labels("eu", "q-key", "api_key", "allowed").inc(30)
        metrics.requests.labels("eu", "q-key", "api_key", "limited").inc(12)
        metrics.requests.labels("us", "by-ip", "ip", "allowed").inc(5)
        data = await _history(
            http, url, "?region=eu",
            until=lambda d: any(r.get("total") for r in d["rules"]),
        )  # fmt: skip
        # one region's rules in table order, each with one rate per bucket
        assert data["region"] == "eu" and [r["rule"] for r in data["rules"]] == [
            "q-shadow", "q-key", "by-ip"]  # fmt: skip
        q_key = data["rules"][1]
        assert q_key["total"] == {"allowed": 30, "limited": 12, "shadow": 0}
        assert len(q_key["allowed"]) == len(data["covered"]) == 60 and "shadow" not in q_key
        assert data["rules"][0] == {"rule": "q-shadow", "idle": True}
        # the counter stores' health, as a strip of states per region
        await _history(http, url, until=lambda d: len(d["health"]) == 2)
        data = await _history(http, url, "?region=eu&rule=KEY")
        assert [r["rule"] for r in data["rules"]] == ["q-key"]  # the filter ignores case
        states = {h["region"]: h["states"] for h in data["health"]}
        assert set(states["us"]) <= {"u", "-"} and "u" in states["us"]
        assert set(states["eu"]) <= {"d", "-"} and "d" in states["eu"]
        for query, detail in [
            ("?region=mars", "unknown region 'mars'"),
            ("?rule=" + "x" * 201, "at most 200 characters"),
            ("?rule=%01", "printable"),
        ]:
            for path in ("/console/api/history", "/console"):
                async with http.get(url + path + query) as r:
                    assert r.status == 422 and detail in (await r.json())["detail"], query
        # the page for a region and a filter: that region's table, other rows hidden
        async with http.get(url + "/console?region=eu&rule=q-") as r:
            page = await r.text()
        assert '<table class="rules" data-region="eu">' in page
        assert '<table class="rules" data-region="us" hidden>' in page
        eu = page.split('<table class="rules" data-region="eu">')[1].split("</table>")[0]
        assert '<tr data-rule="by-ip" hidden>' in eu and '<tr data-rule="q-key">' in eu
        assert "<option selected>eu</option>" in page and 'value="q-"' in page


async def test_top_limited_identities_show_the_consumer_and_tier_of_a_known_key(tmp_path, upstream):
    """A real gateway with a key file: the key's consumer and tier are found from the
    logged identity (the key file's consumer names hashed), and the key is never shown."""
    from gateway.identity.key_edit import add_key
    from gateway.proxy.console import known_consumers
    from tests.support.gateway import SECRET, running_gateway

    keys = tmp_path / "keys.yaml"
    key = add_key(keys, "acme", "gold")
    config = tmp_path / "gateway.yaml"
    config.write_text(f"identity:\n  api_key: {{keys: {keys}}}\n")
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - id: q\n    identity: api_key\n    limits: {default: 3/60}\n")
    async with running_gateway(upstream, rules=[str(rules)], config_file=str(config)) as gw:
        async with aiohttp.ClientSession() as http:
            for _ in range(7):
                async with http.get(gw.url + "/q", headers={"x-api-key": key}) as r:
                    await r.read()
        refusals = gw.gateway.access_log.recent_limited
        assert len(refusals) == 4
        source = ConsoleSource(
            table=lambda: gw.rules.table,
            last_reload_error=lambda: None,
            regions=_source(tmp_path, Metrics(), "127.0.0.1", None).regions,
            registry=gw.metrics.registry,
            recent=lambda: list(reversed(refusals)),
            hasher=IdentityHasher(SECRET),
            secret_source="the test gateway's secret",
            reader=data_plane_reader(IdentityHasher(SECRET), gw.settings, gw.gateway.verified),
            data_dir=tmp_path,
            admin_host="127.0.0.1",
            admin_token=None,
            consumers=lambda: known_consumers(gw.gateway.verified),
        )
        app = create_admin_app(gw.metrics.registry, None, source)
        async with running_app(app) as url, aiohttp.ClientSession() as http:
            data = await _history(http, url, until=lambda d: d["top_limited"])
            (top,) = data["top_limited"]
            assert re.fullmatch(r"api_key:[0-9a-f]{12}", top["identity"])
            assert (top["consumer"], top["tier"], top["refusals"]) == ("acme", "gold", 4)
            assert top["rules"] == ["q"] and top["kind"] == "api_key"
            async with http.get(url + "/console") as r:
                page = await r.text()
            assert "<td>acme</td><td>gold</td>" in page
            async with http.get(url + "/console/api/history") as r:
                raw = await r.text()
            assert key not in raw and key not in page
