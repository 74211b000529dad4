"""A body the built-in APIs cannot read gets a 422 whose detail says what is wrong in the
client's terms, never the interpreter's (user review: a 5,000-digit number was answered
with "...use sys.set_int_max_str_digits() to increase the limit", deep nesting with
"maximum recursion depth exceeded while decoding a JSON array from a unicode string")."""

from __future__ import annotations

import json

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstreams.http_api.decoding import NOT_UTF8, decode_json
from gateway.upstreams.http_api.problems import InvalidRequest
from gateway.upstreams.store.config import StoreConfig
from tests.store.store_support import start_store

BODIES = [
    (b"{", "body: malformed JSON (Expecting property name enclosed in double quotes: "
           "line 1 column 2)"),
    (b'{"namespace": ["a"],\n "key": }', "body: malformed JSON (Expecting value: line 2 "
                                         "column 9)"),
    (b"[" * 100_000 + b"]" * 100_000, "body: JSON nested too deeply"),
    (b'{"limit": ' + b"7" * 5000 + b"}", "body: a number has more than 4300 digits"),
]  # fmt: skip
INTERNALS = ("sys.", "recursion", "unicode string", "int_max_str_digits", "Traceback")


@pytest.mark.parametrize(("raw", "detail"), BODIES)
async def test_an_unreadable_body_is_described_in_the_clients_terms(tmp_path, raw, detail):
    store = await start_store(StoreConfig(data_dir=tmp_path / "data"))
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(
                store.url + "/store/items/search",
                data=raw,
                headers={"Content-Type": "application/json"},
            ) as r:
                assert r.status == 422
                got = (await r.json())["detail"]
        assert got == detail
        assert not any(word in got for word in INTERNALS)
    finally:
        await store.runner.cleanup()


# --- the body's encoding: UTF-8 only (RFC 8259 8.1) -----------------------------------
# json.loads given bytes guesses UTF-16 or UTF-32 from their NULs and decodes with
# ``surrogatepass``: the Store took UTF-16 bodies, and encoded lone surrogates, as JSON.

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
WIDE = ["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"]


@settings(max_examples=300, deadline=None)
@given(value=JSON_VALUES, encoding=st.sampled_from(WIDE))
def test_utf16_and_utf32_bodies_are_refused_and_utf8_taken(value: object, encoding: str) -> None:
    text = json.dumps({"v": value}, ensure_ascii=False)
    with pytest.raises(InvalidRequest) as refused:
        decode_json(text.encode(encoding))
    assert str(refused.value) == NOT_UTF8
    assert decode_json(text.encode("utf-8")) == {"v": value}
    assert decode_json(text.encode("utf-8-sig")) == {"v": value}  # a BOM is ignored


@settings(max_examples=500, deadline=None)
@given(raw=st.binary(max_size=40) | st.sampled_from([b'"\xed\xa0\x80"', b'["\xc0\xaf"]']))
def test_a_body_is_taken_only_as_strict_utf8_would_read_it(raw: bytes) -> None:
    """Differential: decode_json accepts exactly what strict UTF-8 (less a leading BOM)
    then ``json.loads`` of the text accepts, with the same value."""
    try:
        expected: object = json.loads(raw.decode("utf-8-sig"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        with pytest.raises(InvalidRequest):
            decode_json(raw)
        return
    if not raw.strip():
        return  # (an empty body has its own refusal)
    assert repr(decode_json(raw)) == repr(expected)  # (repr: NaN is not equal to itself)


def test_a_raw_nul_in_utf8_is_malformed_json_not_another_encoding() -> None:
    with pytest.raises(InvalidRequest, match=r"^body: malformed JSON \(Invalid control"):
        decode_json(b'{"key": "a\x00b"}')
    with pytest.raises(InvalidRequest) as refused:
        decode_json('{"key": "a"}'.encode("utf-16-le"))
    assert str(refused.value) == NOT_UTF8


async def test_the_store_refuses_a_utf16_body_and_stores_nothing(tmp_path):
    store = await start_store(StoreConfig(data_dir=tmp_path / "data"))
    item = {"namespace": ["wide"], "key": "k", "value": {"é": "ü"}}
    try:
        async with aiohttp.ClientSession() as http:
            headers = {"Content-Type": "application/json"}
            body = json.dumps(item, ensure_ascii=False).encode("utf-16")
            async with http.put(store.url + "/store/items", data=body, headers=headers) as r:
                assert r.status == 422
                assert (await r.json()) == {"detail": NOT_UTF8}
            params = {"namespace": "wide", "key": "k"}
            async with http.get(store.url + "/store/items", params=params) as r:
                assert r.status == 200 and await r.json() is None
            body = json.dumps(item, ensure_ascii=False).encode("utf-8")
            async with http.put(store.url + "/store/items", data=body, headers=headers) as r:
                assert r.status == 204
    finally:
        await store.runner.cleanup()
