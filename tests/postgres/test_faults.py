"""PostgreSQL killed under traffic: the Store and control plane answer 503 quickly, the rate
limiter and proxy keep working, service comes back by itself, nothing acknowledged is lost.

This test owns its PostgreSQL server (it kills it), separate from the session's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import aiohttp

from gateway.upstreams.store.config import StoreConfig
from tests.control_plane.support import (
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from tests.store.store_support import start_store
from tests.support.gateway import running_gateway
from tests.support.postgres_server import postgres_server

TIMEOUT = 1.0  # database_timeout_seconds of both built-ins
# A request may wait for the pool (TIMEOUT), then for one statement (TIMEOUT): the bound on
# an answer while the database is away, with room for a loaded machine.
ANSWER_BOUND = 4 * TIMEOUT + 2


async def _timed(http: aiohttp.ClientSession, method: str, url: str, **kw):
    started = time.monotonic()
    async with http.request(method, url, **kw) as r:
        body = await r.json(content_type=None)
        return r.status, body, time.monotonic() - started


async def test_database_killed_under_traffic_then_back(tmp_path: Path) -> None:
    with postgres_server() as server:
        url = server.create_database()
        store = await start_store(
            StoreConfig(data_dir=tmp_path, database_url=url, database_timeout_seconds=TIMEOUT)
        )
        cp_config = dataclasses.replace(
            make_config(tmp_path / "cp", step=0.05),
            database_url=url,
            database_timeout_seconds=TIMEOUT,
        )
        try:
            async with (
                running_control_plane(cp_config) as cp,
                running_gateway(None, builtin={"store": store.url, "control-plane": cp.url}) as gw,
                aiohttp.ClientSession() as http,
            ):
                acknowledged: list[str] = []
                stop = asyncio.Event()

                async def writer() -> None:
                    n = 0
                    while not stop.is_set():
                        n += 1
                        item = {"namespace": ["f"], "key": f"k{n}", "value": {"n": n}}
                        try:
                            async with http.put(store.url + "/store/items", json=item) as r:
                                if r.status == 204:
                                    acknowledged.append(f"k{n}")
                        except aiohttp.ClientError:
                            pass

                async with http.post(
                    cp.url + "/v2/deployments", json=deployment_body("survivor"), headers=headers()
                ) as r:
                    assert r.status == 201
                    deployment = (await r.json())["id"]
                writers = [asyncio.create_task(writer()) for _ in range(4)]
                while len(acknowledged) < 200:
                    await asyncio.sleep(0.01)
                await asyncio.to_thread(server.kill)
                await asyncio.sleep(0.2)
                before_recovery = len(acknowledged)

                # The Store and control plane: a quick 503 with a JSON detail, never a 500.
                for _ in range(3):
                    status, body, took = await _timed(
                        http, "GET", gw.url + "/store/items", params={"namespace": "f", "key": "k1"}
                    )
                    assert status == 503, body
                    assert "unavailable" in body["detail"]
                    assert took < ANSWER_BOUND
                    status, body, took = await _timed(
                        http, "GET", gw.url + "/v2/deployments", headers=headers()
                    )
                    assert status == 503, body
                    assert set(body) == {"detail"}
                    assert took < ANSWER_BOUND
                # The proxy and the rate limiter carry on: health, and limits on other paths.
                status, body, _ = await _timed(http, "GET", gw.url + "/ok")
                assert status == 200
                async with http.post(gw.url + "/runs/query", headers={"x-api-key": "k"}) as r:
                    assert r.status == 404
                    assert r.headers["RateLimit-Policy"]

                await asyncio.to_thread(server.start)  # same data, same port
                deadline = time.monotonic() + 60
                while True:
                    status, body, _ = await _timed(
                        http, "GET", gw.url + "/store/items", params={"namespace": "f", "key": "k1"}
                    )
                    if status == 200 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                assert status == 200
                assert body["value"] == {"n": 1}
                while len(acknowledged) < before_recovery + 50:  # writes flow again
                    await asyncio.sleep(0.05)
                stop.set()
                await asyncio.gather(*writers)

                # Nothing acknowledged was lost, before or across the crash.
                search = {"namespace_prefix": ["f"], "limit": 1000}
                stored: set[str] = set()
                offset = 0
                while True:
                    async with http.post(
                        store.url + "/store/items/search", json={**search, "offset": offset}
                    ) as r:
                        page = (await r.json())["items"]
                    stored.update(item["key"] for item in page)
                    if len(page) < 1000:
                        break
                    offset += 1000
                assert set(acknowledged) <= stored
                # The control plane's own breaker closes after its next probe (at most
                # database_retry_seconds after the database is back): until then, 503.
                deadline = time.monotonic() + 60
                while True:
                    status, body, _ = await _timed(
                        http, "GET", f"{gw.url}/v2/deployments/{deployment}", headers=headers()
                    )
                    if status != 503 or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.2)
                assert status == 200
                assert body["name"] == "survivor"
        finally:
            await store.runner.cleanup()
