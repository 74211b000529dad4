"""Search under a namespace prefix: the scoped plan (small prefixes) ranks exactly like the
store-wide plan, and a data dir written by schema 1 opens, migrates and keeps working."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from langgraph_sdk import get_client

from gateway.upstreams.store import StoreConfig, storage
from gateway.upstreams.store.app import READ
from gateway.upstreams.store.models import StorePutRequest, StoreSearchRequest
from gateway.upstreams.store.schema import SCHEMA_VERSION
from gateway.upstreams.store.storage import SQLiteStorage

from .store_support import FakeClock, start_store

_WORDS = ["alpha", "beta", "gamma", "delta", "coffee", "tea", "cats", "dogs", "river", "stone"]


@pytest.fixture
async def filled(tmp_path: Path) -> AsyncIterator[tuple[SQLiteStorage, FakeClock]]:
    clock = FakeClock()
    store = SQLiteStorage(StoreConfig(data_dir=tmp_path / "data"), clock)
    await store.open()
    try:
        namespaces = [["a"], ["a", "b"], ["a", "b", "c"], ["ab"], ["z", "a"]]
        for index in range(150):
            words = [_WORDS[(index * k + k) % len(_WORDS)] for k in range(1, 1 + index % 6)]
            body: dict[str, Any] = {
                "namespace": namespaces[index % len(namespaces)],
                "key": f"k{index}",
                "value": {"text": " ".join(words), "n": index, "color": ["red", "blue"][index % 2]},
            }
            if index % 7 == 0:
                body["ttl"] = 1  # these expire below
            await store.put(READ.json(StorePutRequest, body))
            clock.advance(0.5)
        clock.advance(120)
        yield store, clock
    finally:
        await store.close()


_SEARCHES: list[dict[str, Any]] = [
    {"namespace_prefix": prefix, "query": query, "limit": limit, "offset": offset, **extra}
    for prefix in (["a"], ["a", "b"], ["a", "b", "c"], ["ab"], ["z"], ["nothing"])
    for query in ("coffee", "cats dogs river", "alpha gamma tea stone")
    for limit, offset in ((10, 0), (3, 2), (1000, 0))
    for extra in ({}, {"filter": {"color": "red"}}, {"filter": {"n": {"$gte": 60}}})
]


async def test_scoped_and_store_wide_plans_return_the_same_results(
    filled: tuple[SQLiteStorage, FakeClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = filled
    results: dict[int, list[list[dict[str, Any]]]] = {}
    for threshold in (-1, 10**9):  # never scoped, always scoped
        monkeypatch.setattr(storage, "SCOPED_SEARCH_MAX_ITEMS", threshold)
        results[threshold] = [
            await store.search(READ.json(StoreSearchRequest, {**body, "refresh_ttl": False}))
            for body in _SEARCHES
        ]
    assert results[-1] == results[10**9]
    assert sum(len(found) for found in results[-1]) > 200  # the comparison is not vacuous
    returned = [item for found in results[-1] for item in found]
    assert all(item["score"] > 0 for item in returned)
    assert not any(int(item["key"][1:]) % 7 == 0 for item in returned)  # expired


# The schema of store files written before the namespace index carried expires_at.
_SCHEMA_1 = """
CREATE TABLE items (
    id INTEGER PRIMARY KEY, namespace TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
    search_text TEXT, created_at REAL NOT NULL, updated_at REAL NOT NULL, ttl_minutes REAL,
    expires_at REAL, UNIQUE (namespace, key)
);
CREATE INDEX items_by_namespace_updated ON items (namespace, updated_at, id);
CREATE INDEX items_by_updated ON items (updated_at, id);
CREATE INDEX items_by_expiry ON items (expires_at) WHERE expires_at IS NOT NULL;
CREATE VIRTUAL TABLE items_fts USING fts5(
    search_text, content='items', content_rowid='id',
    tokenize='porter unicode61 remove_diacritics 2'
);
CREATE TRIGGER items_fts_insert AFTER INSERT ON items BEGIN
    INSERT INTO items_fts (rowid, search_text) VALUES (new.id, new.search_text);
END;
CREATE TRIGGER items_fts_delete AFTER DELETE ON items BEGIN
    INSERT INTO items_fts (items_fts, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
END;
CREATE TRIGGER items_fts_update AFTER UPDATE OF search_text ON items BEGIN
    INSERT INTO items_fts (items_fts, rowid, search_text)
    VALUES ('delete', old.id, old.search_text);
    INSERT INTO items_fts (rowid, search_text) VALUES (new.id, new.search_text);
END;
PRAGMA user_version = 1;
"""


def _indexes(path: Path) -> set[str]:
    with sqlite3.connect(path) as connection:
        rows = connection.execute("SELECT name FROM sqlite_master WHERE type = 'index'")
        return {name for (name,) in rows if not name.startswith("sqlite_")}


async def test_a_data_dir_written_by_schema_1_is_migrated_on_open(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "old")
    config.data_dir.mkdir()
    connection = sqlite3.connect(config.database_path, isolation_level=None)
    connection.executescript(_SCHEMA_1)
    connection.executemany(
        "INSERT INTO items (namespace, key, value, search_text, created_at, updated_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        [
            ("users.alice", "m1", '{"text": "dark roast coffee"}', "dark roast coffee", 1e9, 1e9),
            ("users.bob", "m2", '{"text": "green tea"}', "green tea", 1e9, 1e9 + 1),
        ],
    )
    connection.close()

    store = await start_store(config)
    try:
        async with get_client(url=store.url, api_key=None) as client:
            sdk = client.store
            assert (await sdk.get_item(["users", "alice"], key="m1"))["value"] == {
                "text": "dark roast coffee"
            }
            found = await sdk.search_items(["users", "alice"], query="coffee")
            assert [item["key"] for item in found["items"]] == ["m1"]
            listed = await sdk.search_items(["users"])
            assert [item["key"] for item in listed["items"]] == ["m2", "m1"]
            await sdk.put_item(["users", "bob"], key="m3", value={"text": "strong coffee"})
            found = await sdk.search_items(["users"], query="coffee")
            assert {item["key"] for item in found["items"]} == {"m1", "m3"}
    finally:
        await store.runner.cleanup()

    with sqlite3.connect(config.database_path) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    indexes = _indexes(config.database_path)
    assert "items_by_namespace_updated" not in indexes
    assert "items_by_namespace_recency" in indexes

    # Opening an up-to-date file again changes nothing.
    store = await start_store(config)
    await store.runner.cleanup()
    assert _indexes(config.database_path) == indexes
