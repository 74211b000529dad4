"""Several gateways on one PostgreSQL database: one Store, one control plane.

Each "instance" here is a full Store or control-plane application with its own connection
pool, as a gateway on another host would have.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from pathlib import Path

import aiohttp
import psycopg

from gateway.upstreams.control_plane.lifecycle import REVISION_FLOW
from gateway.upstreams.store.app import STORAGE_KEY
from gateway.upstreams.store.config import StoreConfig
from tests.control_plane.support import (
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from tests.store.store_support import FakeClock, start_store


async def test_a_write_acknowledged_by_one_is_read_by_the_other_at_once(
    pg_database_url: str, tmp_path: Path
) -> None:
    config = StoreConfig(data_dir=tmp_path, database_url=pg_database_url)
    a, b = await start_store(config), await start_store(config)
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(50):
                writer, reader = (a, b) if n % 2 else (b, a)
                item = {"namespace": ["multi"], "key": f"k{n}", "value": {"n": n}}
                async with http.put(writer.url + "/store/items", json=item) as r:
                    assert r.status == 204
                params = {"namespace": "multi", "key": f"k{n}"}
                async with http.get(reader.url + "/store/items", params=params) as r:
                    assert (await r.json())["value"] == {"n": n}
                async with http.delete(
                    reader.url + "/store/items", json={"namespace": ["multi"], "key": f"k{n}"}
                ) as r:
                    assert r.status == 204
                async with http.get(writer.url + "/store/items", params=params) as r:
                    assert await r.json() is None
    finally:
        await a.runner.cleanup()
        await b.runner.cleanup()


async def test_concurrent_puts_of_one_key_end_in_one_written_value(
    pg_database_url: str, tmp_path: Path
) -> None:
    config = StoreConfig(data_dir=tmp_path, database_url=pg_database_url)
    stores = [await start_store(config) for _ in range(3)]
    try:
        async with aiohttp.ClientSession() as http:

            async def put(n: int) -> int:
                item = {"namespace": ["race"], "key": "one", "value": {"writer": n}}
                async with http.put(stores[n % 3].url + "/store/items", json=item) as r:
                    return r.status

            statuses = await asyncio.gather(*(put(n) for n in range(150)))
            assert set(statuses) == {204}
            params = {"namespace": "race", "key": "one"}
            async with http.get(stores[0].url + "/store/items", params=params) as r:
                final = await r.json()
        assert final["value"]["writer"] in range(150)
        async with aiohttp.ClientSession() as http:
            search = {"namespace_prefix": ["race"], "limit": 10}
            async with http.post(stores[1].url + "/store/items/search", json=search) as r:
                assert len((await r.json())["items"]) == 1
    finally:
        for store in stores:
            await store.runner.cleanup()


async def test_sweepers_on_every_instance_delete_each_expired_item_once(
    pg_database_url: str, tmp_path: Path
) -> None:
    clock = FakeClock()
    config = StoreConfig(
        data_dir=tmp_path, database_url=pg_database_url, sweep_interval_seconds=3600
    )
    stores = [await start_store(config, clock) for _ in range(3)]
    try:
        async with aiohttp.ClientSession() as http:
            for n in range(0, 1600, 100):
                await asyncio.gather(
                    *(
                        http.put(
                            stores[0].url + "/store/items",
                            json={"namespace": ["ttl"], "key": f"k{i}", "value": {}, "ttl": 1},
                        )
                        for i in range(n, n + 100)
                    )
                )
        storages = [store.app[STORAGE_KEY] for store in stores]
        assert await storages[0].count_items() == 1600
        clock.advance(120)
        removed = await asyncio.gather(*(s.sweep_expired() for s in storages))
        assert sum(removed) == 1600  # each deleted once, none counted twice
        assert await storages[2].count_items() == 0
    finally:
        for store in stores:
            await store.runner.cleanup()


async def test_lifecycle_on_two_instances_advances_each_revision_once_in_order(
    pg_database_url: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path / "data", step=0.05)
    config = config.__class__(**{**config.__dict__, "database_url": pg_database_url})
    async with running_control_plane(config) as a, running_control_plane(config) as b:
        # Record every status change the database sees (a real trigger, not the app's word).
        with psycopg.connect(pg_database_url, autocommit=True) as conn:
            conn.execute(
                """
                CREATE TABLE status_log (revision text, old text, new text, seq bigserial);
                CREATE FUNCTION log_status() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN
                  IF NEW.status <> OLD.status THEN
                    INSERT INTO status_log (revision, old, new)
                    VALUES (NEW.id, OLD.status, NEW.status);
                  END IF;
                  RETURN NEW;
                END $$;
                CREATE TRIGGER revisions_log AFTER UPDATE ON revisions
                  FOR EACH ROW EXECUTE FUNCTION log_status();
                """
            )
        async with aiohttp.ClientSession() as http:
            ids = []
            for n in range(6):
                base = (a, b)[n % 2].url
                async with http.post(
                    base + "/v2/deployments", json=deployment_body(f"d{n}"), headers=headers()
                ) as r:
                    assert r.status == 201, await r.text()
                    ids.append((await r.json())["id"])
            # Every deployment, created through either instance, is seen by both.
            for base in (a.url, b.url):
                async with http.get(base + "/v2/deployments", headers=headers()) as r:
                    listed = {d["id"] for d in (await r.json())["resources"]}
                assert set(ids) <= listed
            for _ in range(400):
                async with http.get(a.url + "/v2/deployments", headers=headers()) as r:
                    statuses = {d["status"] for d in (await r.json())["resources"]}
                if statuses == {"READY"}:
                    break
                await asyncio.sleep(0.05)
            assert statuses == {"READY"}
    with psycopg.connect(pg_database_url) as conn:
        rows = conn.execute("SELECT revision, old, new FROM status_log ORDER BY seq").fetchall()
    steps: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for revision, old, new in rows:
        steps[revision].append((old, new))
    expected = list(itertools.pairwise(REVISION_FLOW))
    assert len(steps) == 6
    assert all(history == expected for history in steps.values())


async def test_a_revision_is_finished_by_the_other_instance_when_its_driver_stops(
    pg_database_url: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path / "data", step=0.2)
    config = config.__class__(**{**config.__dict__, "database_url": pg_database_url})
    async with running_control_plane(config) as b:
        async with running_control_plane(config) as a, aiohttp.ClientSession() as http:
            async with http.post(
                a.url + "/v2/deployments", json=deployment_body("orphan"), headers=headers()
            ) as r:
                deployment_id = (await r.json())["id"]
        # a is gone (its lifecycle driver with it), mid-lifecycle.
        async with aiohttp.ClientSession() as http:
            for _ in range(200):
                async with http.get(
                    f"{b.url}/v2/deployments/{deployment_id}", headers=headers()
                ) as r:
                    status = (await r.json())["status"]
                if status == "READY":
                    break
                await asyncio.sleep(0.05)
        assert status == "READY"
