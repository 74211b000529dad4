"""The console's charts in a real browser (Playwright driving Debian's chromium), with
real traffic through a real gateway: per rule rate charts, the region selector, the rule
filter, the top limited identities, the counter stores' health strip; and with
``--workers 2`` the history counts every worker's requests exactly.

Set CONSOLE_SCREENSHOT=docs/images/console.png to refresh the documentation's screenshot
(docs/deployment.md, "Operator console"); without it the screenshot goes to a temporary
directory."""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import aiohttp

from gateway.policy.loader import load_rules
from gateway.proxy.console import region_rules
from tests.integration.test_console_browser import CHROMIUM, CHROMIUM_ARGS
from tests.support.gateway import DEFAULT_RULES, GatewayProcess

TOO_TALL_BEFORE = 4300  # px: the default table repeated per region, before the charts
PAGE_HEIGHT_LIMIT = 2400  # px, with the default rule table (30 rules) and two regions
REGIONS = ["us", "eu"]
EU_HOST = "eu.example"
RULES = ["runs-query-api-key", "repos-api-key", "beacon", "runs-query-user"]


async def _send(url: str, method: str, path: str, n: int, **headers: str) -> list[int]:
    async with aiohttp.ClientSession() as http:
        statuses = []
        for _ in range(n):
            async with http.request(method, url + path, headers=headers) as r:
                await r.read()
                statuses.append(r.status)
        return statuses


async def _traffic(url: str) -> None:
    """us: runs/query over its 15/10 limit for one key, repos and beacon within theirs;
    eu (by Host): repos only."""
    statuses = await _send(url, "POST", "/runs/query", 25, **{"x-api-key": "key-a-secret"})
    assert statuses.count(429) == 10 and statuses.count(200) == 15
    await _send(url, "POST", "/runs/query", 18, **{"x-user-id": "user-7"})
    await _send(url, "GET", "/repos/a", 12, **{"x-api-key": "key-b-secret"})
    await _send(url, "POST", "/v1/beacon", 30)
    statuses = await _send(url, "GET", "/repos/b", 6, Host=EU_HOST, **{"x-api-key": "key-c"})
    assert statuses == [200] * 6


async def _second_wave(url: str) -> None:
    """More of the same and another key over its limit, a bucket later (so the charts
    show time, not one bar)."""
    await _send(url, "POST", "/runs/query", 20, **{"x-api-key": "key-a-secret"})
    await _send(url, "POST", "/runs/query", 22, **{"x-api-key": "key-d-secret"})
    await _send(url, "POST", "/v1/beacon", 45)
    await _send(url, "GET", "/repos/a", 5, **{"x-api-key": "key-b-secret"})


async def _next_bucket(admin: str) -> None:
    """Wait until the history's newest bucket is a newer one than now."""
    async with aiohttp.ClientSession() as http:
        async with http.get(admin + "/console/api/history") as r:
            start = (await r.json())["start"]
        while True:
            await asyncio.sleep(0.5)
            async with http.get(admin + "/console/api/history") as r:
                if (await r.json())["start"] > start:
                    return


def _visible_rules(region: str) -> str:
    return f'table.rules[data-region="{region}"]'


async def test_charts_region_selector_filter_and_health_in_chromium(
    tmp_path, upstream, redis_server
):
    from playwright.async_api import async_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (scripts/test does it as root)"
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "region: us\nregions:\n  us: {}\n"
        f"  eu: {{redis_url: '{redis_server.url}', hosts: [{EU_HOST}]}}\n"
    )
    gateway = GatewayProcess(
        ["--config", str(config), "--upstream", upstream, "--no-embedded",
         "--data-dir", str(tmp_path), "--access-log", "off"],
        log_path=tmp_path / "gateway.log",
    )  # fmt: skip
    try:
        await asyncio.to_thread(gateway.wait_ready)
        console = f"http://127.0.0.1:{gateway.admin_port}/console"
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            errors: list[str] = []
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(console)
            us = page.locator(_visible_rules("us"))
            await us.wait_for()
            # one region's table at a time: the default rule table, not repeated per region
            assert await page.locator(_visible_rules("eu")).is_hidden()
            ids = await us.locator("tbody tr td:nth-child(2)").all_inner_texts()
            table = load_rules([DEFAULT_RULES], REGIONS)
            assert ids == [r.id for r in region_rules(table, "us")] and len(ids) >= 30

            await _traffic(gateway.url)
            # the sampler has the traffic: runs-query's chart has allowed and limited bars
            chart = 'tr[data-rule="runs-query-api-key"] svg.chart'
            await page.wait_for_function(
                """(sel) => {
                  const svg = document.querySelector(sel);
                  const limited = svg && svg.querySelector('path.limited');
                  const allowed = svg && svg.querySelector('path.allowed');
                  return limited && limited.getAttribute('d').length > 0
                      && allowed && allowed.getAttribute('d').length > 0;
                }""",
                arg=f"{_visible_rules('us')} {chart}",
                timeout=30_000,
            )
            runs = us.locator('tr[data-rule="runs-query-api-key"]')
            assert float(await runs.locator("td.limited").inner_text()) > 0
            label = await runs.locator("svg.chart").get_attribute("aria-label")
            assert label.startswith("runs-query-api-key: over the last 10 minutes, peak ")
            for rule in RULES:
                await page.wait_for_function(
                    "(sel) => document.querySelector(sel + ' path.allowed')",
                    arg=f'{_visible_rules("us")} tr[data-rule="{rule}"] svg.chart',
                    timeout=30_000,
                )
            # a rule without traffic is drawn idle, not as a chart of zeros
            idle = await us.locator('tr[data-rule="otel-traces"] svg.chart').get_attribute(
                "aria-label"
            )
            assert idle == "otel-traces: no requests in the last 10 minutes"

            # the page is a fraction of what it was
            height = await page.evaluate("document.documentElement.scrollHeight")
            assert height < PAGE_HEIGHT_LIMIT < TOO_TALL_BEFORE / 1.5, height

            # top limited identities: hashed as logged, never the key (the sampler may have
            # read the refusals mid-traffic: wait for all ten)
            top = page.locator("#top-limited tbody")
            await page.wait_for_function(
                """() => {
                  const cells = document.querySelectorAll('#top-limited tbody tr:first-child td');
                  return cells.length === 6 && cells[3].textContent === '10';
                }""",
                timeout=20_000,
            )
            first = await top.locator("tr").first.locator("td").all_inner_texts()
            assert re.fullmatch(r"api_key:[0-9a-f]{12}", first[0]) and first[3] == "10"
            assert first[4] == "runs-query-api-key"
            assert "secret" not in await page.content()

            # keyboard: a chart reads out its bars with the arrow keys
            await runs.locator("svg.chart").focus()
            await page.keyboard.press("End")
            await page.keyboard.press("ArrowLeft")
            status = await page.locator("#chart-status").text_content()
            assert status.startswith("runs-query-api-key at ") and "UTC" in status
            await page.keyboard.press("Escape")

            # a bucket later, more traffic: a second identity among the top limited
            await _next_bucket(console.removesuffix("/console"))
            await _second_wave(gateway.url)
            await page.wait_for_function(
                "() => document.querySelectorAll('#top-limited tbody tr').length >= 2",
                timeout=20_000,
            )

            # the counter stores: eu's Redis stops answering, its strip turns red
            us_strip = page.locator('#regions tr[data-region="us"] svg.strip rect.up')
            await us_strip.first.wait_for(timeout=20_000)
            redis_server.stop()
            await page.wait_for_function(
                """() => document.querySelector(
                    '#regions tr[data-region="eu"] svg.strip rect.down, '
                    + '#regions tr[data-region="eu"] svg.strip rect.partly')""",
                timeout=30_000,
            )
            eu_strip = page.locator('#regions tr[data-region="eu"] svg.strip')
            assert "failed checks in" in await eu_strip.get_attribute("aria-label")
            us_down = page.locator('#regions tr[data-region="us"] svg.strip rect.down')
            assert await us_down.count() == 0
            # eu keeps answering on its fallback counters meanwhile
            await _send(gateway.url, "GET", "/repos/b", 4, Host=EU_HOST, **{"x-api-key": "key-c"})

            # the region selector, by keyboard: eu's table, eu's charts, in the URL
            await page.locator("#region").focus()
            await page.keyboard.press("ArrowDown")
            await page.wait_for_function("() => location.search.includes('region=eu')")
            eu = page.locator(_visible_rules("eu"))
            assert await eu.is_visible() and await us.is_hidden()
            assert await page.locator("#rules-section h2 .region-name").inner_text() == "eu"
            await page.wait_for_function(
                "(sel) => document.querySelector(sel + ' path.allowed')",
                arg=f'{_visible_rules("eu")} tr[data-rule="repos-api-key"] svg.chart',
                timeout=20_000,
            )
            eu_runs = eu.locator('tr[data-rule="runs-query-api-key"] svg.chart')
            await eu_runs.wait_for()
            assert "no requests" in await eu_runs.get_attribute("aria-label")
            assert "none in the last 10 minutes" in await top.inner_text()

            # the filter: "/" jumps to it; only matching rows stay
            await page.locator("body").click(position={"x": 5, "y": 5})
            await page.keyboard.press("/")
            await page.keyboard.type("repos")
            await page.wait_for_function("() => location.search.includes('rule=repos')")
            shown = await eu.locator("tbody tr:visible td:nth-child(2)").all_inner_texts()
            assert shown == ["repos-api-key", "repos-user"]
            eu_rules = len(region_rules(table, "eu"))
            assert await page.locator("#filter-count").inner_text() == f"2 of {eu_rules} rules"
            # and the history asked for is the filtered one (bounded, one region)
            async with aiohttp.ClientSession() as http:
                async with http.get(console + "/api/history?region=eu&rule=repos") as r:
                    body = await r.read()
            data = json.loads(body)
            assert [row["rule"] for row in data["rules"]] == ["repos-api-key", "repos-user"]
            assert len(body) < 10_000

            # back to us, unfiltered, for the screenshot
            await page.locator("#rule-filter").fill("")
            await page.locator("#rule-filter").blur()
            await page.select_option("#region", "us")
            await page.wait_for_function(
                "(sel) => document.querySelector(sel + ' path.limited')",
                arg=f"{_visible_rules('us')} {chart}",
                timeout=20_000,
            )
            assert errors == [], errors  # no CSP violation, no script error
            shot = os.environ.get("CONSOLE_SCREENSHOT") or str(tmp_path / "console.png")
            await page.screenshot(path=shot, full_page=True)
            assert Path(shot).stat().st_size > 10_000
            await browser.close()
    finally:
        gateway.stop()


async def test_with_workers_the_history_counts_every_workers_requests(
    tmp_path, upstream, redis_server
):
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - id: counted\n    identity: api_key\n    limits: {default: 40/600}\n"
    )
    gateway = GatewayProcess(
        ["--workers", "2", "--redis-url", redis_server.url, "--rules", str(rules),
         "--upstream", upstream, "--no-embedded", "--data-dir", str(tmp_path),
         "--access-log", "off"],
        log_path=tmp_path / "gateway.log",
    )  # fmt: skip
    try:
        await asyncio.to_thread(gateway.wait_ready)
        # a new connection per request, so SO_REUSEPORT spreads them over both workers
        connector = aiohttp.TCPConnector(limit=10, force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def one(i: int) -> int:
                async with http.get(f"{gateway.url}/w/{i}", headers={"x-api-key": "k1"}) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(*(one(i) for i in range(100)))
        assert statuses.count(200) == 40 and statuses.count(429) == 60
        admin = f"http://127.0.0.1:{gateway.admin_port}"
        async with aiohttp.ClientSession() as http:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                async with http.get(admin + "/console/api/history") as r:
                    assert r.status == 200
                    data = await r.json()
                (row,) = [x for x in data["rules"] if x["rule"] == "counted"]
                totals = row.get("total", {})
                top = data["top_limited"]
                # a worker writes its metrics, then its refusals: wait for both
                refusals = sum(t["refusals"] for t in top)
                if (totals.get("allowed"), totals.get("limited"), refusals) == (40, 60, 60):
                    break
                assert asyncio.get_running_loop().time() < deadline, (row, top)
                await asyncio.sleep(0.5)
            # both workers' refusals, one identity, hashed as logged
            (only,) = top
            assert re.fullmatch(r"api_key:[0-9a-f]{12}", only["identity"])
            assert only["refusals"] == 60 and only["rules"] == ["counted"]
            assert only["consumer"] is None
            async with http.get(admin + "/console/api/history?region=mars") as r:
                assert r.status == 422 and "mars" in (await r.json())["detail"]
    finally:
        gateway.stop()
