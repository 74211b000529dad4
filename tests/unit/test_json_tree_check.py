"""The storable-JSON check of Store values, control-plane specs and search filters: one
pass that builds no path per node, with a bound on values (review, seventeenth session:
300,000 empty arrays in one Store item held the event loop ~1 s).

Differential: ``check_json_tree`` against ``path_per_node`` (the walk as it was, every
node carrying its path) over random trees holding lone surrogates, huge and non-finite
numbers, deep nesting and non-ASCII keys: the same trees are accepted, and a refused one
is refused with the message and path the old walk gave when it holds one problem, and in
any case at a node that has that problem."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic_core import PydanticCustomError

from gateway.upstreams.http_api.json_values import (
    _LARGEST_NUMBER,
    LONE_SURROGATE,
    MAX_JSON_DEPTH,
    MAX_JSON_NODES,
    check_json_tree,
    invalid_at,
)


def path_per_node(value: Any) -> Any:
    """The reference: the walk as it was before (depth and text and number checks)."""
    stack: list[tuple[Any, int, list[Any]]] = [(value, 1, [])]
    while stack:
        node, depth, path = stack.pop()
        if isinstance(node, str):
            _text(node, path)
        elif isinstance(node, float) or (isinstance(node, int) and not isinstance(node, bool)):
            if not -_LARGEST_NUMBER <= node <= _LARGEST_NUMBER:
                raise invalid_at(path, "must be a finite number (at most about 1.8e308)")
        elif isinstance(node, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise invalid_at(
                    path, f"arrays and objects may nest at most {MAX_JSON_DEPTH} levels deep"
                )
            if isinstance(node, dict):
                for key, child in node.items():
                    _text(key, [*path, key])
                    stack.append((child, depth + 1, [*path, key]))
            else:
                stack.extend((child, depth + 1, [*path, i]) for i, child in enumerate(node))
    return value


def _text(text: str, path: list[Any]) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid_at(path, LONE_SURROGATE) from None


def _problems(value: Any, depth: int = 1) -> int:
    """How many nodes the old walk would refuse (deep containers count once, at the
    shallowest: nothing below them is looked at)."""
    if isinstance(value, dict | list):
        if depth > MAX_JSON_DEPTH:
            return 1
        children = value.values() if isinstance(value, dict) else value
        keys = sum(_bad_text(k) for k in value) if isinstance(value, dict) else 0
        return keys + sum(_problems(c, depth + 1) for c in children)
    if isinstance(value, str):
        return int(_bad_text(value))
    if isinstance(value, float | int) and not isinstance(value, bool):
        return int(not -_LARGEST_NUMBER <= value <= _LARGEST_NUMBER)
    return 0


def _bad_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _at(value: Any, path: list[Any]) -> Any:
    for step in path:
        value = value[step]
    return value


TEXT = st.sampled_from(["", "a", "é", "\ud800", "x\udfff", "😀", "key"])
NUMBER = st.one_of(
    st.integers(-(10**310), 10**310), st.sampled_from([0.5, math.inf, -math.inf, math.nan, 1e308])
)
LEAF = st.one_of(TEXT, NUMBER, st.booleans(), st.none())
TREE = st.recursive(
    LEAF,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=30,
)


def _deep(levels: int, leaf: Any) -> Any:
    value = leaf
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


TREES = st.one_of(
    TREE,
    st.tuples(st.integers(MAX_JSON_DEPTH - 2, MAX_JSON_DEPTH + 2), LEAF).map(lambda t: _deep(*t)),
)


def _outcome(check: Any, value: Any) -> tuple[str, Any, str] | None:
    try:
        check(value)
    except PydanticCustomError as exc:
        return (exc.message_template, (exc.context or {}).get("path"), exc.type)
    return None


@settings(max_examples=1500, deadline=None)
@given(TREES)
def test_the_same_trees_refused_as_walking_with_a_path_per_node(value: Any) -> None:
    new, old = _outcome(check_json_tree, value), _outcome(path_per_node, value)
    assert (new is None) == (old is None), (new, old)
    if new is None:
        return
    message, path, _ = new
    if _problems(value) == 1:
        assert new == old
    # Whatever it reports is a node with that problem (or the container too deep).
    if message == LONE_SURROGATE:
        node, parent = _at(value, path), _at(value, path[:-1]) if path else None
        bad_key = isinstance(parent, dict) and isinstance(path[-1], str) and _bad_text(path[-1])
        assert (isinstance(node, str) and _bad_text(node)) or bad_key, (path, value)
    elif "finite" in message:
        assert not -_LARGEST_NUMBER <= _at(value, path) <= _LARGEST_NUMBER
    else:
        assert isinstance(_at(value, path), dict | list) and len(path) >= MAX_JSON_DEPTH - 1


def test_a_value_of_more_values_than_the_bound_is_refused_where_it_overflows() -> None:
    fits = {"l": [[]] * (MAX_JSON_NODES - 2)}
    assert check_json_tree(fits) is fits
    over = {"a": {"b": [0] * (MAX_JSON_NODES - 2)}}
    with pytest.raises(PydanticCustomError) as caught:
        check_json_tree(over)
    assert str(MAX_JSON_NODES) in caught.value.message()
    assert (caught.value.context or {}).get("path") == ["a", "b"]
    # Parsed from JSON as the Store reads it, too.
    with pytest.raises(PydanticCustomError):
        check_json_tree(json.loads("[" + ",".join(["[]"] * MAX_JSON_NODES) + "]"))
