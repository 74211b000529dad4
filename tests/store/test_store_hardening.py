"""One bad write cannot fail the writes committed with it; deep stored values cannot break
filters; list_namespaces stops walking early and answers exactly as a full walk would."""

from __future__ import annotations

import asyncio
import functools
import json
import random
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import READ, STORAGE_KEY
from gateway.upstreams.store.filters import canonical_json, canonical_json_text
from gateway.upstreams.store.models import StoreListNamespacesRequest, StorePutRequest
from gateway.upstreams.store.storage import SQLiteStorage, _put

from .store_support import FakeClock, RunningStore


@pytest.fixture
async def storage(tmp_path: Path) -> AsyncIterator[SQLiteStorage]:
    store = SQLiteStorage(StoreConfig(data_dir=tmp_path / "data"), FakeClock())
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def _put_params(namespace: str, key: str, value: str) -> tuple[Any, ...]:
    return (namespace, key, value, None, 1.0, 1.0, None, None)


# -- group commit: each write stands alone ----------------------------------------------


async def test_a_failing_write_fails_alone_in_its_batch(storage: SQLiteStorage) -> None:
    """Writes queued together commit together, except the one that fails, whatever it
    raises: here a lone surrogate that SQLite cannot bind (UnicodeEncodeError) and a
    Python error after a statement already ran (its row must be undone)."""

    def half_done_then_fails(connection: sqlite3.Connection) -> None:
        _put(connection, params=_put_params("ns", "half", "{}"))
        raise RuntimeError("fails after writing")

    release = threading.Event()
    assert storage._writer is not None
    blocker = storage._writer.submit(release.wait)  # holds the writer: everything queues
    writes: list[Any] = []
    for n in range(100):
        writes.append(
            storage._write(functools.partial(_put, params=_put_params("ns", f"k{n}", "{}")))
        )
        if n == 30:
            writes.append(
                storage._write(functools.partial(_put, params=_put_params("ns", "\ud800", "{}")))
            )
        if n == 60:
            writes.append(storage._write(half_done_then_fails))
    tasks = [asyncio.ensure_future(write) for write in writes]
    await asyncio.sleep(0.05)  # every write is queued behind the blocker
    release.set()
    blocker.result(timeout=10)
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    assert [type(f) for f in failures] == [UnicodeEncodeError, RuntimeError]
    assert await storage.count_items() == 100  # neither "half" nor the bad key


async def test_one_bad_put_among_many_concurrent_ones(running_store: RunningStore) -> None:
    """200 concurrent good PUTs and one with a lone surrogate key: 200 x 204 and one 422."""
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        running_store.url, timeout=timeout, connector=connector
    ) as http:

        async def put(key: str) -> int:
            body = {"namespace": ["many"], "key": key, "value": {"n": key}}
            async with http.put("/store/items", json=body) as response:
                return response.status

        keys = [f"k{n}" for n in range(200)]
        keys.insert(100, "bad\ud800")
        statuses = await asyncio.gather(*(put(key) for key in keys))
        assert statuses[100] == 422
        assert statuses[:100] + statuses[101:] == [204] * 200
        async with http.post(
            "/store/items/search", json={"namespace_prefix": ["many"], "limit": 1000}
        ) as response:
            assert len((await response.json())["items"]) == 200


# -- deep values already in the store -----------------------------------------------------


def _deep_array(levels: int) -> str:
    return "[" * levels + "1" + "]" * levels


def test_canonical_json_survives_any_depth() -> None:
    assert canonical_json_text(_deep_array(600)) == _deep_array(600)
    assert canonical_json_text(_deep_array(100_000)) is None  # too deep for the codec
    assert canonical_json_text('{"b": 1.0, "a": [2.50, 1e2]}') == '{"a":[2.5,100],"b":1}'
    assert canonical_json_text("not json") is None
    assert canonical_json_text(b"[1]") is None
    assert canonical_json({"x": [1.0]}) == canonical_json_text('{"x": [1]}')


# SQLite only: it writes rows past the request validation through SQLiteStorage's writer.
@pytest.mark.parametrize("store_database_url", [None], ids=["sqlite"])
async def test_filters_over_a_deeply_nested_stored_value(running_store: RunningStore) -> None:
    """Items written before depth was bounded (600 and 900 levels under "k"; the body
    parser stopped near 1000) do not break filters on "k": nothing answers 500 and the
    comparisons still give the right answer."""
    storage = running_store.app[STORAGE_KEY]
    await storage._write(
        functools.partial(_put, params=_put_params("deep", "old", '{"k":' + _deep_array(600) + "}"))
    )
    await storage._write(
        functools.partial(
            _put, params=_put_params("deep", "older", '{"k":' + _deep_array(900) + "}")
        )
    )
    await storage.put(
        READ.json(StorePutRequest, {"namespace": ["deep"], "key": "new", "value": {"k": [1]}})
    )
    async with aiohttp.ClientSession(running_store.url) as http:
        for condition, expected in (
            ([1], ["new"]),
            ({"$eq": [[1]]}, []),
            ({"$ne": [1]}, ["old", "older"]),
            ({"$gt": 1}, []),
            ({"$eq": {"a": [1.0]}}, []),
        ):
            body = {"namespace_prefix": ["deep"], "filter": {"k": condition}, "limit": 10}
            async with http.post("/store/items/search", json=body) as response:
                assert response.status == 200, await response.text()
                found = sorted(item["key"] for item in (await response.json())["items"])
                assert found == expected, condition


# -- list_namespaces: early stop and subtree skipping give the full walk's answer ---------

_LABELS = ["a", "b", "a-", "a-b", "ab", "a b", "!", "z", "b0"]


def _reference_listing(live: set[str], body: dict[str, Any]) -> list[list[str]]:
    """The listing as the full walk computed it before: every live namespace, matched,
    cut to max_depth, de-duplicated, sorted (as dotted text), then paged."""
    prefix, suffix = body.get("prefix"), body.get("suffix")
    shown: set[str] = set()
    for namespace in live:
        labels = namespace.split(".")
        ok = True
        for pattern, window in (
            (prefix, labels[: len(prefix or [])]),
            (suffix, labels[len(labels) - len(suffix or []) :]),
        ):
            if pattern is None:
                continue
            if len(pattern) > len(labels) or any(
                p not in ("*", label) for p, label in zip(pattern, window, strict=True)
            ):
                ok = False
        if ok:
            shown.add(".".join(labels[: body.get("max_depth") or len(labels)]))
    offset, limit = body.get("offset", 0), body.get("limit", 100)
    return [n.split(".") for n in sorted(shown)[offset : offset + limit]]


def _random_pattern(rng: random.Random) -> list[str] | None:
    if rng.random() < 0.4:
        return None
    return [rng.choice([*_LABELS, "*", "*"]) for _ in range(rng.randint(0, 3))]


async def test_list_namespaces_matches_a_full_walk(tmp_path: Path) -> None:
    rng = random.Random(20250615)
    clock = FakeClock()
    store = SQLiteStorage(StoreConfig(data_dir=tmp_path / "data"), clock)
    await store.open()
    try:
        live: set[str] = set()
        for n in range(400):
            labels = [rng.choice(_LABELS) for _ in range(rng.randint(1, 5))]
            expiring = rng.random() < 0.2
            body: dict[str, Any] = {"namespace": labels, "key": f"k{n}", "value": {}}
            if expiring:
                body["ttl"] = 1
            await store.put(READ.json(StorePutRequest, body))
            if not expiring:
                live.add(".".join(labels))
        clock.advance(120)  # the ttl=1 items are expired (not swept)
        assert len(live) > 200
        for _ in range(600):
            request: dict[str, Any] = {
                "limit": rng.choice([1, 2, 3, 5, 10, 100]),
                "offset": rng.choice([0, 0, 1, 2, 5, 20]),
            }
            for field in ("prefix", "suffix"):
                pattern = _random_pattern(rng)
                if pattern is not None:
                    request[field] = pattern
            if rng.random() < 0.6:
                request["max_depth"] = rng.randint(1, 4)
            got = await store.list_namespaces(READ.json(StoreListNamespacesRequest, request))
            assert got == _reference_listing(live, request), request
    finally:
        await store.close()


async def test_list_namespaces_cost_follows_the_page_not_the_store(tmp_path: Path) -> None:
    """With 3,000 namespaces, a short page or a shallow max_depth walks a handful of index
    entries (counted in SQLite VM instructions), not all 3,000 namespaces."""
    storage = SQLiteStorage(StoreConfig(data_dir=tmp_path / "data", read_threads=1))
    await storage.open()
    try:
        await _count_listing_steps(storage)
    finally:
        await storage.close()


async def _count_listing_steps(storage: SQLiteStorage) -> None:
    await storage._write(
        lambda connection: connection.executemany(
            "INSERT INTO items (namespace, key, value, created_at, updated_at) "
            "VALUES (?, 'k', '{}', 1, 1)",
            ((f"org{n % 3}.team{n % 100}.user{n}",) for n in range(3000)),
        )
    )
    steps = 0

    def count() -> int:
        nonlocal steps
        steps += 1
        return 0

    await storage.count_items()  # the reader thread and its connection exist from here on
    for connection in storage._connections:
        connection.set_progress_handler(count, 1000)
    full_walk = {"suffix": ["nobody"]}
    cheap = [
        {"limit": 1},
        {"limit": 10, "offset": 10},
        {"max_depth": 1},
        {"prefix": ["org1"], "max_depth": 2, "limit": 5},
        {"prefix": ["org2", "*"], "max_depth": 2, "limit": 3},
    ]
    steps = 0
    assert await storage.list_namespaces(READ.json(StoreListNamespacesRequest, full_walk)) == []
    full = steps
    assert full > 100
    for body in cheap:
        steps = 0
        await storage.list_namespaces(READ.json(StoreListNamespacesRequest, body))
        assert steps < full / 20, (body, steps, full)


async def test_list_namespaces_limit_one_is_first_in_dotted_order(
    storage: SQLiteStorage,
) -> None:
    """A cut namespace can sort before one walked earlier ('a' < 'a-b', walked after it)."""
    for namespace in (["a-b"], ["a", "x"], ["a", "x", "y"], ["a!"]):
        await storage.put(
            READ.json(StorePutRequest, {"namespace": namespace, "key": "k", "value": {}})
        )
    listing = READ.json(StoreListNamespacesRequest, {"max_depth": 1, "limit": 1})
    assert await storage.list_namespaces(listing) == [["a"]]
    listing = READ.json(StoreListNamespacesRequest, {"max_depth": 1, "limit": 2, "offset": 1})
    assert await storage.list_namespaces(listing) == [["a!"], ["a-b"]]
    assert json.dumps(
        await storage.list_namespaces(READ.json(StoreListNamespacesRequest, {}))
    ) == json.dumps([["a!"], ["a-b"], ["a", "x"], ["a", "x", "y"]])
