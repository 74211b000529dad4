"""A body the built-in APIs cannot read gets a 422 whose detail says what is wrong in the
client's terms, never the interpreter's (user review: a 5,000-digit number was answered
with "...use sys.set_int_max_str_digits() to increase the limit", deep nesting with
"maximum recursion depth exceeded while decoding a JSON array from a unicode string")."""

from __future__ import annotations

import aiohttp
import pytest

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
