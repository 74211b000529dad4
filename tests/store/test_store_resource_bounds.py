"""Three bounds on what one Store request may cost, on both backends:

* answers splice each value's stored JSON text, never parsing it: the same answer as the
  parsed one, for any value, and memory in proportion to the text, not to its parsed form;
* the PostgreSQL namespaces listing walks only what its page needs, and answers as SQLite's
  (and as a full walk) does;
* a search with a query pages at most ``store.max_search_depth`` deep (422 past it, saying
  what to do), so the candidates a ranking holds are bounded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.upstreams.http_api.json_values import MAX_JSON_NODES
from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.app import READ, STORAGE_KEY
from gateway.upstreams.store.backend import create_storage
from gateway.upstreams.store.config import MAX_SEARCH_DEPTH_CEILING, MIN_SEARCH_DEPTH
from gateway.upstreams.store.errors import StoreRequestError
from gateway.upstreams.store.models import (
    MAX_LIMIT,
    MAX_OFFSET,
    StoreListNamespacesRequest,
    StorePutRequest,
    StoreSearchRequest,
)
from gateway.upstreams.store.pg_storage import PostgresStorage
from gateway.upstreams.store.rows import answer_items, search_answer
from gateway.upstreams.store.storage import SQLiteStorage
from tests.support.embedding_server import EmbeddingServer

from .semantic_support import indexed_store_config
from .store_support import FakeClock, start_store
from .test_store_hardening import _LABELS, _random_pattern, _reference_listing

JSON = "application/json"


def _old_bytes(data: Any) -> bytes:
    """An answer as the Store serialised it before splicing: its parsed items, dumped."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()


# -- 1. answers splice the stored JSON text ---------------------------------------------


class _Raw:
    """A number as a client may spell it in a request body (``1E5``, ``-0``, ``1e-7``)."""

    def __init__(self, text: str) -> None:
        self.text = text


_SPELLINGS = [
    "1E5",
    "1e15",
    "-0",
    "-0.0",
    "0.1e-2",
    "1e308",
    "1.7976931348623157e308",
    "5e-324",
    "123456789012345678901234567890",
    "-9007199254740993",
    "2.5E+3",
    "1.0",
    "100",
]


def _render(node: Any, rng: random.Random) -> str:
    """``node`` as request body text, with the escapes and spacing chosen at random: the
    Store must store and answer the same value however it was written."""
    space = rng.choice(["", " ", "\n  "])
    if isinstance(node, _Raw):
        return node.text
    if isinstance(node, dict):
        inner = f",{space}".join(
            f"{_render(key, rng)}:{space}{_render(value, rng)}" for key, value in node.items()
        )
        return "{" + space + inner + space + "}"
    if isinstance(node, list):
        return "[" + f",{space}".join(_render(item, rng) for item in node) + "]"
    return json.dumps(node, ensure_ascii=rng.random() < 0.5)


def _parsed(node: Any) -> Any:
    if isinstance(node, _Raw):
        return json.loads(node.text)
    if isinstance(node, dict):
        return {key: _parsed(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_parsed(item) for item in node]
    return node


def _texts(nul: bool) -> st.SearchStrategy[str]:
    # Any code point but lone surrogates (refused); U+0000 only where it can be stored.
    excluded = [] if nul else ["\x00"]
    return st.text(
        st.characters(blacklist_categories=["Cs"], blacklist_characters=excluded), max_size=12
    )


def _values(nul: bool) -> st.SearchStrategy[Any]:
    leaves = (
        st.none()
        | st.booleans()
        | st.integers(-(2**70), 2**70)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.sampled_from(_SPELLINGS).map(_Raw)
        | _texts(nul)
    )
    return st.recursive(
        leaves,
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(_texts(nul), children, max_size=4)
        ),
        max_leaves=25,
    )


def test_answers_splice_stored_values_exactly_as_parsed_answers_were(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """For any value, however its body spelled it: the GET and the listing answer are the
    same bytes as the old parsed-then-serialised answers, the value reads back as written,
    and a ranked page serialises the same either way (scores included)."""
    postgres = store_database_url is not None
    loop = asyncio.new_event_loop()
    config = StoreConfig(data_dir=tmp_path / "data", database_url=store_database_url)
    store = loop.run_until_complete(start_store(config))
    storage = store.app[STORAGE_KEY]
    http = loop.run_until_complete(_session(store.url))
    names = itertools.count()

    @settings(
        max_examples=150,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(value=_values(nul=not postgres), seed=st.integers(0, 2**32))
    def check(value: Any, seed: int) -> None:
        rng = random.Random(seed)
        namespace = f"v{next(names)}"
        document = {"w": "apple", "v": value}
        body = f'{{"namespace":["{namespace}"],"key":"k","value":{_render(document, rng)}}}'
        loop.run_until_complete(_check_value(http, storage, namespace, body, _parsed(document)))

    try:
        check()
    finally:
        loop.run_until_complete(http.close())
        loop.run_until_complete(store.runner.cleanup())
        loop.close()


async def _session(url: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(url, timeout=aiohttp.ClientTimeout(total=30))


async def _check_value(
    http: aiohttp.ClientSession, storage: Any, namespace: str, body: str, written: Any
) -> None:
    async with http.put("/store/items", data=body.encode(), headers={"Content-Type": JSON}) as r:
        assert r.status == 204, await r.text()
    params = {"namespace": namespace, "key": "k", "refresh_ttl": "false"}
    async with http.get("/store/items", params=params) as r:
        assert r.status == 200
        got = await r.read()
    old = _old_bytes(await storage.get((namespace,), "k", False))
    assert got == old
    assert json.loads(got) == json.loads(old)
    assert json.loads(got)["value"] == written
    listing = {"namespace_prefix": [namespace], "refresh_ttl": False}
    async with http.post("/store/items/search", json=listing) as r:
        assert r.status == 200
        got = await r.read()
    parsed = await storage.search(READ.json(StoreSearchRequest, listing))
    assert got == _old_bytes({"items": parsed})
    assert json.loads(got)["items"][0]["value"] == written
    # A ranked page: both serialisations of the same rows (the score is a float).
    ranked = READ.json(StoreSearchRequest, {**listing, "query": "apple"})
    rows = await storage.search_rows(ranked)
    assert rows and rows[0][1] is not None
    spliced = search_answer(list(rows))
    assert spliced == _old_bytes({"items": answer_items(list(rows))})


async def test_an_answer_holds_memory_in_proportion_to_its_text(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """Values of empty lists (``[[],[],…]``) parse to about 24 times their text; answers
    splice the text, so a GET and a listing of them peak at a few times the text."""
    # Two of the costliest items to parse, back to back from one address: more than the
    # default parse budget lets one address take at once
    # (tests/integration/test_body_parse_fairness.py).
    config = StoreConfig(
        data_dir=tmp_path / "data",
        database_url=store_database_url,
        body_parse_share=1.0,
        body_parse_total_share=1.0,
        body_parse_burst_seconds=60.0,
    )
    store = await start_store(config)
    try:
        async with aiohttp.ClientSession(store.url) as http:
            # As many as a value may hold (MAX_JSON_NODES: the field's object and its list
            # count too), or as the body holds if fewer.
            count = min((config.max_body_bytes - 200) // 3, MAX_JSON_NODES - 2)
            value: dict[str, Any] = {"l": [[]] * count}
            text = len(json.dumps(value, separators=(",", ":")))
            for key in ("a", "b"):
                body = {"namespace": ["m"], "key": key, "value": value}
                raw = json.dumps(body, separators=(",", ":")).encode()
                async with http.put("/store/items", data=raw, headers={"Content-Type": JSON}) as r:
                    assert r.status == 204, await r.text()
            params = {"namespace": "m", "key": "a", "refresh_ttl": "false"}
            listing = {"namespace_prefix": ["m"], "limit": 2, "refresh_ttl": False}
            for items, ask in (
                (1, http.get("/store/items", params=params)),
                (2, http.post("/store/items/search", json=listing)),
            ):
                tracemalloc.start()
                try:
                    async with ask as r:
                        answer = await r.read()
                    _, peak = tracemalloc.get_traced_memory()
                finally:
                    tracemalloc.stop()
                assert r.status == 200
                assert len(answer) > items * text
                # Parsed, the values alone take ~24 x their text (~14 MB here).
                assert peak < 6 * items * text, (items, peak, text)
                del answer
    finally:
        await store.runner.cleanup()


# -- 2. the PostgreSQL namespaces listing ----------------------------------------------


_MORE_LABELS = [*_LABELS, "é", "😀", "a/", "a.", "Z"]


def _random_labels(rng: random.Random) -> list[str]:
    labels = [rng.choice(_MORE_LABELS) for _ in range(rng.randint(1, 5))]
    # '.' joins labels: a label may not hold it.
    return [label.replace(".", "-") for label in labels]


@pytest.fixture
async def both_storages(
    tmp_path: Path, pg_database_url: str
) -> AsyncIterator[tuple[SQLiteStorage, PostgresStorage, FakeClock]]:
    clock = FakeClock()
    sqlite = SQLiteStorage(StoreConfig(data_dir=tmp_path / "data"), clock)
    postgres = PostgresStorage(
        StoreConfig(data_dir=tmp_path / "pg", database_url=pg_database_url), clock
    )
    await sqlite.open()
    await postgres.open()
    try:
        yield sqlite, postgres, clock
    finally:
        await postgres.close()
        await sqlite.close()


async def test_postgres_namespaces_listing_answers_as_sqlite_and_a_full_walk(
    both_storages: tuple[SQLiteStorage, PostgresStorage, FakeClock],
) -> None:
    """Random namespace sets (expired ones among them), random prefix, suffix, max_depth,
    offset and limit: PostgreSQL's batched walk lists what SQLite's lazy one does, and what
    listing every namespace would."""
    sqlite, postgres, clock = both_storages
    rng = random.Random(20261127)
    live: set[str] = set()
    for round_ in range(3):
        for n in range(rng.choice([40, 150, 400])):
            labels = _random_labels(rng)
            body: dict[str, Any] = {"namespace": labels, "key": f"r{round_}k{n}", "value": {}}
            expiring = rng.random() < 0.2
            if expiring:
                body["ttl"] = 1
            put = READ.json(StorePutRequest, body)
            await asyncio.gather(sqlite.put(put), postgres.put(put))
            if not expiring:
                live.add(".".join(labels))
        clock.advance(120)  # this round's ttl=1 items are expired (not swept)
        for _ in range(250):
            request: dict[str, Any] = {
                "limit": rng.choice([1, 2, 3, 5, 10, 100, 1000]),
                "offset": rng.choice([0, 0, 1, 2, 5, 20, 90, 300]),
            }
            for field in ("prefix", "suffix"):
                pattern = _random_pattern(rng)
                if pattern is not None:
                    request[field] = pattern
            if rng.random() < 0.6:
                request["max_depth"] = rng.randint(1, 4)
            listing = READ.json(StoreListNamespacesRequest, request)
            expected = _reference_listing(live, request)
            assert await postgres.list_namespaces(listing) == expected, request
            assert await sqlite.list_namespaces(listing) == expected, request


async def test_postgres_namespaces_walk_reads_what_the_page_needs(pg_database_url: str) -> None:
    """With 3,000 namespaces, a short page or a shallow max_depth reads a few dozen
    namespaces from PostgreSQL, not all 3,000 (the rows the walk's batches brought)."""
    config = StoreConfig(data_dir=Path("/nonexistent"), database_url=pg_database_url)
    storage = PostgresStorage(config)
    await storage.open()
    try:
        await storage._execute(
            "INSERT INTO store_items (namespace, key, value, created_at, updated_at) "
            "SELECT 'org' || (n %% 3) || '.team' || (n %% 100) || '.user' || n, 'k', '{}', 1, 1 "
            "FROM generate_series(0, 2999) AS n",
            (),
        )
        now = storage._clock()

        async def fetched(body: dict[str, Any]) -> int:
            request = READ.json(StoreListNamespacesRequest, body)
            walk = await storage._list_namespaces(request, now)
            assert walk.page() == await storage.list_namespaces(request)
            return walk.fetched

        assert await fetched({"suffix": ["nobody"]}) == 3000  # matches nothing: whole walk
        assert await fetched({"limit": 1}) <= 8
        assert await fetched({"limit": 10, "offset": 10}) <= 21
        assert await fetched({}) <= 101
        assert await fetched({"max_depth": 1}) <= 4 * 8
        for body in (
            {"prefix": ["org1"], "max_depth": 2, "limit": 5},
            {"prefix": ["org2", "*"], "max_depth": 2, "limit": 3},
            {"max_depth": 2, "limit": 10},
        ):
            assert await fetched(body) <= 150, body
        page = await storage.list_namespaces(
            READ.json(StoreListNamespacesRequest, {"max_depth": 2, "limit": 3})
        )
        assert page == [["org0", "team0"], ["org0", "team1"], ["org0", "team10"]]
    finally:
        await storage.close()


# -- 3. how deep a search with a query may page --------------------------------------------


def test_max_search_depth_config() -> None:
    assert StoreConfig(data_dir=Path("d")).max_search_depth == 10_000
    config = StoreConfig.from_mapping({"max_search_depth": 50_000}, Path("d"))
    assert config.max_search_depth == 50_000
    # A first page of the largest limit always fits; the deepest page the API allows is
    # the top.
    assert MIN_SEARCH_DEPTH == MAX_LIMIT
    assert MAX_SEARCH_DEPTH_CEILING == MAX_OFFSET + MAX_LIMIT
    for bad in (MIN_SEARCH_DEPTH - 1, MAX_SEARCH_DEPTH_CEILING + 1):
        with pytest.raises(ValueError, match=r"store\.max_search_depth: must be between"):
            StoreConfig.from_mapping({"max_search_depth": bad}, Path("d"))
    with pytest.raises(ValueError, match=r"store\.max_search_depth: must be an integer"):
        StoreConfig.from_mapping({"max_search_depth": 1e4}, Path("d"))


async def _search(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post("/store/items/search", json={"refresh_ttl": False, **body}) as r:
        return r.status, await r.json()


async def test_a_search_past_max_search_depth_is_refused_saying_what_to_do(
    tmp_path: Path, store_database_url: str | None
) -> None:
    config = StoreConfig(
        data_dir=tmp_path / "data", database_url=store_database_url, max_search_depth=1000
    )
    store = await start_store(config)
    try:
        async with aiohttp.ClientSession(store.url) as http:
            for n in range(5):
                body = {"namespace": ["d"], "key": f"k{n}", "value": {"t": f"apple {n}"}}
                async with http.put("/store/items", json=body) as r:
                    assert r.status == 204
            query = {"namespace_prefix": ["d"], "query": "apple"}
            status, found = await _search(http, {**query, "limit": 5})
            assert status == 200 and len(found["items"]) == 5
            status, found = await _search(http, {**query, "offset": 990, "limit": 10})
            assert (status, found) == (200, {"items": []})  # ends at the bound: served
            for offset, limit in ((991, 10), (1000, 1), (1_000_000, 1000)):
                status, found = await _search(http, {**query, "offset": offset, "limit": limit})
                assert status == 422, found
                assert set(found) == {"detail"}
                detail = found["detail"]
                assert detail.startswith("offset: a search with a query ranks at most ")
                assert "store.max_search_depth (1000)" in detail
                assert f"offset + limit is {offset + limit}" in detail
                assert "namespace_prefix or filter" in detail and "without a query" in detail
            # Listing mode is not bound by it (it pages off an index).
            status, found = await _search(http, {"namespace_prefix": ["d"], "offset": 1000})
            assert (status, found) == (200, {"items": []})
            status, found = await _search(
                http, {"namespace_prefix": ["d"], "offset": 2, "limit": 1}
            )
            assert status == 200 and len(found["items"]) == 1
            # A blank query is listing mode too.
            status, found = await _search(http, {"query": " ", "offset": 5000})
            assert (status, found) == (200, {"items": []})
    finally:
        await store.runner.cleanup()


async def test_the_default_depth_bound_is_ten_thousand(
    tmp_path: Path, store_database_url: str | None
) -> None:
    store = await start_store(
        StoreConfig(data_dir=tmp_path / "data", database_url=store_database_url)
    )
    try:
        async with aiohttp.ClientSession(store.url) as http:
            query = {"query": "apple", "limit": 10}
            assert (await _search(http, {**query, "offset": 9990}))[0] == 200
            status, found = await _search(http, {**query, "offset": 9991})
            assert status == 422 and "store.max_search_depth (10000)" in found["detail"]
    finally:
        await store.runner.cleanup()


class _DepthRecorder:
    """A ranker (the storages' ranking hook) that records the depths it is asked for."""

    def __init__(self) -> None:
        self.depths: list[int] = []

    def __call__(
        self,
        connection: Any,
        scope_sql: str,
        scope_params: list[Any],
        bm25: Callable[[int], list[tuple[int, float]]],
        depth: int,
    ) -> list[tuple[int, float]]:
        self.depths.append(depth)
        return bm25(depth)

    def unscored(self, dialect: Any) -> str:
        return "i.search_text IS NULL"


async def test_storages_refuse_a_ranking_deeper_than_the_bound(
    tmp_path: Path, store_database_url: str | None, embedding_server: EmbeddingServer
) -> None:
    """The storages themselves refuse (for any caller, not just the app) before anything is
    ranked: the ranking hook is never asked for more than max_search_depth candidates."""
    config = dataclasses.replace(
        indexed_store_config(tmp_path / "data", embedding_server, store_database_url),
        max_search_depth=1000,
    )
    storage = create_storage(config)
    await storage.open()
    try:
        body = {"namespace": ["r"], "key": "k", "value": {"t": "apple"}}
        await storage.put(READ.json(StorePutRequest, body))
        ranker = _DepthRecorder()
        for offset, limit, refused in ((0, 10, False), (990, 10, False), (991, 10, True)):
            search = {"query": "apple", "offset": offset, "limit": limit, "refresh_ttl": False}
            request = READ.json(StoreSearchRequest, search)
            for use in (ranker, None):
                if refused:
                    with pytest.raises(StoreRequestError) as caught:
                        await storage.search_rows(request, use)
                    assert caught.value.status == 422
                else:
                    await storage.search_rows(request, use)
        assert ranker.depths == [10, 1000]
    finally:
        await storage.close()


async def test_an_indexed_search_too_deep_is_refused_before_the_query_is_embedded(
    tmp_path: Path, store_database_url: str | None, embedding_server: EmbeddingServer
) -> None:
    config = dataclasses.replace(
        indexed_store_config(tmp_path / "data", embedding_server, store_database_url),
        max_search_depth=2000,
    )
    store = await start_store(config)
    try:
        async with aiohttp.ClientSession(store.url) as http:
            for n in range(3):
                body = {"namespace": ["h"], "key": f"k{n}", "value": {"text": f"apple {n}"}}
                async with http.put("/store/items", json=body) as r:
                    assert r.status == 204
            asked = len(embedding_server.requests)
            status, found = await _search(http, {"query": "apple", "offset": 1991, "limit": 10})
            assert status == 422 and "store.max_search_depth (2000)" in found["detail"]
            assert len(embedding_server.requests) == asked  # no provider call for it
            status, found = await _search(http, {"query": "apple", "offset": 1, "limit": 10})
            assert status == 200 and len(found["items"]) == 2
            assert all(item["score"] is not None for item in found["items"])
    finally:
        await store.runner.cleanup()
