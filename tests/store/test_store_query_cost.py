"""What one search or put may cost, whatever the client sends.

* A filter is bounded as a whole (conditions, operators counted, and field names across its
  keys), not only in keys: 64 keys with six operators each once took one SQLite query to
  1.3 GB. Over the bound: 422 ``{"detail"}``, on both backends.
* The SQLite compilation walks the value once for all top-level keys instead of once per
  clause; a differential property test shows it selects exactly what the per-clause
  compilation selected, over random documents and filters.
* A read that runs past ``query_timeout_seconds`` on a SQLite reader is stopped (503 with a
  detail) and the reader serves the next request.
* The ``index`` argument cannot multiply an item's searchable text: a node selected twice,
  or below a node already selected, is indexed once.
"""

from __future__ import annotations

import itertools
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.filters import (
    CANONICAL_JSON_SQL_FUNCTION,
    MAX_FILTER_CONDITIONS,
    MAX_FILTER_KEYS,
    MAX_FILTER_TOTAL_PATH_FIELDS,
    FilterClause,
    _member_predicate,
    canonical_json_text,
    compile_filter,
)
from gateway.upstreams.store.models import StoreSearchRequest
from gateway.upstreams.store.text_index import index_steps, searchable_text

from .store_support import start_store

ALL_OPERATORS = {"$gt": 0, "$gte": 0, "$lt": 9, "$lte": 9, "$ne": 0, "$eq": 5}


async def _post(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(path, json=body) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, await response.json()


# -- bounds on the whole filter (both backends) -----------------------------------------


async def test_filter_conditions_and_path_fields_are_bounded_across_keys(
    http: aiohttp.ClientSession,
) -> None:
    async with http.put(
        "/store/items", json={"namespace": ["c"], "key": "k", "value": {"k0": 5, "k1": 5}}
    ) as response:
        assert response.status == 204
    # The reviewer's request: 64 keys (within MAX_FILTER_KEYS) x 6 operators = 384.
    costly = {f"k{i}": dict(ALL_OPERATORS) for i in range(MAX_FILTER_KEYS)}
    status, body = await _post(http, "/store/items/search", {"filter": costly})
    assert status == 422, body
    assert set(body) == {"detail"}
    assert "384 conditions" in body["detail"]
    assert str(MAX_FILTER_CONDITIONS) in body["detail"]
    # Exactly at the bound: answered.
    two_each = {f"k{i}": {"$gte": 0, "$lte": 9} for i in range(MAX_FILTER_CONDITIONS // 2)}
    assert len(two_each) <= MAX_FILTER_KEYS
    status, body = await _post(http, "/store/items/search", {"filter": two_each})
    assert status == 200, body
    one_more = {**two_each, "k0": {"$gte": 0, "$lte": 9, "$ne": 1}}
    status, body = await _post(http, "/store/items/search", {"filter": one_more})
    assert status == 422 and "conditions" in body["detail"], body
    # Field names summed over keys: 5 keys of 32 fields (160) is over, 4 (128) is not.
    deep = [".".join([f"x{n}"] + ["f"] * 31) for n in range(5)]
    status, body = await _post(http, "/store/items/search", {"filter": dict.fromkeys(deep, 1)})
    assert status == 422 and "field names" in body["detail"], body
    assert str(MAX_FILTER_TOTAL_PATH_FIELDS) in body["detail"]
    status, body = await _post(http, "/store/items/search", {"filter": dict.fromkeys(deep[:4], 1)})
    assert status == 200, body


def test_top_level_keys_share_one_walk_of_the_value() -> None:
    """SQLite keeps a parse of the value per json_each in the statement: 64 keys with two
    operators each were 128 parses; now the value is walked once."""
    raw = {f"k{i}": {"$gte": 0, "$lte": 9} for i in range(64)}
    clauses = StoreSearchRequest.model_validate({"filter": raw}).clauses()
    sql, params = compile_filter(clauses, "i.value")
    assert sql.count("json_each(") == 1
    assert sql.count("?") == len(params)
    nested = {"a.b": 1, "a.c": {"$gt": 0, "$lt": 5}, "a.d.e": 2, "f": 3}
    sql, _ = compile_filter(
        StoreSearchRequest.model_validate({"filter": nested}).clauses(), "i.value"
    )
    assert sql.count("json_each(") == 3  # the value, value.a, value.a.d


# -- the compilation selects what the per-clause compilation selected -------------------


def _per_clause_compile(clauses: tuple[FilterClause, ...], column: str) -> tuple[str, list[Any]]:
    """The previous compilation: one EXISTS with one json_each per field, per clause."""
    parts: list[str] = []
    params: list[Any] = []
    for clause in clauses:
        path = clause.path
        aliases = [f"f{depth}" for depth in range(len(path) - 1)] + ["f"]
        sources = [f"json_each({column}) AS {aliases[0]}"]
        for parent, alias in itertools.pairwise(aliases):
            sources.append(
                f"json_each(CASE WHEN {parent}.type = 'object' THEN {parent}.value END) AS {alias}"
            )
        conditions = " AND ".join(f"{alias}.key = ?" for alias in aliases)
        predicate, predicate_params = _member_predicate(clause, "f")
        parts.append(
            f"EXISTS (SELECT 1 FROM {', '.join(sources)} WHERE {conditions} AND ({predicate}))"
        )
        params.extend(path)
        params.extend(predicate_params)
    return (" AND ".join(parts) if parts else "1"), params


NAMES = st.sampled_from(["a", "b", "c"])
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-2, 2)
    | st.sampled_from([1.0, 2.5, -0.5, 2**70])
    | st.sampled_from(["", "a", "b", "é"])
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=3),
    max_leaves=12,
)
DOCUMENTS = st.lists(st.dictionaries(NAMES, VALUES, max_size=3), min_size=1, max_size=6)
PATHS = st.lists(NAMES, min_size=1, max_size=5).map(".".join)
OPERANDS = VALUES
CONDITIONS = OPERANDS.filter(
    lambda v: not (isinstance(v, dict) and any(k.startswith("$") for k in v))
) | st.dictionaries(
    st.sampled_from(["$eq", "$ne", "$gt", "$gte", "$lt", "$lte"]), OPERANDS, min_size=1
)
FILTERS = st.dictionaries(PATHS, CONDITIONS, min_size=1, max_size=6)


@pytest.fixture(scope="module")
def documents_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sqlite3.Connection]:
    path: Path = tmp_path_factory.mktemp("filters") / "docs.sqlite3"
    connection = sqlite3.connect(path, isolation_level=None)
    connection.create_function(
        CANONICAL_JSON_SQL_FUNCTION, 1, canonical_json_text, deterministic=True
    )
    connection.execute("CREATE TABLE docs (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    yield connection
    connection.close()


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(documents=DOCUMENTS, raw_filter=FILTERS)
def test_shared_walk_selects_what_one_walk_per_clause_selected(
    documents_db: sqlite3.Connection, documents: list[dict[str, Any]], raw_filter: dict[str, Any]
) -> None:
    clauses = StoreSearchRequest.model_validate({"filter": raw_filter}).clauses()
    documents_db.execute("DELETE FROM docs")
    documents_db.executemany(
        "INSERT INTO docs (id, value) VALUES (?, ?)",
        [(n, json.dumps(doc, ensure_ascii=False)) for n, doc in enumerate(documents)],
    )

    def selected(compile_: Any) -> list[int]:
        sql, params = compile_(clauses, "i.value")
        rows = documents_db.execute(f"SELECT id FROM docs AS i WHERE {sql} ORDER BY id", params)
        return [row[0] for row in rows]

    assert selected(compile_filter) == selected(_per_clause_compile)


# -- per-query time budget on SQLite readers ---------------------------------------------


async def test_a_read_past_its_budget_is_stopped_with_503_and_the_reader_recovers(
    tmp_path: Path,
) -> None:
    # 300 items of 2,000 keys back to back from one address: more than the parse budget
    # lets one address take (tests/integration/test_body_parse_fairness.py).
    config = StoreConfig(
        data_dir=tmp_path / "store-data",
        query_timeout_seconds=0.02,
        body_parse_share=1.0,
        body_parse_total_share=1.0,
        body_parse_burst_seconds=3600.0,
    )
    store = await start_store(config)
    try:
        async with aiohttp.ClientSession(store.url) as http:
            value = {f"pad{i:04d}": i for i in range(2000)}
            value["k"] = 5
            for n in range(300):
                body = {"namespace": ["cost"], "key": f"i{n}", "value": value, "index": False}
                async with http.put("/store/items", json=body) as response:
                    assert response.status == 204
            # Every item is walked (the last key never matches).
            missing = {f"pad{i:04d}": {"$gte": 0, "$lte": 10_000} for i in range(40)}
            missing["k"] = 6
            status, body = await _post(
                http, "/store/items/search", {"namespace_prefix": ["cost"], "filter": missing}
            )
            assert status == 503, body
            assert set(body) == {"detail"}
            assert "budget" in body["detail"]
            # Each reader thread serves the next requests normally.
            for _ in range(config.read_threads * 2):
                async with http.get("/store/items?namespace=cost&key=i7") as response:
                    assert response.status == 200
                    assert (await response.json())["key"] == "i7"
                status, body = await _post(
                    http, "/store/items/search", {"namespace_prefix": ["cost"], "limit": 2}
                )
                assert status == 200 and len(body["items"]) == 2, body
    finally:
        await store.runner.cleanup()


# -- the index argument cannot multiply the searchable text -------------------------------

INDEX_KEYS = st.sampled_from(["t", "u", "v"])
INDEX_VALUES = st.recursive(
    st.none() | st.integers(-5, 5) | st.text(alphabet="xyz ", max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(INDEX_KEYS, inner, max_size=3),
    max_leaves=15,
)
INDEX_STEP = INDEX_KEYS | st.sampled_from(["[*]", "[0]", "[-1]", "[1]"])
INDEX_PATH = st.just("$") | st.lists(INDEX_STEP, min_size=1, max_size=3).map(
    lambda steps: "".join(
        s if s.startswith("[") or n == 0 else f".{s}" for n, s in enumerate(steps)
    )
).filter(lambda p: not p.startswith("["))


@settings(max_examples=500, deadline=None)
@given(
    value=st.dictionaries(INDEX_KEYS, INDEX_VALUES, max_size=3),
    paths=st.lists(INDEX_PATH, min_size=1, max_size=12),
)
def test_no_list_of_paths_indexes_more_than_its_distinct_nodes(
    value: dict[str, Any], paths: list[str]
) -> None:
    text = searchable_text(value, index_steps(paths)) or ""
    distinct = searchable_text(value, index_steps(list(dict.fromkeys(paths)))) or ""
    whole = searchable_text(value, None) or ""
    assert len(text) <= len(distinct)
    assert len(text) <= len(whole)
    # Every piece indexed is a leaf of the value, and none more often than the value has it.
    pieces, all_pieces = text.split("\n"), whole.split("\n")
    if text:
        assert all(pieces.count(p) <= all_pieces.count(p) for p in set(pieces))
    # The same paths in any repetition index the same text.
    assert searchable_text(value, index_steps(paths * 3)) == searchable_text(
        value, index_steps(paths)
    )


def test_whole_value_selected_many_ways_is_indexed_once() -> None:
    value = {"t": ["alpha beta", "gamma"], "n": 3}
    whole = searchable_text(value, None)
    assert searchable_text(value, index_steps(["$"] * 64)) == whole
    assert searchable_text(value, index_steps(["t[*]", "t", "$", "t[0]", "t[-2]"])) == whole
    assert searchable_text(value, index_steps(["t[0]", "t[-2]", "t[0]"])) == "alpha beta"


async def test_repeated_index_paths_do_not_raise_the_score(http: aiohttp.ClientSession) -> None:
    value = {"t": "needle hay " + " ".join(f"w{i}" for i in range(50))}
    for key, index in [("plain", None), ("many", ["$"] * 64), ("overlap", ["$", "t", "t"])]:
        body = {"namespace": ["amp"], "key": key, "value": value, "index": index}
        async with http.put("/store/items", json=body) as response:
            assert response.status == 204, await response.text()
    status, body = await _post(http, "/store/items/search", {"query": "needle", "limit": 10})
    assert status == 200, body
    scores = {item["key"]: item["score"] for item in body["items"]}
    assert set(scores) == {"plain", "many", "overlap"}
    assert scores["many"] == pytest.approx(scores["plain"])
    assert scores["overlap"] == pytest.approx(scores["plain"])
