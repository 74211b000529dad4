"""TTL expiry, refresh on read and the sweeper, with a clock the test moves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from langgraph_sdk import get_client

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import STORAGE_KEY

from .store_support import FakeClock, RunningStore, start_store

StoreFactory = Callable[..., Any]


@pytest.fixture
async def ttl_store(tmp_path: Path, store_database_url: str | None) -> AsyncIterator[StoreFactory]:
    """Starts Stores with a fake clock and the given config; yields (store, sdk)."""
    started: list[tuple[RunningStore, Any]] = []

    async def start(**config: Any) -> tuple[RunningStore, Any, FakeClock]:
        clock = FakeClock()
        data_dir = tmp_path / f"store-{len(started)}"
        store = await start_store(
            StoreConfig(data_dir=data_dir, database_url=store_database_url, **config), clock
        )
        client = get_client(url=store.url, api_key=None)
        started.append((store, client))
        return store, client.store, clock

    yield start
    for store, client in started:
        await client.aclose()
        await store.runner.cleanup()


async def _keys(sdk: Any, namespace: list[str], **kwargs: Any) -> list[str]:
    return [item["key"] for item in (await sdk.search_items(namespace, **kwargs))["items"]]


async def test_item_expires_after_its_ttl_even_unswept(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="short", value={"text": "ephemeral note"}, ttl=1)
    await sdk.put_item(["t"], key="forever", value={"text": "permanent note"})
    clock.advance(59)
    assert await sdk.get_item(["t"], key="short") is not None
    clock.advance(2)
    assert await sdk.get_item(["t"], key="short") is None
    assert await _keys(sdk, ["t"]) == ["forever"]
    assert await _keys(sdk, ["t"], query="note") == ["forever"]
    assert await _keys(sdk, ["t"], query="ephemeral") == []
    await sdk.put_item(["gone"], key="only", value={}, ttl=1)
    clock.advance(61)
    assert (await sdk.list_namespaces())["namespaces"] == [["t"]]


async def test_get_refreshes_ttl_when_asked(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="k", value={}, ttl=1)
    clock.advance(50)
    assert await sdk.get_item(["t"], key="k", refresh_ttl=True) is not None
    clock.advance(50)  # 100 s after the put, 50 s after the refresh
    assert await sdk.get_item(["t"], key="k") is not None  # no refresh this time
    clock.advance(11)
    assert await sdk.get_item(["t"], key="k") is None


async def test_refresh_on_read_default_comes_from_config(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=True)
    await sdk.put_item(["t"], key="k", value={}, ttl=1)
    for _ in range(5):  # read every 50 s: each read pushes expiry a minute out
        clock.advance(50)
        assert await sdk.get_item(["t"], key="k") is not None
    clock.advance(50)
    assert await sdk.get_item(["t"], key="k", refresh_ttl=False) is not None
    clock.advance(11)
    assert await sdk.get_item(["t"], key="k") is None


async def test_search_refreshes_returned_items_only(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="hit", value={"text": "apple"}, ttl=1)
    await sdk.put_item(["t"], key="miss", value={"text": "banana"}, ttl=1)
    clock.advance(50)
    assert await _keys(sdk, ["t"], query="apple", refresh_ttl=True) == ["hit"]
    clock.advance(20)
    assert await _keys(sdk, ["t"]) == ["hit"]
    # Listing mode refreshes too.
    assert await _keys(sdk, ["t"], refresh_ttl=True) == ["hit"]
    clock.advance(59)
    assert await _keys(sdk, ["t"]) == ["hit"]


async def test_default_ttl_applies_when_a_put_gives_none(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(default_ttl_minutes=2, refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="default", value={})
    await sdk.put_item(["t"], key="explicit", value={}, ttl=10)
    clock.advance(121)
    assert await sdk.get_item(["t"], key="default") is None
    assert await sdk.get_item(["t"], key="explicit") is not None


async def test_rewriting_an_expired_item_starts_it_afresh(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="k", value={"v": 1}, ttl=1)
    first = await sdk.get_item(["t"], key="k")
    clock.advance(120)
    await sdk.put_item(["t"], key="k", value={"v": 2})  # no ttl now: lives forever
    second = await sdk.get_item(["t"], key="k")
    assert second["value"] == {"v": 2}
    assert second["created_at"] != first["created_at"]
    clock.advance(10_000)
    assert await sdk.get_item(["t"], key="k") is not None


async def test_updating_an_item_resets_its_ttl(ttl_store: StoreFactory) -> None:
    _, sdk, clock = await ttl_store(refresh_ttl_on_read=False)
    await sdk.put_item(["t"], key="k", value={"v": 1}, ttl=1)
    clock.advance(50)
    await sdk.put_item(["t"], key="k", value={"v": 2}, ttl=1)
    clock.advance(50)
    assert (await sdk.get_item(["t"], key="k"))["value"] == {"v": 2}


async def test_sweeper_deletes_expired_rows(ttl_store: StoreFactory) -> None:
    store, sdk, clock = await ttl_store(sweep_interval_seconds=0.02, refresh_ttl_on_read=False)
    storage = store.app[STORAGE_KEY]
    for index in range(1200):  # more than one sweep batch
        await sdk.put_item(["t", str(index % 3)], key=f"k{index}", value={}, ttl=1)
    await sdk.put_item(["t"], key="keep", value={})
    assert await storage.count_items() == 1201
    clock.advance(61)
    async with asyncio.timeout(60):
        while await storage.count_items() != 1:
            await asyncio.sleep(0.02)
    assert await _keys(sdk, ["t"]) == ["keep"]


async def test_sweep_expired_directly(ttl_store: StoreFactory) -> None:
    store, sdk, clock = await ttl_store(sweep_interval_seconds=3600)
    storage = store.app[STORAGE_KEY]
    await sdk.put_item(["t"], key="a", value={}, ttl=1)
    await sdk.put_item(["t"], key="b", value={}, ttl=5)
    assert await storage.sweep_expired() == 0
    clock.advance(61)
    assert await storage.sweep_expired() == 1
    assert await storage.count_items() == 1
