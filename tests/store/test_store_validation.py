"""Every validation rule of the Store answers 422 JSON naming the field (never text, never 500)."""

from __future__ import annotations

import json
import sys
from typing import Any

import aiohttp
import pytest
from langgraph_sdk.errors import UnprocessableEntityError

GOOD_PUT = {"namespace": ["a", "b"], "key": "k", "value": {"x": 1}}


def _put(**changes: Any) -> dict[str, Any]:
    body = {**GOOD_PUT, **changes}
    return {k: v for k, v in body.items() if v is not _DROP}


_DROP = object()


async def _expect(response: aiohttp.ClientResponse, status: int, field: str) -> str:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body) == {"detail"}
    assert isinstance(body["detail"], str)
    assert field in body["detail"], body["detail"]
    return str(body["detail"])


PUT_CASES = [
    (_put(namespace=_DROP), "namespace"),
    (_put(namespace=[]), "namespace"),
    (_put(namespace="a.b"), "namespace"),
    (_put(namespace=["a", ""]), "namespace[1]"),
    (_put(namespace=["a.b"]), "namespace[0]"),
    (_put(namespace=["a", 3]), "namespace[1]"),
    (_put(namespace=["langgraph", "x"]), "namespace[0]"),
    (_put(namespace=["x"] * 33), "namespace"),
    (_put(namespace=["x" * 257]), "namespace[0]"),
    (_put(key=_DROP), "key"),
    (_put(key=""), "key"),
    (_put(key=5), "key"),
    (_put(key="k" * 1025), "key"),
    (_put(value=_DROP), "value"),
    (_put(value=[1, 2]), "value"),
    (_put(value="text"), "value"),
    (_put(ttl=0), "ttl"),
    (_put(ttl=-5), "ttl"),
    (_put(ttl="10"), "ttl"),
    (_put(ttl=True), "ttl"),
    (_put(ttl=1e12), "ttl"),
    (_put(index=True), "index"),
    (_put(index="text"), "index"),
    (_put(index=[""]), "index[0]"),
    (_put(index=["a..b"]), "index[0]"),
    (_put(index=["a."]), "index[0]"),
]


@pytest.mark.parametrize(("body", "field"), PUT_CASES)
async def test_put_validation(http: aiohttp.ClientSession, body: Any, field: str) -> None:
    async with http.put("/store/items", json=body) as response:
        await _expect(response, 422, field)


SEARCH_CASES = [
    ({"limit": 0}, "limit"),
    ({"limit": 1001}, "limit"),
    ({"limit": "10"}, "limit"),
    ({"limit": True}, "limit"),
    ({"limit": 2.5}, "limit"),
    ({"offset": -1}, "offset"),
    ({"offset": "0"}, "offset"),
    ({"namespace_prefix": "a"}, "namespace_prefix"),
    ({"namespace_prefix": ["a.b"]}, "namespace_prefix[0]"),
    ({"namespace_prefix": [""]}, "namespace_prefix[0]"),
    ({"filter": [1]}, "filter"),
    ({"filter": "x"}, "filter"),
    ({"filter": {"n": {"$in": [1, 2]}}}, "filter.n"),
    ({"filter": {"n": {"$gt": 1, "$regex": "x"}}}, "filter.n"),
    ({"query": 5}, "query"),
    ({"query": "q" * 2049}, "query"),
    ({"refresh_ttl": "yes"}, "refresh_ttl"),
]


@pytest.mark.parametrize(("body", "field"), SEARCH_CASES)
async def test_search_validation(http: aiohttp.ClientSession, body: Any, field: str) -> None:
    async with http.post("/store/items/search", json=body) as response:
        await _expect(response, 422, field)


NAMESPACES_CASES = [
    ({"limit": 0}, "limit"),
    ({"limit": 1001}, "limit"),
    ({"offset": -1}, "offset"),
    ({"max_depth": 0}, "max_depth"),
    ({"max_depth": "2"}, "max_depth"),
    ({"prefix": "users"}, "prefix"),
    ({"suffix": ["a", ""]}, "suffix[1]"),
]


@pytest.mark.parametrize(("body", "field"), NAMESPACES_CASES)
async def test_list_namespaces_validation(
    http: aiohttp.ClientSession, body: Any, field: str
) -> None:
    async with http.post("/store/namespaces", json=body) as response:
        await _expect(response, 422, field)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"key": "k"}, "namespace"),
        ({"namespace": "a"}, "key"),
        ({"namespace": "a..b", "key": "k"}, "namespace: expected labels joined by '.'"),
        ({"namespace": "a", "key": ""}, "key"),
        ({"namespace": "a", "key": "k", "refresh_ttl": "maybe"}, "refresh_ttl"),
    ],
)
async def test_get_validation(http: aiohttp.ClientSession, params: Any, field: str) -> None:
    async with http.get("/store/items", params=params) as response:
        await _expect(response, 422, field)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"key": "k"}, "namespace"),
        ({"namespace": ["a"]}, "key"),
        ({"namespace": ["a.b"], "key": "k"}, "namespace[0]"),
    ],
)
async def test_delete_validation(http: aiohttp.ClientSession, body: Any, field: str) -> None:
    async with http.delete("/store/items", json=body) as response:
        await _expect(response, 422, field)


@pytest.mark.parametrize(
    "method", ["PUT", "DELETE", "POST /store/items/search", "POST /store/namespaces"]
)
@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"text"', b"null", b"\xff\xfe", b"[" * 100_000],
)
async def test_malformed_bodies_are_422(
    http: aiohttp.ClientSession, method: str, raw: bytes
) -> None:
    verb, _, path = method.partition(" ")
    async with http.request(verb, path or "/store/items", data=raw) as response:
        await _expect(response, 422, "body")


async def test_too_large_body_is_413_json(http: aiohttp.ClientSession) -> None:
    big = {**GOOD_PUT, "value": {"blob": "x" * 1_100_000}}
    async with http.put("/store/items", json=big) as response:
        await _expect(response, 413, "body")

    async def chunks() -> Any:  # no Content-Length: the limit applies while reading
        for _ in range(40):
            yield b"x" * 32_768

    async with http.put("/store/items", data=chunks()) as response:
        await _expect(response, 413, "body")


async def test_unknown_paths_and_methods_are_json(http: aiohttp.ClientSession) -> None:
    async with http.get("/store/nothing-here") as response:
        await _expect(response, 404, "/store/nothing-here")
    async with http.patch("/store/items", json={}) as response:
        await _expect(response, 405, "PATCH")
        assert "PUT" in response.headers["Allow"]


async def test_empty_namespace_read_is_absent_not_an_error(http: aiohttp.ClientSession) -> None:
    async with http.get("/store/items", params={"namespace": "", "key": "k"}) as response:
        assert response.status == 200
        assert await response.json() is None


async def test_reads_under_the_reserved_label_are_allowed(sdk: Any) -> None:
    assert await sdk.get_item(["langgraph", "x"], key="k") is None
    assert (await sdk.search_items(["langgraph"]))["items"] == []


async def test_sdk_surfaces_422_as_unprocessable_entity(sdk: Any) -> None:
    with pytest.raises(UnprocessableEntityError) as raised:
        await sdk.put_item(["langgraph"], key="k", value={})
    assert raised.value.response.json()["detail"].startswith("namespace[0]")
    with pytest.raises(UnprocessableEntityError):
        await sdk.search_items(["a"], limit=5000)
    with pytest.raises(UnprocessableEntityError):
        await sdk.list_namespaces(max_depth=0)


async def test_nothing_was_stored_by_rejected_requests(
    sdk: Any, http: aiohttp.ClientSession
) -> None:
    for body, _ in PUT_CASES:
        async with http.put("/store/items", json=body) as response:
            assert response.status == 422
    assert (await sdk.search_items([], limit=1000))["items"] == []


# -- text SQLite cannot bind, numbers JSON cannot write, documents too deep to walk ---------

_SURROGATE = "\ud800"  # aiohttp's json= writes it as the escape "\ud800", as a client would

SURROGATE_CASES = [
    ("PUT", _put(namespace=["a", "b" + _SURROGATE]), "namespace[1]"),
    ("PUT", _put(key="k" + _SURROGATE), "key"),
    ("PUT", _put(value={"text": _SURROGATE}), "value.text"),
    ("PUT", _put(value={"list": ["ok", {"deep": _SURROGATE}]}), "value.list[1].deep"),
    ("PUT", _put(value={_SURROGATE: 1}), "value.\\ud800"),
    ("PUT", _put(index=["text" + _SURROGATE]), "index[0]"),
    ("DELETE", {"namespace": [_SURROGATE], "key": "k"}, "namespace[0]"),
    ("DELETE", {"namespace": ["a"], "key": _SURROGATE}, "key"),
    ("POST /store/items/search", {"query": "coffee " + _SURROGATE}, "query"),
    ("POST /store/items/search", {"namespace_prefix": ["a", _SURROGATE]}, "namespace_prefix[1]"),
    ("POST /store/items/search", {"filter": {_SURROGATE: 1}}, "filter.\\ud800"),
    ("POST /store/items/search", {"filter": {"k": _SURROGATE}}, "filter.k"),
    ("POST /store/items/search", {"filter": {"k": {"$gt": _SURROGATE}}}, "filter.k.$gt"),
    ("POST /store/items/search", {"filter": {"k": {"$eq": {"x": [_SURROGATE]}}}}, "filter.k.$eq"),
    ("POST /store/namespaces", {"prefix": ["a", _SURROGATE]}, "prefix[1]"),
    ("POST /store/namespaces", {"suffix": [_SURROGATE]}, "suffix[0]"),
]


@pytest.mark.parametrize(("method", "body", "field"), SURROGATE_CASES)
async def test_lone_surrogates_are_422_naming_the_field(
    http: aiohttp.ClientSession, method: str, body: Any, field: str
) -> None:
    verb, _, path = method.partition(" ")
    async with http.request(verb, path or "/store/items", json=body) as response:
        detail = await _expect(response, 422, field)
    assert "surrogate" in detail


def _raw(body: Any, **numbers: str) -> bytes:
    """``body`` as JSON text with each string ``"<name>"`` replaced by the number text given."""
    text = json.dumps(body)
    for name, number in numbers.items():
        text = text.replace(f'"<{name}>"', number)
    return text.encode()


NON_FINITE_CASES = [
    ("PUT", _raw(_put(value={"x": "<n>"}), n="1e400"), "value.x"),
    ("PUT", _raw(_put(value={"a": [1, {"b": "<n>"}]}), n="-1E400"), "value.a[1].b"),
    ("PUT", _raw(_put(ttl="<n>"), n="1e400"), "ttl"),
    ("POST /store/items/search", _raw({"filter": {"n": "<n>"}}, n="1e999"), "filter.n"),
    (
        "POST /store/items/search",
        _raw({"filter": {"n": {"$gt": "<n>"}}}, n="-1e400"),
        "filter.n.$gt",
    ),
    ("POST /store/items/search", _raw({"limit": "<n>"}, n="1e400"), "limit"),
    ("POST /store/items/search", _raw({"limit": "<n>"}, n="NaN"), "limit"),
    ("PUT", _raw(_put(value={"x": "<n>"}), n="Infinity"), "value.x"),
    ("POST /store/namespaces", _raw({"max_depth": "<n>"}, n="1e400"), "max_depth"),
]


@pytest.mark.parametrize(
    ("method", "raw", "field"), NON_FINITE_CASES, ids=[c[2] for c in NON_FINITE_CASES]
)
async def test_non_finite_numbers_are_422_naming_the_field(
    http: aiohttp.ClientSession, method: str, raw: bytes, field: str
) -> None:
    verb, _, path = method.partition(" ")
    headers = {"Content-Type": "application/json"}
    async with http.request(verb, path or "/store/items", data=raw, headers=headers) as response:
        await _expect(response, 422, field)


def _nested(levels: int, leaf: Any = 1) -> Any:
    node = leaf
    for level in range(levels):
        node = {"n": node} if (levels - level) % 2 else [node]  # the outermost: an object
    return node


DEPTH_CASES = [
    ("PUT", _put(value=_nested(64)), 204, ""),
    ("PUT", _put(value=_nested(65)), 422, "value"),
    ("PUT", _put(value={"deep": _nested(600)}), 422, "value.deep"),
    # The filter object is level 1 of its field, so an operand may nest 63 levels.
    ("POST /store/items/search", {"filter": {"k": _nested(63)}}, 200, ""),
    ("POST /store/items/search", {"filter": {"k": _nested(64)}}, 422, "filter.k"),
    ("POST /store/items/search", {"filter": {"k": {"$eq": _nested(500)}}}, 422, "filter.k.$eq"),
    ("POST /store/items/search", {"filter": {"k": {"$ne": _nested(500)}}}, 422, "filter.k.$ne"),
]


@pytest.mark.parametrize(("method", "body", "status", "field"), DEPTH_CASES)
async def test_nesting_depth_is_bounded(
    http: aiohttp.ClientSession, method: str, body: Any, status: int, field: str
) -> None:
    verb, _, path = method.partition(" ")
    async with http.request(verb, path or "/store/items", json=body) as response:
        if status == 422:
            detail = await _expect(response, 422, field)
            assert "64 levels" in detail
        else:
            assert response.status == status, await response.text()


async def test_typed_fields_refuse_nested_documents_by_type(http: aiohttp.ClientSession) -> None:
    body = {"prefix": _nested(200, "x")}
    async with http.post("/store/namespaces", json=body) as response:
        assert await _expect(response, 422, "prefix") == "prefix: expected an array, got object"


async def test_integers_beyond_double_range_are_422(http: aiohttp.ClientSession) -> None:
    """A 400-digit integer is read as infinity by double-based clients (the SDK's orjson
    fails on it), so it is refused like 1e400; the largest double still passes."""
    headers = {"Content-Type": "application/json"}
    for number in (str(10**400), str(-(10**400))):
        raw = _raw(_put(value={"n": "<n>"}), n=number)
        async with http.put("/store/items", data=raw, headers=headers) as response:
            await _expect(response, 422, "value.n")
        raw = _raw({"filter": {"n": {"$gte": "<n>"}}}, n=number)
        async with http.post("/store/items/search", data=raw, headers=headers) as response:
            await _expect(response, 422, "filter.n.$gte")
    largest = str(int(sys.float_info.max))
    raw = _raw(_put(value={"n": "<n>"}), n=largest)
    async with http.put("/store/items", data=raw, headers=headers) as response:
        assert response.status == 204, await response.text()
    raw = _raw({"filter": {"n": {"$gte": "<n>"}}}, n=largest)
    async with http.post("/store/items/search", data=raw, headers=headers) as response:
        assert response.status == 200, await response.text()
        assert [item["key"] for item in (await response.json())["items"]] == ["k"]


NUL_CASES = [
    (_put(namespace=["a", "b\x00c"]), "namespace[1]"),
    (_put(namespace=["\x00"]), "namespace[0]"),
    (_put(key="k\x00"), "key"),
    (_put(value={"x": ["ok", "\x00"]}), "value"),
    (_put(value={"\x00": 1}), "value"),
    (_put(namespace=["a\x00"], key="\x00", value={"\x00": 1}), "namespace[0]"),  # the first
]


@pytest.mark.parametrize(("body", "field"), NUL_CASES)
async def test_a_nul_is_stored_or_refused_naming_its_field(
    http: aiohttp.ClientSession, store_database_url: str | None, body: dict[str, Any], field: str
) -> None:
    """U+0000 is stored where the database can keep it (SQLite); PostgreSQL's refusal names
    the field that holds it (it named ``value`` for a namespace label or a key)."""
    async with http.put("/store/items", json=body) as r:
        if store_database_url is None:
            assert r.status == 204, await r.text()
            return
        detail = await _expect(r, 422, field)
    assert detail == f"{field}: the character U+0000 cannot be stored in the PostgreSQL store"
