"""Where the Store's search meets langgraph's own stores (langgraph.store.sqlite, .postgres,
.memory), and where it deliberately does not: each case of docs/store.md, "Differences from
langgraph's stores", on both backends (``store_database_url``), mostly through the real
langgraph-sdk client.

Matched: dotted filter keys address nested fields; a key no field path can be is refused
(422, naming it); a null ordering bound (the SDK's ``inf`` / ``-inf``) is unbounded; items a
query cannot score follow the ranked ones with score null. Kept, and pinned here so a change
is a decision: a query without ``store.index`` ranks by BM25 and leaves out items that share
no word with it; filters compare typed JSON values.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from langgraph_sdk import get_client
from langgraph_sdk.errors import UnprocessableEntityError

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.filters import MAX_FILTER_PATH_FIELDS
from gateway.upstreams.store.schema import SCHEMA_VERSION
from tests.support.embedding_server import EmbeddingServer

from .semantic_support import indexed_store_config
from .store_support import FakeClock, start_store

DOCS = ["docs"]


def _keys(found: Any) -> list[str]:
    return [item["key"] for item in found["items"]]


def _scored(found: Any) -> list[tuple[str, bool]]:
    """Each item's key and whether it has a score."""
    return [(item["key"], item["score"] is not None) for item in found["items"]]


async def _search(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post("/store/items/search", json=body) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


# -- dotted filter keys ---------------------------------------------------------------


async def test_dotted_keys_address_nested_fields_as_langgraph_does(sdk: Any) -> None:
    # langgraph's test_filter_keys_with_hyphens_and_digits, through the SDK.
    await sdk.put_item(
        DOCS, key="hyphen", value={"access-level": "public", "user": {"access-level": "nested"}}
    )
    await sdk.put_item(DOCS, key="digit", value={"123abc": "ok", "user": {"123abc": "ok2"}})
    await sdk.put_item(DOCS, key="admin", value={"user": {"access-level": "admin", "age": 41}})

    async def matching(filter: dict[str, Any]) -> list[str]:
        return sorted(_keys(await sdk.search_items(DOCS, filter=filter, limit=100)))

    assert await matching({"access-level": "public"}) == ["hyphen"]
    assert await matching({"user.access-level": "nested"}) == ["hyphen"]
    assert await matching({"123abc": "ok"}) == ["digit"]
    assert await matching({"user.123abc": "ok2"}) == ["digit"]
    assert await matching({"user.access-level": "admin"}) == ["admin"]
    # Operators apply to the nested field; $ne still needs the field present.
    assert await matching({"user.age": {"$gt": 40, "$lte": 41}}) == ["admin"]
    assert await matching({"user.access-level": {"$ne": "admin"}}) == ["hyphen"]
    assert await matching({"user.age": {"$ne": 1}}) == ["admin"]
    # Several keys, nested and top-level, are ANDed.
    assert await matching({"user.access-level": "nested", "access-level": "public"}) == ["hyphen"]
    assert await matching({"user.access-level": "nested", "123abc": "ok"}) == []


async def test_a_dotted_key_steps_through_objects_only(sdk: Any) -> None:
    values: dict[str, dict[str, Any]] = {
        "deep": {"a": {"b": {"c": 3}}},
        "array": {"a": [{"b": {"c": 3}}], "tags": ["x"]},  # arrays are not stepped into
        "object_0": {"tags": {"0": "x"}},  # "0" is an object key like any other
        "scalar": {"a": "b.c"},  # a string where an object is needed: absent, no error
        "dotted_name": {"a.b": {"c": 3}},  # a top-level name holding '.' is not addressed
        "null": {"a": {"b": {"c": None}}},
    }
    for key, value in values.items():
        await sdk.put_item(DOCS, key=key, value=value)

    async def matching(filter: dict[str, Any]) -> list[str]:
        return sorted(_keys(await sdk.search_items(DOCS, filter=filter, limit=100)))

    assert await matching({"a.b.c": 3}) == ["deep"]
    assert await matching({"a.b.c": {"$gte": 3}}) == ["deep"]
    assert await matching({"a.b": {"c": 3}}) == ["deep"]
    assert await matching({"tags.0": "x"}) == ["object_0"]
    assert await matching({"a.b.c": None}) == ["null"]  # an explicit null, not "absent"
    assert await matching({"a.b.c": {"$ne": 3}}) == ["null"]
    assert await matching({"a.b.c.d": 3}) == []


async def test_filter_keys_that_are_no_field_path_are_422_naming_the_key(
    sdk: Any, http: aiohttp.ClientSession
) -> None:
    # langgraph's SQLite store raises ValueError("Invalid filter key: ...") for this one.
    injection = "access') = 'public' OR '1'='1' OR json_extract(value, '$."
    too_deep = ".".join(["f"] * (MAX_FILTER_PATH_FIELDS + 1))
    for key in ["", "a..b", ".a", "a.", ".", injection, too_deep]:
        status, body = await _search(http, {"filter": {key: 1}})
        assert status == 422, (key, body)
        assert set(body) == {"detail"}
        assert body["detail"].startswith(f"filter.{key}"[:200]), body["detail"]
        assert "invalid filter key" in body["detail"]
    # The SDK surfaces it as its 422 error.
    with pytest.raises(UnprocessableEntityError) as raised:
        await sdk.search_items(DOCS, filter={injection: "dummy"})
    assert "invalid filter key" in raised.value.response.json()["detail"]
    # Any character but '.' is a field name: keys are bound as parameters, never spliced
    # into SQL, so what langgraph's SQLite store must refuse is simply looked up here.
    await sdk.put_item(DOCS, key="odd", value={'it\'s "x"': {"名前 $[*]": 1}})
    found = await sdk.search_items(DOCS, filter={'it\'s "x".名前 $[*]': 1})
    assert _keys(found) == ["odd"]
    deepest = ".".join(["f"] * MAX_FILTER_PATH_FIELDS)
    assert (await _search(http, {"filter": {deepest: 1}}))[0] == 200


# -- null bounds: the SDK's infinities ---------------------------------------------------


async def test_infinite_bounds_sent_as_null_are_unbounded(
    sdk: Any, http: aiohttp.ClientSession
) -> None:
    # langgraph's test_numeric_filter_safety, through the SDK (which writes inf as null).
    for key, price in [("item1", 10), ("item2", 20), ("item3", 30.5)]:
        await sdk.put_item(["items"], key=key, value={"price": price, "quantity": 5})
    await sdk.put_item(["items"], key="text", value={"price": "cheap"})
    await sdk.put_item(["items"], key="none", value={"quantity": 1})

    async def matching(filter: dict[str, Any]) -> list[str]:
        return sorted(_keys(await sdk.search_items(["items"], filter=filter, limit=100)))

    every_number = ["item1", "item2", "item3"]
    assert await matching({"price": {"$lt": math.inf}}) == every_number
    assert await matching({"price": {"$gt": -math.inf}}) == every_number
    assert await matching({"price": {"$lte": math.inf, "$gte": -math.inf}}) == every_number
    # Still ANDed with a finite bound.
    assert await matching({"price": {"$lt": math.inf, "$gt": 15}}) == ["item2", "item3"]
    assert await matching({"price": {"$lt": 1e100}}) == every_number
    # NaN is sent as null too: $eq null matches explicit nulls only, so nothing here, as
    # NaN equals nothing in langgraph.
    assert await matching({"price": {"$eq": math.nan}}) == []
    # What the SDK sends, as raw JSON: the same answer. (The SDK cannot send 10**100:
    # orjson refuses integers beyond 64 bits; JSON itself can.)
    for bound in [None, 10**100]:
        status, body = await _search(
            http, {"namespace_prefix": ["items"], "filter": {"price": {"$lt": bound}}}
        )
        assert status == 200
        assert sorted(_keys(body)) == every_number


# -- what a query returns --------------------------------------------------------------


async def test_without_an_index_a_query_ranks_by_bm25_and_leaves_out_non_matches(
    sdk: Any,
) -> None:
    # langgraph's stores ignore a query when nothing is embedded and list every item; the
    # Store ranks by words instead (documented for users porting code).
    await sdk.put_item(DOCS, key="cats", value={"text": "cats purr and sleep"})
    await sdk.put_item(DOCS, key="cars", value={"text": "sedans need tyres"})
    found = await sdk.search_items(DOCS, query="cats")
    assert _scored(found) == [("cats", True)]
    assert found["items"][0]["score"] > 0
    # Listing mode (no query) lists everything, as langgraph's stores do.
    assert sorted(_keys(await sdk.search_items(DOCS))) == ["cars", "cats"]


async def test_items_a_query_cannot_score_follow_the_ranked_ones(sdk: Any) -> None:
    # langgraph's InMemoryStore returns the items it holds no vectors for after the scored
    # ones, score null (its SqliteStore and PostgresStore leave them out).
    await sdk.put_item(DOCS, key="hidden_old", value={"text": "giraffe", "kind": "a"}, index=False)
    await sdk.put_item(DOCS, key="nothing_indexed", value={"n": 1, "kind": "a"}, index=["title"])
    await sdk.put_item(DOCS, key="hidden_new", value={"text": "giraffe", "kind": "b"}, index=False)
    for n in range(3):
        await sdk.put_item(DOCS, key=f"match{n}", value={"text": "giraffe " * (n + 1)})
    await sdk.put_item(DOCS, key="other", value={"text": "zebra"})
    await sdk.put_item(["elsewhere"], key="hidden", value={"text": "giraffe"}, index=False)

    ranked = ["match2", "match1", "match0"]
    # Newest update first after the ranking (as a listing).
    unscored = ["hidden_new", "nothing_indexed", "hidden_old"]
    found = await sdk.search_items(DOCS, query="giraffe", limit=100)
    assert _keys(found) == ranked + unscored
    assert _scored(found) == [(key, True) for key in ranked] + [(key, False) for key in unscored]
    # offset and limit page through the whole list, across the boundary and past it.
    everything = ranked + unscored
    for offset in range(len(everything) + 1):
        for limit in (1, 2, 4):
            page = await sdk.search_items(DOCS, query="giraffe", limit=limit, offset=offset)
            assert _keys(page) == everything[offset : offset + limit], (offset, limit)
    # The filter holds for them too.
    found = await sdk.search_items(DOCS, query="giraffe", filter={"kind": "a"})
    assert _keys(found) == ["nothing_indexed", "hidden_old"]
    # A query with no searchable word ranks nothing; the unscored items are all there is.
    found = await sdk.search_items(DOCS, query="?!", limit=100)
    assert _keys(found) == unscored


async def test_an_unscored_item_is_refreshed_and_expires_like_any_other(
    tmp_path: Path, store_database_url: str | None
) -> None:
    clock = FakeClock()
    config = StoreConfig(data_dir=tmp_path / "data", database_url=store_database_url)
    store = await start_store(config, clock)
    client = get_client(url=store.url, api_key=None)
    sdk = client.store
    try:
        await sdk.put_item(DOCS, key="hidden", value={"text": "giraffe"}, index=False, ttl=1)
        clock.advance(50)
        found = await sdk.search_items(DOCS, query="giraffe", refresh_ttl=True)
        assert _scored(found) == [("hidden", False)]
        clock.advance(50)  # 100 s after the write, 50 s after the refreshing search
        found = await sdk.search_items(DOCS, query="giraffe", refresh_ttl=False)
        assert _scored(found) == [("hidden", False)]
        clock.advance(20)
        assert (await sdk.search_items(DOCS, query="giraffe"))["items"] == []
    finally:
        await client.aclose()
        await store.runner.cleanup()


# -- typed comparison, kept ------------------------------------------------------------


async def test_filters_compare_typed_json_values(sdk: Any) -> None:
    values: dict[str, dict[str, Any]] = {
        "true": {"flag": True, "n": None, "meta": {"a": 1, "b": 2}},
        "one": {"flag": 1, "meta": {"a": 1}},
        "no_n": {"flag": False},
    }
    for key, value in values.items():
        await sdk.put_item(DOCS, key=key, value=value)

    async def matching(filter: dict[str, Any]) -> list[str]:
        return sorted(_keys(await sdk.search_items(DOCS, filter=filter, limit=100)))

    # langgraph's SqliteStore and InMemoryStore treat true and 1 as equal; here they are not.
    assert await matching({"flag": True}) == ["true"]
    assert await matching({"flag": 1}) == ["one"]
    # Those two also match items without the key; here null is a value like any other.
    assert await matching({"n": None}) == ["true"]
    # A partial object is no match (InMemoryStore: a match): objects compare whole; a dotted
    # key tests one field.
    assert await matching({"meta": {"a": 1}}) == ["one"]
    assert await matching({"meta.a": 1}) == ["one", "true"]


# -- with an embedding index -------------------------------------------------------------


@pytest.fixture(params=["vector", "hybrid"])
async def indexed_sdk(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
) -> AsyncIterator[Any]:
    config = indexed_store_config(
        tmp_path / "data", embedding_server, store_database_url, ranking=request.param
    )
    store = await start_store(config)
    client = get_client(url=store.url, api_key=None)
    try:
        yield client.store
    finally:
        await client.aclose()
        await store.runner.cleanup()


async def test_with_an_index_items_without_vectors_follow_the_ranking(indexed_sdk: Any) -> None:
    sdk = indexed_sdk
    await sdk.put_item(DOCS, key="hidden", value={"text": "espresso"}, index=False)
    for key, text in [("coffee", "dark roast coffee"), ("car", "sedan tyres")]:
        await sdk.put_item(DOCS, key=key, value={"text": text})
    found = await sdk.search_items(DOCS, query="coffee", limit=10)
    # Every item with vectors is ranked (by meaning, or fused with words), then the rest.
    assert _keys(found)[0] == "coffee"
    assert _scored(found) == [("coffee", True), ("car", True), ("hidden", False)]
    # A page that ends inside the ranking does not reach it; one past the ranking does.
    assert _keys(await sdk.search_items(DOCS, query="coffee", limit=2)) == ["coffee", "car"]
    page = await sdk.search_items(DOCS, query="coffee", limit=5, offset=2)
    assert _scored(page) == [("hidden", False)]
    assert (await sdk.search_items(DOCS, query="coffee", offset=3))["items"] == []


# -- the plan that finds the unscored items ------------------------------------------------


def test_sqlite_finds_unscored_items_off_their_partial_indexes(tmp_path: Path) -> None:
    """The unscored items are looked up in indexes holding only them, so a query whose
    matches end within the page does not walk every item to find none."""
    from gateway.upstreams.store.schema import SCHEMA

    connection = sqlite3.connect(tmp_path / "plan.sqlite3")
    connection.executescript(SCHEMA)
    assert connection.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    tail = (
        "SELECT i.id FROM items AS i WHERE {scope} AND (i.expires_at IS NULL OR "
        "i.expires_at > 0) AND 1 AND i.search_text IS NULL "
        "ORDER BY i.updated_at DESC, i.id DESC LIMIT 10 OFFSET 0"
    )
    for scope, index in [
        ("1", "items_unsearchable_by_updated"),
        ("i.namespace = 'a'", "items_unsearchable"),
        (
            "(i.namespace = 'a' OR (i.namespace >= 'a.' AND i.namespace < 'a/'))",
            "items_unsearchable",
        ),
    ]:
        plan = " ".join(
            row[-1] for row in connection.execute("EXPLAIN QUERY PLAN " + tail.format(scope=scope))
        )
        assert index in plan, plan
    connection.close()


async def test_a_store_file_of_schema_2_gains_the_partial_indexes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = await start_store(StoreConfig(data_dir=data))
    client = get_client(url=store.url, api_key=None)
    await client.store.put_item(DOCS, key="hidden", value={"text": "x"}, index=False)
    await client.aclose()
    await store.runner.cleanup()
    with sqlite3.connect(data / "store.sqlite3") as file:
        file.execute("DROP INDEX items_unsearchable")
        file.execute("DROP INDEX items_unsearchable_by_updated")
        file.execute("PRAGMA user_version = 2")
    store = await start_store(StoreConfig(data_dir=data))
    client = get_client(url=store.url, api_key=None)
    try:
        found = await client.store.search_items(DOCS, query="x")
        assert _scored(found) == [("hidden", False)]
    finally:
        await client.aclose()
        await store.runner.cleanup()
    with sqlite3.connect(data / "store.sqlite3") as file:
        assert file.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        names = {row[0] for row in file.execute("SELECT name FROM sqlite_master")}
    assert {"items_unsearchable", "items_unsearchable_by_updated"} <= names
