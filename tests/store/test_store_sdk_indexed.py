"""The langgraph-sdk Store tests again, against a Store with an embedding index configured.

Every test of test_store_sdk.py runs here unchanged except the six that pin BM25's own
ranking (which words match, which items are excluded); with an index a query ranks by
meaning, so those are restated below for hybrid ranking.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.upstreams.store import StoreConfig
from tests.support.embedding_server import EmbeddingServer

from . import test_store_sdk as _plain
from .semantic_support import indexed_store_config, running_embedding_server

_BM25_RANKING = {
    "test_query_ranks_best_first_and_excludes_non_matching",
    "test_query_with_more_terms_prefers_items_matching_more_of_them",
    "test_query_with_filter_and_prefix",
    "test_query_that_matches_nothing_returns_no_items",
    "test_index_false_and_field_paths_choose_the_searchable_text",
    "test_rewriting_an_item_reindexes_its_text",
}
# The plain module's tests and fixtures, by name (pytest collects what a module holds).
for _name in dir(_plain):
    _value = getattr(_plain, _name)
    if (
        (_name.startswith("test_") and _name not in _BM25_RANKING)
        or hasattr(_value, "_fixture_function_marker")
        or hasattr(_value, "_pytestfixturefunction")
    ):
        globals()[_name] = _value
_keys = _plain._keys


@pytest.fixture
async def index_server() -> AsyncIterator[EmbeddingServer]:
    async for server in running_embedding_server():
        yield server


@pytest.fixture
def store_config(
    tmp_path: Path, index_server: EmbeddingServer, store_database_url: str | None
) -> StoreConfig:
    return indexed_store_config(tmp_path / "store-data", index_server, store_database_url)


async def test_indexed_query_ranks_best_first_with_scores_in_0_1(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="cats", limit=10)
    keys = _keys(found)
    assert keys[0] == "cats"  # first by words and by meaning
    scores = [item["score"] for item in found["items"]]
    assert all(0.0 <= score <= 1.0 for score in scores)
    assert scores == sorted(scores, reverse=True)


async def test_indexed_query_with_filter_and_prefix(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="cats", filter={"kind": "pet"})
    assert set(_keys(found)) == {"cats", "dogs"}  # the filter holds; dogs ranks by meaning
    assert _keys(found)[0] == "cats"
    found = await corpus.search_items(["kb", "food"], query="cat")
    assert _keys(found)[0] == "cat_food"
    assert {tuple(i["namespace"]) for i in found["items"]} == {("kb", "food")}


async def test_indexed_query_with_more_terms_prefers_items_matching_more(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="big cats in the savanna")
    assert _keys(found)[0] == "lions"


async def test_indexed_index_false_follows_the_ranked_items_with_score_null(sdk: Any) -> None:
    await sdk.put_item(["idx"], key="hidden", value={"text": "secret giraffe"}, index=False)
    titled = {"title": "giraffe", "body": "x"}
    await sdk.put_item(["idx"], key="titled", value=titled, index=["title"])
    found = await sdk.search_items(["idx"], query="giraffe")
    assert _keys(found) == ["titled", "hidden"]
    assert found["items"][0]["score"] is not None
    assert found["items"][1]["score"] is None


async def test_indexed_rewriting_an_item_reembeds_it(sdk: Any) -> None:
    await sdk.put_item(["re"], key="k", value={"text": "espresso"})
    await sdk.put_item(["re"], key="other", value={"text": "puppy"})
    assert _keys(await sdk.search_items(["re"], query="coffee"))[0] == "k"
    await sdk.put_item(["re"], key="k", value={"text": "sedan"})
    assert _keys(await sdk.search_items(["re"], query="car"))[0] == "k"
    await sdk.delete_item(["re"], key="k")
    assert _keys(await sdk.search_items(["re"], query="car")) == ["other"]
