"""Every Store call driven by the real langgraph-sdk client against a real server.

The base URL comes from the ``store_base_url`` fixture only, so the same tests can run
through the gateway proxy.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest


def _keys(response: dict[str, Any]) -> list[str]:
    return [item["key"] for item in response["items"]]


async def test_put_then_get_returns_the_item(sdk: Any) -> None:
    await sdk.put_item(["users", "u1"], key="prefs", value={"theme": "dark", "size": 3})
    item = await sdk.get_item(["users", "u1"], key="prefs")
    assert item["namespace"] == ["users", "u1"]
    assert item["key"] == "prefs"
    assert item["value"] == {"theme": "dark", "size": 3}
    assert datetime.fromisoformat(item["created_at"]) == datetime.fromisoformat(item["updated_at"])


async def test_get_of_an_absent_item_is_none(sdk: Any) -> None:
    assert await sdk.get_item(["users", "nobody"], key="missing") is None
    await sdk.put_item(["users", "u1"], key="prefs", value={"a": 1})
    # Same key in another namespace, and a parent namespace: both absent.
    assert await sdk.get_item(["users", "u2"], key="prefs") is None
    assert await sdk.get_item(["users"], key="prefs") is None


async def test_update_keeps_created_at_moves_updated_at_and_lists_first(sdk: Any) -> None:
    await sdk.put_item(["docs"], key="a", value={"v": 1})
    await sdk.put_item(["docs"], key="b", value={"v": 2})
    before = await sdk.get_item(["docs"], key="a")
    await sdk.put_item(["docs"], key="a", value={"v": 3})
    after = await sdk.get_item(["docs"], key="a")
    assert after["value"] == {"v": 3}
    assert after["created_at"] == before["created_at"]
    assert datetime.fromisoformat(after["updated_at"]) > datetime.fromisoformat(
        before["updated_at"]
    )
    listing = await sdk.search_items(["docs"])
    assert _keys(listing) == ["a", "b"]


async def test_delete_removes_and_deleting_absent_is_fine(sdk: Any) -> None:
    await sdk.put_item(["docs"], key="gone", value={"x": 1})
    await sdk.delete_item(["docs"], key="gone")
    assert await sdk.get_item(["docs"], key="gone") is None
    await sdk.delete_item(["docs"], key="gone")
    await sdk.delete_item(["never", "existed"], key="nope")
    assert (await sdk.search_items(["docs"]))["items"] == []


async def test_listing_is_newest_update_first_with_null_score(sdk: Any) -> None:
    for key in ["k0", "k1", "k2", "k3"]:
        await sdk.put_item(["notes"], key=key, value={"n": key})
    await sdk.put_item(["notes"], key="k1", value={"n": "touched"})
    listing = await sdk.search_items(["notes"])
    assert _keys(listing) == ["k1", "k3", "k2", "k0"]
    assert all(item["score"] is None for item in listing["items"])


async def test_namespace_prefix_matches_whole_labels(sdk: Any) -> None:
    await sdk.put_item(["a"], key="top", value={})
    await sdk.put_item(["a", "b"], key="mid", value={})
    await sdk.put_item(["a", "b", "c"], key="deep", value={})
    await sdk.put_item(["ab"], key="other", value={})
    await sdk.put_item(["a-b"], key="dash", value={})
    assert sorted(_keys(await sdk.search_items(["a"]))) == ["deep", "mid", "top"]
    assert sorted(_keys(await sdk.search_items(["a", "b"]))) == ["deep", "mid"]
    assert _keys(await sdk.search_items(["a", "b", "c"])) == ["deep"]
    assert _keys(await sdk.search_items(["a", "x"])) == []
    assert len((await sdk.search_items([]))["items"]) == 5


async def test_limit_and_offset_page_the_listing(sdk: Any) -> None:
    for index in range(12):
        await sdk.put_item(["paged"], key=f"k{index:02d}", value={"i": index})
    newest_first = [f"k{index:02d}" for index in reversed(range(12))]
    assert _keys(await sdk.search_items(["paged"])) == newest_first[:10]  # default limit 10
    assert _keys(await sdk.search_items(["paged"], limit=5)) == newest_first[:5]
    assert _keys(await sdk.search_items(["paged"], limit=5, offset=5)) == newest_first[5:10]
    assert _keys(await sdk.search_items(["paged"], limit=5, offset=10)) == newest_first[10:]
    assert _keys(await sdk.search_items(["paged"], limit=5, offset=12)) == []


@pytest.fixture
async def filter_items(sdk: Any) -> Any:
    values = {
        "one": {"n": 1, "color": "red", "flag": True, "tags": ["x", "y"], "meta": {"a": 1, "b": 2}},
        "two": {"n": 2, "color": "green", "flag": False, "tags": ["y"], "meta": {"a": 1}},
        "three": {"n": 3.0, "color": "blue", "flag": None, "tags": []},
        "text_n": {"n": "3", "color": "red"},
        "bool_n": {"n": True, "color": "red"},
        "no_n": {"color": "blue"},
    }
    for key, value in values.items():
        await sdk.put_item(["filters"], key=key, value=value)
    return sdk


async def _matching(sdk: Any, filter: dict[str, Any]) -> list[str]:
    return sorted(_keys(await sdk.search_items(["filters"], filter=filter, limit=100)))


@pytest.mark.parametrize(
    ("filter", "expected"),
    [
        ({"n": 1}, ["one"]),
        ({"n": 3}, ["three"]),  # 3 equals 3.0; the string "3" and true do not
        ({"n": "3"}, ["text_n"]),
        ({"n": True}, ["bool_n"]),
        ({"color": "red"}, ["bool_n", "one", "text_n"]),
        ({"color": "red", "n": 1}, ["one"]),  # keys are ANDed
        ({"flag": None}, ["three"]),
        ({"flag": False}, ["two"]),
        ({"tags": ["x", "y"]}, ["one"]),
        ({"tags": ["y", "x"]}, []),  # arrays are ordered
        ({"meta": {"b": 2, "a": 1}}, ["one"]),  # objects are not
        ({"n": {"$eq": 2}}, ["two"]),
        ({"n": {"$ne": 1}}, ["bool_n", "text_n", "three", "two"]),  # items without n excluded
        ({"n": {"$gt": 1}}, ["three", "two"]),  # "3" and true are not numbers: no match
        ({"n": {"$gte": 2}}, ["three", "two"]),
        ({"n": {"$lt": 3}}, ["one", "two"]),
        ({"n": {"$lte": 3}}, ["one", "three", "two"]),
        ({"n": {"$gt": 1, "$lt": 3}}, ["two"]),
        ({"color": {"$gt": "green"}}, ["bool_n", "one", "text_n"]),  # strings compare as text
        ({"color": {"$lt": 5}}, []),  # mismatched types: no match, not an error
        ({"n": {"$gt": "2"}}, ["text_n"]),
        # A null bound is the infinite one the SDK sends as null: every number is within it.
        ({"n": {"$gt": None}}, ["one", "three", "two"]),
        ({"color": {"$lt": None}}, []),  # strings are not ordered against a number
        ({"missing": {"$ne": 1}}, []),
    ],
)
async def test_filters(filter_items: Any, filter: dict[str, Any], expected: list[str]) -> None:
    assert await _matching(filter_items, filter) == expected


@pytest.fixture
async def corpus(sdk: Any) -> Any:
    documents = {
        ("kb", "animals"): {
            "cats": {
                "text": "Cats are small furry animals; cats purr and cats nap.",
                "kind": "pet",
            },
            "dogs": {"text": "Dogs are loyal animals that bark.", "kind": "pet"},
            "lions": {"text": "Lions are big cats living in the savanna.", "kind": "wild"},
        },
        ("kb", "food"): {
            "pasta": {"text": "Pasta with tomato sauce is an Italian dish.", "kind": "dish"},
            "cat_food": {"text": "Dry food for a cat.", "kind": "product"},
        },
    }
    for namespace, items in documents.items():
        for key, value in items.items():
            await sdk.put_item(list(namespace), key=key, value=value)
    return sdk


async def test_query_ranks_best_first_and_excludes_non_matching(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="cats", limit=10)
    keys = _keys(found)
    assert keys[0] == "cats"  # three mentions beat one
    assert set(keys) == {"cats", "lions", "cat_food"}  # stemming: cat ~ cats
    scores = [item["score"] for item in found["items"]]
    assert all(isinstance(score, float) and score > 0 for score in scores)
    assert scores == sorted(scores, reverse=True)


async def test_query_with_more_terms_prefers_items_matching_more_of_them(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="big cats in the savanna")
    assert _keys(found)[0] == "lions"


async def test_query_with_filter_and_prefix(corpus: Any) -> None:
    found = await corpus.search_items(["kb"], query="cats", filter={"kind": "pet"})
    assert _keys(found) == ["cats"]
    found = await corpus.search_items(["kb", "food"], query="cat")
    assert _keys(found) == ["cat_food"]
    found = await corpus.search_items(["kb"], query="animals", filter={"kind": {"$ne": "pet"}})
    assert _keys(found) == []


async def test_query_limit_and_offset_apply_after_ranking(corpus: Any) -> None:
    ranked = _keys(await corpus.search_items(["kb"], query="cats", limit=10))
    assert _keys(await corpus.search_items(["kb"], query="cats", limit=1)) == ranked[:1]
    assert _keys(await corpus.search_items(["kb"], query="cats", limit=2, offset=1)) == ranked[1:3]


async def test_query_that_matches_nothing_returns_no_items(corpus: Any) -> None:
    assert (await corpus.search_items(["kb"], query="zebra quantum"))["items"] == []
    assert (await corpus.search_items(["kb"], query="!!! ???"))["items"] == []
    # Operator-looking input is plain text, not FTS syntax.
    assert (await corpus.search_items(["kb"], query='NEAR(cats "dogs'))["items"] != []


async def test_index_false_and_field_paths_choose_the_searchable_text(sdk: Any) -> None:
    await sdk.put_item(["idx"], key="hidden", value={"text": "secret giraffe"}, index=False)
    await sdk.put_item(
        ["idx"], key="titled", value={"title": "giraffe facts", "body": "zebra"}, index=["title"]
    )
    await sdk.put_item(
        ["idx"],
        key="nested",
        value={"sections": [{"text": "okapi"}, {"text": "zebra"}], "note": "giraffe"},
        index=["sections[*].text"],
    )
    # An item with no searchable text follows the matches with score null, as langgraph's
    # InMemoryStore answers the items it holds no vectors for; "titled"'s body is not searchable.
    found = await sdk.search_items(["idx"], query="giraffe")
    assert [(item["key"], item["score"] is None) for item in found["items"]] == [
        ("titled", False),
        ("hidden", True),
    ]
    assert _keys(await sdk.search_items(["idx"], query="zebra")) == ["nested", "hidden"]
    # Not searchable is still stored and listed.
    assert (await sdk.get_item(["idx"], key="hidden"))["value"] == {"text": "secret giraffe"}
    assert "hidden" in _keys(await sdk.search_items(["idx"]))


async def test_rewriting_an_item_reindexes_its_text(sdk: Any) -> None:
    await sdk.put_item(["re"], key="k", value={"text": "apples"})
    await sdk.put_item(["re"], key="k", value={"text": "oranges"})
    assert _keys(await sdk.search_items(["re"], query="apples")) == []
    assert _keys(await sdk.search_items(["re"], query="oranges")) == ["k"]
    await sdk.delete_item(["re"], key="k")
    assert _keys(await sdk.search_items(["re"], query="oranges")) == []


@pytest.fixture
async def namespaces(sdk: Any) -> Any:
    for namespace in [
        ["users", "alice", "memories"],
        ["users", "alice", "prefs"],
        ["users", "bob", "memories"],
        ["docs", "public"],
        ["docs", "private", "memories"],
    ]:
        await sdk.put_item(namespace, key="k", value={})
    return sdk


async def test_list_namespaces_all_sorted(namespaces: Any) -> None:
    assert (await namespaces.list_namespaces())["namespaces"] == [
        ["docs", "private", "memories"],
        ["docs", "public"],
        ["users", "alice", "memories"],
        ["users", "alice", "prefs"],
        ["users", "bob", "memories"],
    ]


async def test_list_namespaces_prefix_suffix_depth(namespaces: Any) -> None:
    listed = await namespaces.list_namespaces(prefix=["users"])
    assert listed["namespaces"] == [
        ["users", "alice", "memories"],
        ["users", "alice", "prefs"],
        ["users", "bob", "memories"],
    ]
    listed = await namespaces.list_namespaces(suffix=["memories"])
    assert listed["namespaces"] == [
        ["docs", "private", "memories"],
        ["users", "alice", "memories"],
        ["users", "bob", "memories"],
    ]
    listed = await namespaces.list_namespaces(prefix=["users"], suffix=["memories"])
    assert listed["namespaces"] == [["users", "alice", "memories"], ["users", "bob", "memories"]]
    listed = await namespaces.list_namespaces(max_depth=2)
    assert listed["namespaces"] == [
        ["docs", "private"],
        ["docs", "public"],
        ["users", "alice"],
        ["users", "bob"],
    ]
    listed = await namespaces.list_namespaces(prefix=["users"], max_depth=1)
    assert listed["namespaces"] == [["users"]]
    listed = await namespaces.list_namespaces(prefix=["users", "*", "memories"])
    assert listed["namespaces"] == [["users", "alice", "memories"], ["users", "bob", "memories"]]
    assert (await namespaces.list_namespaces(prefix=["nope"]))["namespaces"] == []


async def test_list_namespaces_limit_offset(namespaces: Any) -> None:
    everything = (await namespaces.list_namespaces())["namespaces"]
    assert (await namespaces.list_namespaces(limit=2))["namespaces"] == everything[:2]
    assert (await namespaces.list_namespaces(limit=2, offset=2))["namespaces"] == everything[2:4]
    assert (await namespaces.list_namespaces(offset=5))["namespaces"] == []


async def test_deleted_items_leave_their_namespace_listing(sdk: Any) -> None:
    await sdk.put_item(["temp", "ns"], key="only", value={})
    await sdk.delete_item(["temp", "ns"], key="only")
    assert (await sdk.list_namespaces(prefix=["temp"]))["namespaces"] == []


async def test_unicode_and_nested_values_round_trip(sdk: Any) -> None:
    value = {"name": "Zoë ✓ 雪", "nested": {"list": [1, 2.5, None, True, {"deep": "x"}]}}
    await sdk.put_item(["ünï", "çødé"], key="ключ", value=value)
    item = await sdk.get_item(["ünï", "çødé"], key="ключ")
    assert item["value"] == value
    assert _keys(await sdk.search_items(["ünï"], query="zoe")) == ["ключ"]
