"""Parsing request bodies is shared out per client address (one client must not freeze the
others): the built-in Store and control plane parse JSON on the event loop the proxy port
shares, and a body of nested arrays holds it for a tenth of a second or more. 127.0.0.2
attacks; 127.0.0.3 must still be served. `gateway serve` as users run it (the built-in
upstreams behind the proxy, one parse budget for both), with a burst small enough that
one costly body spends it. The budget's arithmetic: tests/unit/test_parse_budget.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from tests.support.gateway import GatewayProcess
from tests.support.redis_servers import RedisServer

ATTACKER = "127.0.0.2"
CLIENT = "127.0.0.3"
JSON = {"Content-Type": "application/json"}


def _costly(key: str) -> bytes:
    """An item of 40,000 one-element arrays (the walk's worst shape, SECURITY.md): tens of
    milliseconds to parse on a quick machine, a hundred or more on a slow one."""
    value = "[" + ",".join(["[0]"] * 40_000) + "]"
    return ('{"namespace":["fair"],"key":"' + key + '","value":{"v":' + value + "}}").encode()


def _small(key: str) -> bytes:
    return json.dumps({"namespace": ["fair"], "key": key, "value": {"a": 1}}).encode()


def _serve(tmp_path: Path, share: float):
    config = tmp_path / "gateway.yaml"
    # One costly body puts its address past its share at once (the default burst lets an
    # idle address take a quarter of a second first), for long (a tiny share refills
    # slowly: whatever the machine's speed, the refusals below come well within it); all
    # addresses together keep the default's total.
    config.write_text(
        f"store:\n  body_parse_share: {share}\n  body_parse_burst_seconds: 0.001\n"
        "  body_parse_total_burst_seconds: 1.25\n"
    )
    data = tmp_path / "data"
    return GatewayProcess(
        ["--config", str(config), "--data-dir", str(data), "--access-log", "off"],
        log_path=tmp_path / "gw.log",
    ).wait_ready(), data


@pytest.fixture
def gateway(tmp_path: Path):
    gw, data = _serve(tmp_path, 0.001)
    try:
        yield gw, data
    finally:
        gw.stop()


async def _call(
    url: str, method: str, path: str, source: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, str], bytes]:
    connector = aiohttp.TCPConnector(local_addr=(source, 0))
    async with (
        aiohttp.ClientSession(url, connector=connector) as http,
        http.request(method, path, data=body, headers={**JSON, **headers}) as r,
    ):
        return r.status, dict(r.headers), await r.read()


def _refused(answer: tuple[int, dict[str, str], bytes], status: int = 429) -> int:
    code, headers, body = answer
    assert code == status, body
    assert "share of the server's time for parsing request bodies" in json.loads(body)["detail"]
    retry = int(headers["Retry-After"])
    assert retry >= 1
    return retry


async def test_an_address_past_its_parse_share_is_refused_and_the_others_are_served(gateway):
    gw, _ = gateway
    put = "/store/items"
    assert (await _call(gw.url, "PUT", put, ATTACKER, _costly("a1")))[0] == 204
    # Its next body is refused before it is parsed, however small, for the time its
    # share needs to make up what the last one cost.
    _refused(await _call(gw.url, "PUT", put, ATTACKER, _small("a2")))
    # Naming another client does not give it that client's share: the gateway writes the
    # address it saw, and the Store believes only the gateway.
    _refused(await _call(gw.url, "PUT", put, ATTACKER, _small("a3"), **{"X-Forwarded-For": CLIENT}))
    # Every other address has its own.
    assert (await _call(gw.url, "PUT", put, CLIENT, _costly("c1")))[0] == 204
    got = await _call(gw.url, "GET", "/store/items?namespace=fair&key=c1", CLIENT)
    assert got[0] == 200 and json.loads(got[2])["key"] == "c1"
    # Reading is not parsing: the attacker's GET is answered.
    assert (await _call(gw.url, "GET", "/store/items?namespace=fair&key=a1", ATTACKER))[0] == 200
    # Operators see it on the admin port: two refusals, time charged, one address in debt.
    got = await _metrics(gw)
    assert got['gateway_builtin_body_refusals_total{status="429"}'] == 2.0
    assert got['gateway_builtin_body_refusals_total{status="503"}'] == 0.0
    assert got["gateway_builtin_body_parse_seconds_total"] > 0
    assert got["gateway_builtin_body_parse_debts_total"] >= 1.0


async def _metrics(gw: GatewayProcess) -> dict[str, float]:
    """The admin port's /metrics, the samples of the parse budget's families."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"http://127.0.0.1:{gw.admin_port}/metrics") as r,
    ):
        assert r.status == 200
        text = await r.text()
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in text.splitlines())
        if name.startswith("gateway_builtin_body_")
    }


async def test_with_workers_the_built_in_apis_budget_is_on_the_supervisors_metrics(
    tmp_path: Path, redis_server: RedisServer
):
    # --workers: the built-in APIs run in the supervisor, whose admin port serves every
    # worker's metrics and the budget's.
    config = tmp_path / "gateway.yaml"
    config.write_text("store:\n  body_parse_share: 0.001\n  body_parse_burst_seconds: 0.001\n")
    gw = GatewayProcess(
        ["--config", str(config), "--data-dir", str(tmp_path / "data"), "--access-log", "off",
         "--workers", "2", "--redis-url", redis_server.url],
        log_path=tmp_path / "gw.log",
    ).wait_ready()  # fmt: skip
    try:
        assert (await _call(gw.url, "PUT", "/store/items", ATTACKER, _costly("a1")))[0] == 204
        _refused(await _call(gw.url, "PUT", "/store/items", ATTACKER, _small("a2")))
        got = await _metrics(gw)
        assert got['gateway_builtin_body_refusals_total{status="429"}'] == 1.0
        assert got["gateway_builtin_body_parse_debts_total"] == 1.0
    finally:
        gw.stop()


async def test_a_refused_address_is_served_again_after_retry_after(tmp_path: Path):
    # A share of 5 %: Retry-After is 20 s for every second of CPU the body took (a
    # fraction of a second, so a few seconds here), and at least a second.
    gw, _ = _serve(tmp_path, 0.05)
    try:
        assert (await _call(gw.url, "PUT", "/store/items", ATTACKER, _costly("a1")))[0] == 204
        retry = _refused(await _call(gw.url, "PUT", "/store/items", ATTACKER, _small("a2")))
        await asyncio.sleep(retry)
        assert (await _call(gw.url, "PUT", "/store/items", ATTACKER, _small("a2")))[0] == 204
    finally:
        gw.stop()


async def test_bodies_that_fail_are_charged_and_both_apis_share_one_budget(gateway):
    """A body the model refuses was parsed all the same; and the Store and the control
    plane run on one event loop, so what an address spent on one counts on the other."""
    gw, data = gateway
    credential = json.loads((data / "control-plane-credential.json").read_text())
    auth = {"X-Api-Key": credential["api_key"], "X-Tenant-Id": credential["tenant_id"]}
    costly = b'{"name":' + b"[" + b",".join([b"[0]"] * 40_000) + b"]}"
    status, _, body = await _call(gw.url, "POST", "/v2/deployments", ATTACKER, costly, **auth)
    assert status == 422, body
    _refused(await _call(gw.url, "PUT", "/store/items", ATTACKER, _small("a1")))
    small = json.dumps({"name": "x"}).encode()
    _refused(await _call(gw.url, "POST", "/v2/deployments", ATTACKER, small, **auth))
    status, _, body = await _call(gw.url, "POST", "/v2/deployments", CLIENT, small, **auth)
    assert status == 422, body  # parsed (and refused by the model: no source given)


async def test_a_refused_address_is_not_asked_for_its_body(gateway):
    """``Expect: 100-continue`` from an address past its share is answered with the
    refusal at once: no ``100 Continue``, so the body is never sent."""
    gw, _data = gateway
    assert (await _call(gw.url, "PUT", "/store/items", ATTACKER, _costly("a1")))[0] == 204
    store = next(
        line.rsplit(" ", 1)[1]
        for line in gw.log_text().splitlines()
        if "built-in store listening on" in line
    )
    host, port = store.removeprefix("http://").split(":")
    # Straight to the built-in port, as the gateway's own connection would come: from
    # loopback, naming the client in X-Forwarded-For.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"PUT /store/items HTTP/1.1\r\nHost: s\r\nContent-Type: application/json\r\n"
        b"Content-Length: 60\r\nExpect: 100-continue\r\n"
        + b"X-Forwarded-For: "
        + ATTACKER.encode()
        + b"\r\n\r\n"
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    writer.close()
    assert head.startswith(b"HTTP/1.1 429 "), head
    assert b"100 Continue" not in head and b"retry-after: " in head.lower()
