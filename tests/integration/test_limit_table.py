"""Every row of the service description's limit table, through real HTTP, for us, eu, us2."""

from __future__ import annotations

import re
import uuid

import aiohttp
import pytest

from gateway.policy.model import IdentityKind
from gateway.ratelimit.limiter import limit_checks
from gateway.ratelimit.window import bucket_ms_for
from tests.support.gateway import running_gateway

RUN = "123e4567-e89b-12d3-a456-426614174000"

# (rule id, method, path, identity kind, us limit, eu limit) — straight from the table.
ROWS = [
    ("high-throughput-ip", "OPTIONS", "/anything/at/all", "ip", (2000, 10), (2000, 10)),
    ("high-throughput-ip", "GET", "/info", "ip", (2000, 10), (2000, 10)),
    ("high-throughput-ip", "POST", "/a/b/v1/metadata/submit", "ip", (2000, 10), (2000, 10)),
    ("auth-api-key", "GET", "/auth/login", "api_key", (2000, 10), (2000, 10)),
    ("auth-user", "POST", "/auth", "user_ip", (2000, 10), (2000, 10)),
    ("beacon", "POST", "/v1/beacon", "ip", (2000, 10), (2000, 10)),
    ("repos-api-key", "GET", "/repos/owner/name", "api_key", (100, 60), (100, 60)),
    ("repos-user", "GET", "/repos", "user_ip", (100, 60), (100, 60)),
    ("runs-batch", "POST", "/runs/batch", "api_key", (2000, 10), (2000, 10)),
    ("otel-traces", "POST", "/otel/v1/traces", "api_key", (2000, 10), (2000, 10)),
    ("charts-api-key", "POST", "/sessions/s1/charts", "api_key", (750, 600), (750, 600)),
    ("charts-user", "POST", "/charts/section", "user_ip", (750, 600), (750, 600)),
    ("runs-multipart", "POST", "/runs/multipart", "api_key", (6000, 10), (6000, 10)),
    ("runs-query-api-key", "POST", "/runs/query", "api_key", (15, 10), (15, 10)),
    ("runs-query-user", "POST", "/runs/query", "user_ip", (300, 10), (300, 10)),
    ("generate-api-key", "POST", "/generate/text", "api_key", (30, 3600), (30, 3600)),
    ("generate-user", "GET", "/generate", "user_ip", (30, 3600), (30, 3600)),
    ("commits-api-key", "GET", "/commits/o/r", "api_key", (10000, 60), (2000, 60)),
    ("commits-user", "POST", "/commits", "user_ip", (10000, 60), (2000, 60)),
    ("deletion-api-key", "DELETE", "/sessions/abc", "api_key", (10, 60), (10, 60)),
    ("deletion-api-key", "POST", "/jobs/j1/trigger", "api_key", (10, 60), (10, 60)),
    ("deletion-user", "DELETE", "/sessions", "user_ip", (30, 60), (30, 60)),
    ("runs-ingest", "POST", "/runs", "api_key", (2000, 10), (2000, 10)),
    ("runs-patch", "PATCH", f"/runs/{RUN}", "api_key", (2000, 10), (2000, 10)),
    ("feedback", "POST", "/feedback", "api_key", (2000, 10), (2000, 10)),
    ("run-lookup", "GET", f"/runs/{RUN}", "api_key", (30, 60), (30, 60)),
    ("run-lookup", "GET", f"/api/v1/runs/{RUN}", "api_key", (30, 60), (30, 60)),
    ("examples", "GET", "/datasets/d1/examples", "api_key", (5000, 60), (5000, 60)),
    ("default-api-key", "GET", "/anything", "api_key", (1000, 10), (1000, 10)),
    ("default-user", "GET", "/anything", "user_ip", (1000, 10), (1000, 10)),
    ("public-download", "GET", "/public/download/file", "ip", (5000, 60), (5000, 60)),
    ("public-download", "GET", "/public/download", "api_key-header-only", (5000, 60), (5000, 60)),
    ("runs-stats", "GET", "/runs/stats", "api_key", (1, 10), (20, 10)),
    ("catch-all", "GET", "/anything", "ip", (100, 60), (100, 60)),
    ("catch-all", "GET", "/auth/no-identity-headers", "ip", (100, 60), (100, 60)),
    ("catch-all", "GET", "/runs/not-a-uuid", "ip", (100, 60), (100, 60)),
]

POLICY = re.compile(r'^"(?P<name>[a-z0-9.-]+)";q=(?P<q>\d+);w=(?P<w>\d+)$')
STATE = re.compile(r'^"(?P<name>[a-z0-9.-]+)";r=(?P<r>\d+);t=(?P<t>\d+)$')


def _headers(kind: str) -> dict[str, str]:
    if kind in ("api_key", "api_key-header-only"):
        return {"x-api-key": f"key-{uuid.uuid4()}"}
    if kind == "user_ip":
        return {"x-user-id": f"user-{uuid.uuid4()}"}
    return {}


def _identity_value(kind: str, headers: dict[str, str]) -> tuple[IdentityKind, str]:
    if kind == "api_key":
        return IdentityKind.API_KEY, headers["x-api-key"]
    if kind == "user_ip":
        return IdentityKind.USER_IP, f"{headers['x-user-id']}\x00127.0.0.1"
    return IdentityKind.IP, "127.0.0.1"


# The default table's per-address ceiling, listed after the rule on every answer.
CEILING = '"per-address";q=36000;w=10'


def _check_headers(response: aiohttp.ClientResponse, rule_id: str, count: int, seconds: int):
    rule_policy, _, ceiling_policy = response.headers["RateLimit-Policy"].partition(", ")
    assert ceiling_policy == CEILING, response.headers
    policy = POLICY.match(rule_policy)
    states = response.headers["RateLimit"].split(", ")
    # an answer states each policy; a refusal only the one that refused (the rule here)
    assert len(states) == (1 if response.status == 429 else 2), response.headers
    state = STATE.match(states[0])
    assert policy and state, response.headers
    assert policy["name"] == state["name"] == rule_id
    assert (int(policy["q"]), int(policy["w"])) == (count, seconds)
    return int(state["r"]), int(state["t"])


@pytest.mark.parametrize("region", ["us", "eu", "us2"])
@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]}:{r[1]}:{r[2]}" for r in ROWS])
async def test_row(row, region, upstream):
    rule_id, method, path, kind, us, eu = row
    count, seconds = eu if region == "eu" else us  # us2 takes the us values
    # The oldest sub-bucket is counted whole, so a slot frees at most one bucket late.
    latest = seconds + -(-bucket_ms_for(seconds * 1000) // 1000)
    headers = _headers(kind)
    async with running_gateway(upstream, region=region) as gw, aiohttp.ClientSession() as http:
        url = gw.url + path
        sent_over_http = min(count, 60)
        for n in range(sent_over_http):
            if n == sent_over_http - 2 and count > sent_over_http:
                await _prefill(gw, region, rule_id, kind, headers, count - sent_over_http)
            async with http.request(method, url, headers=headers) as r:
                assert r.status == 200, await r.text()
                remaining, reset = _check_headers(r, rule_id, count, seconds)
                assert 0 <= reset <= latest
                if count == sent_over_http:
                    assert remaining == count - n - 1
        assert remaining == 0
        async with http.request(method, url, headers=headers) as r:
            assert r.status == 429
            assert r.headers["Content-Type"].startswith("application/json")
            retry_after = int(r.headers["Retry-After"])
            assert 1 <= retry_after <= latest
            remaining, reset = _check_headers(r, rule_id, count, seconds)
            assert remaining == 0 and reset == retry_after
            detail = (await r.json())["detail"]
            assert rule_id in detail and str(retry_after) in detail


async def _prefill(gw, region, rule_id, kind, headers, n):
    """Count n requests straight into the gateway's own counters (same keys it uses), so
    rows with limits in the thousands do not need thousands of HTTP calls."""
    rule = gw.rules.table.by_id(rule_id)
    identity_kind, value = _identity_value(kind if kind != "api_key-header-only" else "ip", headers)
    identity_hash = gw.gateway.hasher.digest(identity_kind, value)
    checks = limit_checks(region, rule, identity_hash, True)
    backend = gw.gateway.limiter.backend(region)
    for _ in range(n):
        assert (await backend.hit(checks)).admitted


async def test_identities_are_kept_apart(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        url = gw.url + "/runs/query"
        for _ in range(15):
            async with http.post(url, headers={"x-api-key": "key-a"}) as r:
                assert r.status == 200
        async with http.post(url, headers={"x-api-key": "key-a"}) as r:
            assert r.status == 429
        async with http.post(url, headers={"x-api-key": "key-b"}) as r:
            assert r.status == 200  # another key, another counter


async def test_one_user_from_two_addresses_has_two_counters(upstream):
    async with running_gateway(upstream) as gw:
        url = gw.url + "/runs/stats"  # not user-limited: use the user default rule instead
        url = gw.url + "/generate"
        sessions = [
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(addr, 0)))
            for addr in ("127.0.0.1", "127.0.0.2")
        ]
        try:
            for _ in range(30):
                async with sessions[0].get(url, headers={"x-user-id": "u1"}) as r:
                    assert r.status == 200
            async with sessions[0].get(url, headers={"x-user-id": "u1"}) as r:
                assert r.status == 429
            async with sessions[1].get(url, headers={"x-user-id": "u1"}) as r:
                assert r.status == 200  # same user, other address
        finally:
            for s in sessions:
                await s.close()


async def test_exempt_health_path_carries_no_headers(upstream):
    async with running_gateway(upstream) as gw, aiohttp.ClientSession() as http:
        for _ in range(300):
            async with http.get(gw.url + "/ok") as r:
                assert r.status == 200
                assert "RateLimit" not in r.headers and "RateLimit-Policy" not in r.headers
                assert await r.json() == {"ok": True}
