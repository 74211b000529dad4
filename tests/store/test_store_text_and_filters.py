"""Pure helpers: searchable text extraction, query expressions and filter parsing."""

from __future__ import annotations

import pytest

from gateway.upstreams.http_api.problems import InvalidRequest
from gateway.upstreams.store.app import READ
from gateway.upstreams.store.filters import FilterClause, canonical_json
from gateway.upstreams.store.models import StorePutRequest, StoreSearchRequest
from gateway.upstreams.store.text_index import (
    match_expression,
    searchable_text,
)

VALUE = {
    "title": "Hello",
    "n": 42,
    "flag": True,
    "none": None,
    "sections": [{"text": "one"}, {"text": "two"}, {"other": "three"}],
    "meta": {"author": {"name": "Ada"}},
}


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        (None, "Hello\n42\none\ntwo\nthree\nAda"),
        (False, None),
        (["title"], "Hello"),
        (["$"], "Hello\n42\none\ntwo\nthree\nAda"),
        (["sections[*].text"], "one\ntwo"),
        (["sections[1].text", "sections[-1]"], "two\nthree"),
        (["meta.author.name", "title"], "Ada\nHello"),
        (["missing", "title.deeper", "sections[9]"], None),
    ],
)
def test_searchable_text(paths: object, expected: str | None) -> None:
    put = READ.json(StorePutRequest, {"namespace": ["n"], "key": "k", "value": {}, "index": paths})
    assert searchable_text(VALUE, put.index_paths()) == expected


@pytest.mark.parametrize("path", ["", "a..b", "a.", ".a", "a[x]", "a[*", "a]b", "a[1]b"])
def test_bad_index_paths(path: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        READ.json(StorePutRequest, {"namespace": ["n"], "key": "k", "value": {}, "index": [path]})
    assert raised.value.status == 422
    assert raised.value.detail.startswith("index[0]")


def test_match_expression_quotes_terms_and_drops_stopwords() -> None:
    assert match_expression("What is the capital of France?") == '"capital" OR "france"'
    assert match_expression("the") == '"the"'  # only stopwords: keep them
    assert match_expression('say "hi" AND NOT x*') == '"say" OR "hi" OR "not" OR "x"'
    assert match_expression("   ?! ") is None


def test_filter_parsing() -> None:
    search = READ.json(
        StoreSearchRequest, {"filter": {"a": 1, "b": {"$gt": 2, "$lt": 5}, "c": {"x": 1}}}
    )
    assert search.clauses() == (
        FilterClause("a", "$eq", 1),
        FilterClause("b", "$gt", 2),
        FilterClause("b", "$lt", 5),
        FilterClause("c", "$eq", {"x": 1}),
    )
    with pytest.raises(InvalidRequest, match=r"filter\.b: unknown operator '\$in'"):
        READ.json(StoreSearchRequest, {"filter": {"b": {"$in": [1]}}})


def test_canonical_json_ignores_key_order_and_integral_floats() -> None:
    assert canonical_json({"b": [1.0, {"y": 2, "x": 1}], "a": True}) == canonical_json(
        {"a": True, "b": [1, {"x": 1, "y": 2}]}
    )
    assert canonical_json([True]) != canonical_json([1])
