"""``gateway data copy --to postgresql://...``: a SQLite Store and control plane copied into
PostgreSQL lose nothing, answer the same afterwards, and a second run changes nothing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import aiohttp

from gateway.upstreams.store.config import StoreConfig
from tests.control_plane.support import (
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from tests.store.store_support import REPO_ROOT, start_store


def _copy(data_dir: Path, url: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "data", "copy", "--to", url, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def _snapshot(store_url: str, cp_url: str) -> dict:
    async with aiohttp.ClientSession() as http:
        async with http.post(store_url + "/store/items/search", json={"limit": 1000}) as r:
            items = (await r.json())["items"]
        async with http.post(store_url + "/store/namespaces", json={}) as r:
            namespaces = (await r.json())["namespaces"]
        async with http.get(cp_url + "/v2/deployments", headers=headers()) as r:
            deployments = (await r.json())["resources"]
        revisions = {}
        for d in deployments:
            async with http.get(
                f"{cp_url}/v2/deployments/{d['id']}/revisions", headers=headers()
            ) as r:
                revisions[d["id"]] = (await r.json())["resources"]
    return {"items": items, "namespaces": namespaces, "deployments": deployments,
            "revisions": revisions}  # fmt: skip


async def test_copy_loses_nothing_and_can_run_twice(pg_database_url: str, tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    sqlite_store = StoreConfig(data_dir=data_dir, refresh_ttl_on_read=False)
    sqlite_cp = make_config(data_dir, step=3600)  # revisions stay where they are
    store = await start_store(sqlite_store)
    try:
        async with running_control_plane(sqlite_cp) as cp, aiohttp.ClientSession() as http:
            for n in range(120):
                value = {"text": f"note {n} about coffee", "n": n, "é": [1.5, None]}
                item = {"namespace": ["users", f"u{n % 7}"], "key": f"k{n}", "value": value}
                if n % 10 == 0:
                    item["ttl"] = 600
                async with http.put(store.url + "/store/items", json=item) as r:
                    assert r.status == 204
            for n in range(3):
                async with http.post(
                    cp.url + "/v2/deployments", json=deployment_body(f"d{n}"), headers=headers()
                ) as r:
                    assert r.status == 201
            before = await _snapshot(store.url, cp.url)
    finally:
        await store.runner.cleanup()

    first = _copy(data_dir, pg_database_url)
    assert "store items: 120 row(s) copied, 120 in PostgreSQL" in first
    assert "deployments: 3 row(s) copied, 3 in PostgreSQL" in first
    second = _copy(data_dir, pg_database_url)  # again: the same rows, none added
    assert (
        "store items: 0 row(s) copied, 120 in PostgreSQL "
        "(0 added, 0 updated, 120 already up to date)" in second
    )
    assert (
        "deployments: 0 row(s) copied, 3 in PostgreSQL "
        "(0 added, 0 updated, 3 already up to date)" in second
    )

    pg_store = await start_store(dataclasses.replace(sqlite_store, database_url=pg_database_url))
    try:
        pg_cp = dataclasses.replace(sqlite_cp, database_url=pg_database_url)
        async with running_control_plane(pg_cp) as cp:
            after = await _snapshot(pg_store.url, cp.url)
            # New rows get fresh ids after the copied ones.
            async with aiohttp.ClientSession() as http:
                async with http.post(
                    cp.url + "/v2/deployments", json=deployment_body("new"), headers=headers()
                ) as r:
                    assert r.status == 201
    finally:
        await pg_store.runner.cleanup()
    assert after == before
