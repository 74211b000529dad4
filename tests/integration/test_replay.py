"""Replay equals live: traffic recorded by a gateway counting in Redis, replayed by
``gateway rules simulate`` through the same table, gets exactly the logged decisions."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp

from gateway.policy.loader import load_rules
from gateway.replay.records import NOT_ACCESS_LOG, read_logs
from gateway.replay.simulate import replay
from tests.support.gateway import ROOT, GatewayProcess

RULES = """
rules:
  - id: free
    match: {prefix: /free}
    unlimited: true
  - id: q-shadow
    match: {prefix: /q}
    identity: api_key
    shadow: true
    limits: {default: 3/60}
  - id: q-key
    match: {prefix: /q}
    identity: api_key
    limits: {default: 5/2}
  - id: q-user
    match: {prefix: /q}
    identity: user_ip
    limits: {default: 4/2}
  - id: by-ip
    identity: ip
    limits: {default: 6/2}
"""

# (path, headers, requests) per client, one client per identity: every rule kind,
# enforced, shadow and exempt
BURST = [
    ("/q/a", {"x-api-key": "key-a"}, 12),
    ("/q/b", {"x-api-key": "key-b"}, 7),
    ("/q/c", {"x-user-id": "user-1"}, 9),
    ("/other", {}, 10),
    ("/free", {}, 3),
]


async def _burst(url: str) -> dict[str, int]:
    """Every client of BURST at once, each sending its requests one after the other.

    One client's requests are not in flight together: the order in which Redis counted
    two simultaneous requests of one identity is recorded nowhere (the gateway keeps two
    pipelines in flight), so a replay could give the last slot to the other one."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as http:

        async def client(path, headers, n):
            statuses = []
            for _ in range(n):
                async with http.get(url + path, headers=headers) as r:
                    await r.read()
                    statuses.append(r.status)
            return statuses

        jobs = [client(p, h, n) for p, h, n in BURST]
        statuses = [s for each in await asyncio.gather(*jobs) for s in each]
    return {str(s): statuses.count(s) for s in set(statuses)}


async def _scrape(admin_port: int) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"http://127.0.0.1:{admin_port}/metrics") as r:
            return await r.text()


def _shadow_limited(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("gateway_requests_total{") and 'decision="shadow_limited"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_replay_of_recorded_redis_traffic_gets_the_logged_decisions(
    tmp_path, upstream, redis_server
):
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(
        ["--upstream", upstream, "--rules", str(rules), "--no-embedded", "--access-log", "json",
         "--redis-url", redis_server.url, "--redis-timeout-ms", "3000",
         "--data-dir", str(tmp_path)],
        log_path=log,
    )  # fmt: skip
    try:
        await asyncio.to_thread(gateway.wait_ready)
        seen: list[dict[str, int]] = []
        for phase in range(3):  # windows of 2 s: each phase starts with room again
            if phase:
                await asyncio.sleep(2.5)
            seen.append(await _burst(gateway.url))
        shadow_live = _shadow_limited(await _scrape(gateway.admin_port))
    finally:
        gateway.stop()
    sent = sum(n for _, _, n in BURST) * 3
    assert all(counts.get("429") for counts in seen), seen  # every phase had refusals

    reading = read_logs([log])
    assert reading.skipped[NOT_ACCESS_LOG] > 0  # start-up lines, among the access lines
    ours = [r for r in reading.requests if r.path != "/ok"]  # wait_ready's probes
    assert len(ours) == sent
    (result,) = replay(reading.requests, [load_rules([rules])])
    assert result.compared == len(reading.requests)
    assert result.disagreements == [] and result.agreed == result.compared
    limited = result.decisions["limited"]
    assert limited == sum(c.get("429", 0) for c in seen)
    assert result.rules["q-key"].limited and result.rules["q-user"].limited
    assert result.rules["by-ip"].limited and result.rules["free"].matched == 9
    # the shadow rule would have limited as often as the gateway counted it
    assert result.rules["q-shadow"].limited == shadow_live > 0

    # the command line says the same, and a baseline equal to the new table changes nothing
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "rules", "simulate", "--rules", str(rules),
         "--baseline", str(rules), "--json", str(log)],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert report["new"]["against_log"]["disagreed"] == 0
    assert report["new"]["decisions"]["limited"] == limited
    assert report["diff"]["rules_changed"] == []
    assert report["diff"]["requests_newly_limited"] == 0
    by_id = {r["id"]: r for r in report["new"]["rules"]}
    top = by_id["q-key"]["top_limited"][0]
    assert top["identity"].startswith("api_key:") and "key-a" not in done.stdout
