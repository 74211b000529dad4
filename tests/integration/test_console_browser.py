"""The operator console in a real browser: Playwright driving Debian's chromium.

The page loads, shows the rules table, its rates and charts move when traffic flows
through the gateway (shadow-limited included), the limited identities show hashed, the
saved replay shows, and the explain form answers. (The charts, region selector, filter
and health strip in more depth, and the documentation's screenshot:
test_console_charts.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from benchmarks.replay_log import generate
from gateway.cli import main as gateway_cli
from tests.support.gateway import GatewayProcess

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
RULES = """
rules:
  - id: health
    match: {methods: [GET, HEAD], path: /ok}
    unlimited: true
  - id: runs-query-shadow
    match: {methods: [POST], path: /runs/query}
    identity: api_key
    shadow: true
    limits: {default: 10/60}
  - id: runs-query
    match: {methods: [POST], path: /runs/query}
    identity: api_key
    limits: {default: 15/10}
  - id: catch-all
    identity: ip
    limits: {default: 100/60}
"""


async def _traffic(url: str) -> None:
    async with aiohttp.ClientSession() as http:
        for key in ("key-a", "key-b"):
            for _ in range(25):
                async with http.post(url + "/runs/query", headers={"x-api-key": key}) as r:
                    await r.read()
                    assert r.status in (200, 429)
        for _ in range(5):
            async with http.get(url + "/other") as r:
                await r.read()


async def test_the_console_in_chromium(tmp_path, upstream):
    from playwright.async_api import async_playwright

    assert Path(CHROMIUM).exists(), "install Debian's chromium (scripts/test does it as root)"
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    # a replay saved for the console: runs-query at 30/10 against today's 15/10
    proposed = tmp_path / "proposed.yaml"
    proposed.write_text(RULES.replace("{default: 15/10}", "{default: 30/10}"))
    log = tmp_path / "access.log"
    generate(log, requests=5000, identities=50, seconds=120)
    assert gateway_cli(["rules", "simulate", "--rules", str(proposed), "--baseline", str(rules),
                        "--save", "--data-dir", str(tmp_path), "--no-progress",
                        str(log)]) == 0  # fmt: skip
    gateway = GatewayProcess(
        ["--upstream", upstream, "--rules", str(rules), "--no-embedded",
         "--data-dir", str(tmp_path), "--access-log", "off"],
        log_path=tmp_path / "gateway.log",
    )  # fmt: skip
    try:
        await asyncio.to_thread(gateway.wait_ready)
        console = f"http://127.0.0.1:{gateway.admin_port}/console"
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            violations: list[str] = []
            page.on("console", lambda m: violations.append(m.text) if m.type == "error" else None)
            await page.goto(console)
            rules_table = page.locator('table.rules[data-region="us"]')
            await rules_table.wait_for()
            ids = await rules_table.locator("tbody tr td:nth-child(2)").all_inner_texts()
            assert ids == ["health", "runs-query-shadow", "runs-query", "catch-all"]
            shadow_row = rules_table.locator("tbody tr.shadow")
            assert "shadow" in await shadow_row.inner_text()

            await _traffic(gateway.url)
            # the page's script refreshes the rates and charts: limited and shadow move
            await page.wait_for_function(
                """() => {
                  const row = document.querySelector(
                    'table.rules[data-region="us"] tr[data-rule="runs-query"]');
                  return row && parseFloat(row.querySelector('td.limited').textContent) > 0
                      && parseFloat(row.querySelector('td.allowed').textContent) > 0
                      && row.querySelector('svg.chart path.limited');
                }""",
                timeout=20_000,
            )
            await page.wait_for_function(
                """() => document.querySelector('table.rules[data-region="us"] '
                    + 'tr[data-rule="runs-query-shadow"] svg.chart polyline.shadow')""",
                timeout=20_000,
            )
            replay = await page.locator("#replay").inner_text()
            assert "runs-query" in replay and "5,000 requests" in await page.content()
            await page.wait_for_function(
                "() => document.querySelector('#top-limited tbody').textContent"
                ".includes('api_key:')",
                timeout=20_000,
            )
            limited = await page.locator("#top-limited tbody").inner_text()
            assert "runs-query" in limited and "key-a" not in limited

            await page.fill('#explain input[name="method"]', "POST")
            await page.fill('#explain input[name="path"]', "/runs//query/")
            await page.fill('#explain textarea[name="headers"]', "x-api-key: sk-typed-here")
            await page.click('#explain button[type="submit"]')
            answer = page.locator("#explain-answer")
            await page.wait_for_function(
                "() => document.getElementById('explain-answer').textContent.length > 0"
            )
            text = await answer.inner_text()
            assert "runs-query: MATCHES" in text and "15/10" in text
            assert "normalised from /runs//query/" in text and "sk-typed-here" not in text
            assert violations == [], violations  # no CSP violation, no script error
            shot = tmp_path / "console.png"
            await page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            await browser.close()
    finally:
        gateway.stop()
