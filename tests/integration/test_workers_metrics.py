"""--workers 2: one scrape of the admin port counts every worker's requests, exactly, also
across a worker's restart."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import GatewayProcess

RULES = """
rules:
  - id: counted
    identity: ip
    limits: {default: 100000/60}
"""


async def _send(url: str, n: int) -> None:
    # a new connection per request, so SO_REUSEPORT spreads them over both workers
    connector = aiohttp.TCPConnector(limit=20, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(i: int) -> int:
            async with http.get(f"{url}/w/{i}") as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(n)))
    assert statuses == [200] * n


async def _allowed(admin_port: int) -> float:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
            text = await r.text()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gateway_requests_total" and s.labels.get("decision") == "allowed":
                total += s.value
    return total


async def _breaker_pids(admin_port: int) -> set[int]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
            text = await r.text()
    return {
        int(s.labels["pid"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gateway_counter_breaker_state"
    }


async def _settles_at(admin_port: int, expected: int) -> None:
    """The scrape reaches ``expected`` within a few sync intervals and never passes it."""
    deadline = time.monotonic() + 10
    seen = await _allowed(admin_port)
    while seen != expected and time.monotonic() < deadline:
        assert seen < expected, seen
        await asyncio.sleep(0.25)
        seen = await _allowed(admin_port)
    assert seen == expected
    await asyncio.sleep(2.5)  # two more syncs: still exactly that
    assert await _allowed(admin_port) == expected


def _pids(log_text: str) -> list[int]:
    found = re.search(r"started 2 workers on port \d+ \(pids ([\d, ]+)\)", log_text)
    assert found, log_text
    return [int(p) for p in found.group(1).split(", ")]


async def test_one_scrape_counts_both_workers_exactly_across_a_restart(
    tmp_path, upstream, redis_server
):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(
        ["--workers", "2", "--upstream", upstream, "--rules", str(rules), "--no-embedded",
         "--redis-url", redis_server.url, "--redis-timeout-ms", "3000",
         "--data-dir", str(tmp_path), "--access-log", "off"],
        log_path=log,
    )  # fmt: skip
    try:
        await asyncio.to_thread(gateway.wait_ready)
        started = time.monotonic()
        probes = await _allowed(gateway.admin_port)  # wait_ready's /ok: exempt, not counted
        assert probes == 0
        await _send(gateway.url, 300)
        await _settles_at(gateway.admin_port, 300)
        pids = _pids(log.read_text())
        assert await _breaker_pids(gateway.admin_port) == set(pids)  # one series per worker

        # kill -9 one worker (after the supervisor's start-up grace): its counts stay,
        # its replacement counts on from zero in files of its own
        await asyncio.sleep(max(0.0, 10.5 - (time.monotonic() - started)))
        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while "starting it again" not in log.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.to_thread(gateway.wait_ready)
        await _settles_at(gateway.admin_port, 300)
        await _send(gateway.url, 200)
        await _settles_at(gateway.admin_port, 500)
        now = await _breaker_pids(gateway.admin_port)
        assert len(now) == 2 and pids[0] not in now and pids[1] in now
        # the supervisor's console: the rules, and every worker's requests in the rates
        async with aiohttp.ClientSession() as http:
            admin = f"http://127.0.0.1:{gateway.admin_port}"
            async with http.get(admin + "/console") as r:
                assert r.status == 200 and "<td>counted</td>" in await r.text()
            async with http.get(admin + "/info") as r:
                info = await r.json()
            assert info["workers"] == 2 and info["rules"]["count"] == 1
            assert info["regions"][0]["healthy"] is True
            async with http.get(admin + "/console/api/rates") as r:
                rows = (await r.json())["rates"]
            assert [row["allowed_total"] for row in rows if row["rule"] == "counted"] == [500]
    finally:
        gateway.stop()
