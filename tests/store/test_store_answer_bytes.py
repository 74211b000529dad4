"""The bytes of item values an answer may hold: per answer (``store.max_answer_bytes``, 422
past it, never a shorter list than the items that exist) and in all answers being read or
sent (``store.max_answer_bytes_in_flight``, 503 with Retry-After), on both backends, for
listings, word searches and searches ranked by meaning; reservations are given back when the
answer is sent, fails, or its client goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import socket
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.upstreams.store import StoreConfig, answers, pg_storage
from gateway.upstreams.store.answers import AnswerBudget, AnswerBytes, value_bytes
from gateway.upstreams.store.app import READ, STORAGE_KEY, create_store_app
from gateway.upstreams.store.backend import StoreStorage, create_storage
from gateway.upstreams.store.errors import (
    AnswerClosedError,
    AnswersBusyError,
    AnswerTooLargeError,
)
from gateway.upstreams.store.index_config import IndexConfig
from gateway.upstreams.store.models import StorePutRequest, StoreSearchRequest
from gateway.upstreams.store.pg_storage import PostgresStorage
from gateway.upstreams.store.rows import _Row
from tests.support.embedding_server import EmbeddingServer

from .semantic_support import indexed_store_config, with_index
from .store_support import RunningStore, start_store

KiB = 1024
MiB = 1024 * KiB
_EMPTY = len('{"blob":""}')


def _text(value: Any) -> str:
    """A value's JSON text as the Store keeps and answers it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _value(size: int, seed: int, words: str = "") -> dict[str, Any]:
    """A value whose JSON text is exactly ``size`` bytes (ASCII)."""
    pad = size - _EMPTY - len(words)
    assert pad >= 0
    filler = (f"{seed:07d} " * (pad // 8 + 1))[:pad]
    value = {"blob": words + filler}
    assert value_bytes(_text(value)) == size
    return value


def _bodies(
    namespace: list[str], sizes: list[int], words: str, index: bool
) -> list[dict[str, Any]]:
    """PUT bodies of items k0000, k0001, … under ``namespace``, values of ``sizes`` bytes;
    searchable by ``words`` only when ``index``."""
    bodies = []
    for n, size in enumerate(sizes):
        body: dict[str, Any] = {"namespace": namespace, "key": f"k{n:04d}"}
        body["value"] = _value(size, n, words)
        if not index:
            body["index"] = False
        bodies.append(body)
    return bodies


async def _fill(
    storage: StoreStorage,
    namespace: list[str],
    sizes: list[int],
    *,
    words: str = "",
    index: bool = False,
) -> None:
    """Items straight into ``storage`` (see ``_bodies``), many at once."""
    bodies = _bodies(namespace, sizes, words, index)
    await asyncio.gather(*(storage.put(READ.json(StorePutRequest, b)) for b in bodies))


async def _fill_http(
    http: aiohttp.ClientSession,
    namespace: list[str],
    sizes: list[int],
    *,
    words: str = "",
    index: bool = False,
) -> None:
    """Items through the app (so an indexed Store embeds them), one at a time."""
    for body in _bodies(namespace, sizes, words, index):
        async with http.put("/store/items", json=body) as response:
            assert response.status == 204, await response.text()


async def _post(
    http: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> tuple[int, Any, dict[str, str]]:
    async with http.post(path, json=body) as response:
        return response.status, await response.json(), dict(response.headers)


async def _search(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any, Any]:
    return await _post(http, "/store/items/search", {"refresh_ttl": False, **body})


async def _until(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.02)


def _idle(pool: AnswerBytes) -> bool:
    return pool.held == 0 and pool.open_answers == 0


def _config(tmp_path: Path, database_url: str | None, **settings: Any) -> StoreConfig:
    return StoreConfig(
        data_dir=tmp_path / "store-data",
        database_url=database_url,
        sqlite_synchronous="normal",
        **settings,
    )


# -- configuration ----------------------------------------------------------------------


def test_answer_bytes_settings(tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path)
    assert config.max_answer_bytes == 64 * MiB
    assert config.answer_bytes_in_flight == 256 * MiB
    config = StoreConfig.from_mapping(
        {"max_body_bytes": 4096, "max_answer_bytes": 4096, "max_answer_bytes_in_flight": 8192},
        tmp_path,
    )
    assert (config.max_answer_bytes, config.answer_bytes_in_flight) == (4096, 8192)
    assert StoreConfig(data_dir=tmp_path, max_answer_bytes=3 * MiB).answer_bytes_in_flight == (
        12 * MiB
    )
    with pytest.raises(ValueError, match=r"store\.max_answer_bytes: .*max_body_bytes \(1048576"):
        StoreConfig(data_dir=tmp_path, max_answer_bytes=MiB - 1)
    with pytest.raises(ValueError, match=r"store\.max_answer_bytes: "):
        StoreConfig(data_dir=tmp_path, max_answer_bytes=2**31)
    with pytest.raises(ValueError, match=r"store\.max_answer_bytes_in_flight: "):
        StoreConfig(data_dir=tmp_path, max_answer_bytes=2 * MiB, max_answer_bytes_in_flight=MiB)
    with pytest.raises(ValueError, match=r"store\.max_answer_bytes_in_flight: "):
        StoreConfig(data_dir=tmp_path, max_answer_bytes_in_flight=2**40)
    with pytest.raises(ValueError, match=r"store\.max_answer_bytes: must be an integer"):
        StoreConfig.from_mapping({"max_answer_bytes": "64M"}, tmp_path)
    assert config.answer_send_timeout_seconds == 30.0
    config = StoreConfig.from_mapping({"answer_send_timeout_seconds": 2}, tmp_path)
    assert config.answer_send_timeout_seconds == 2.0
    for bad in (0, -1, float("nan"), 3601):
        with pytest.raises(ValueError, match=r"store\.answer_send_timeout_seconds: must be"):
            StoreConfig(data_dir=tmp_path, answer_send_timeout_seconds=bad)
    with pytest.raises(ValueError, match=r"store\.answer_send_timeout_seconds: must be a number"):
        StoreConfig.from_mapping({"answer_send_timeout_seconds": "30s"}, tmp_path)


# -- one answer ---------------------------------------------------------------------------


async def test_an_answer_over_max_answer_bytes_is_refused_without_loading_it(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """200 items of 256 KiB (50 MiB) asked for at once, 2 MiB allowed: a 422 naming the
    setting, and the process never holds more than about the budget meanwhile."""
    config = _config(tmp_path, store_database_url, max_answer_bytes=2 * MiB)
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    try:
        await _fill(storage, ["big"], [256 * KiB] * 200)
        async with aiohttp.ClientSession(store.url) as http:
            tracemalloc.start()
            try:
                status, body, _ = await _search(http, {"namespace_prefix": ["big"], "limit": 200})
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert status == 422, body
            assert body["detail"].startswith(
                "limit: the answer would exceed store.max_answer_bytes"
            )
            assert f"({2 * MiB} bytes" in body["detail"]
            assert peak < 3 * config.max_answer_bytes, peak  # not ~50 MiB (x4 once parsed)
            assert _idle(storage.answers)
            # What fits is answered whole: 7 x 256 KiB.
            status, body, _ = await _search(http, {"namespace_prefix": ["big"], "limit": 7})
            assert status == 200
            assert len({item["key"] for item in body["items"]}) == 7
            assert all(len(item["value"]["blob"]) == 256 * KiB - _EMPTY for item in body["items"])
            assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


async def test_an_answer_up_to_max_answer_bytes_is_complete_and_one_item_more_is_refused(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """Values of exactly 100 bytes, 1000 allowed: 10 items are answered whole (a listing, and
    a word search whose ranking ends early so that unsearchable items follow it, both summed
    in one answer), 11 are refused; the pages agree with smaller pages."""
    config = _config(tmp_path, store_database_url, max_body_bytes=1000, max_answer_bytes=1000)
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    try:
        # Under one prefix: 6 items the query finds, 6 it cannot (no searchable text).
        await _fill(storage, ["both", "words"], [100] * 6, words="apple ", index=True)
        await _fill(storage, ["both", "plain"], [100] * 6)
        async with aiohttp.ClientSession(store.url) as http:
            for extra in ({}, {"query": "apple"}):
                search = {"namespace_prefix": ["both"], **extra}
                status, whole, _ = await _search(http, {**search, "limit": 10})
                assert status == 200, whole
                assert len(whole["items"]) == 10
                assert sum(value_bytes(_text(item["value"])) for item in whole["items"]) == 1000
                status, first, _ = await _search(http, {**search, "limit": 5})
                status2, second, _ = await _search(http, {**search, "limit": 5, "offset": 5})
                assert (status, status2) == (200, 200)
                assert first["items"] + second["items"] == whole["items"]
                status, body, _ = await _search(http, {**search, "limit": 11})
                assert status == 422, body
                assert "store.max_answer_bytes (1000 bytes" in body["detail"]
                status, body, _ = await _search(http, {**search, "limit": 10, "offset": 2})
                assert status == 200 and len(body["items"]) == 10
            assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


async def test_limit_one_answers_the_largest_item_even_one_stored_larger_than_its_body(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """max_answer_bytes may equal max_body_bytes: the largest item a body can carry comes
    back with limit=1. A value can be stored larger than its body (``1e15`` is kept as
    ``1000000000000000.0``): alone, it is still answered, by a search and by a GET."""
    limit = 64 * KiB
    config = _config(tmp_path, store_database_url, max_body_bytes=limit, max_answer_bytes=limit)
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    try:
        async with aiohttp.ClientSession(store.url) as http:
            envelope = '{"namespace":["l"],"key":"big","index":false,"value":{"blob":""}}'
            largest = {"blob": "x" * (limit - len(envelope))}
            count = (limit - 100) // 5
            numbers = {"n": [1e15] * count}
            written = {
                # Exactly max_body_bytes.
                "big": _text({"namespace": ["l"], "key": "big", "index": False, "value": largest}),
                # 1e15 as the client wrote it: 4 bytes of body, 18 stored.
                "grown": '{"namespace":["l"],"key":"grown","index":false,"value":{"n":['
                + ",".join(["1e15"] * count)
                + "]}}",
            }
            assert len(written["big"]) == limit
            for raw in written.values():
                assert len(raw) <= limit
                async with http.put(
                    "/store/items", data=raw.encode(), headers={"Content-Type": "application/json"}
                ) as response:
                    assert response.status == 204, await response.text()
            grown = await storage.get(("l",), "grown", False)
            assert grown is not None and value_bytes(_text(grown["value"])) > 3 * limit
            for offset in (0, 1):
                status, found, _ = await _search(
                    http, {"namespace_prefix": ["l"], "limit": 1, "offset": offset}
                )
                assert status == 200, found
                assert len(found["items"]) == 1
            keys = set()
            for offset in (0, 1):
                _, found, _ = await _search(
                    http, {"namespace_prefix": ["l"], "limit": 1, "offset": offset}
                )
                keys.add(found["items"][0]["key"])
                value = found["items"][0]["value"]
                assert value == (largest if found["items"][0]["key"] == "big" else numbers)
            assert keys == {"big", "grown"}
            status, body, _ = await _search(http, {"namespace_prefix": ["l"], "limit": 2})
            assert status == 422, body
            async with http.get("/store/items", params={"namespace": "l", "key": "grown"}) as got:
                assert got.status == 200
                assert (await got.json())["value"] == numbers
        assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


@pytest.mark.parametrize("ranking", ["hybrid", "vector"])
async def test_a_search_ranked_by_meaning_is_bounded_the_same_way(
    tmp_path: Path,
    embedding_server: EmbeddingServer,
    store_database_url: str | None,
    ranking: str,
) -> None:
    config = indexed_store_config(tmp_path / "d", embedding_server, store_database_url)
    config = dataclasses.replace(
        with_index(config, ranking=ranking), max_body_bytes=16 * KiB, max_answer_bytes=64 * KiB
    )
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    try:
        async with aiohttp.ClientSession(store.url) as http:
            words = "coffee espresso "
            await _fill_http(http, ["m"], [4 * KiB] * 16, words=words, index=True)
            # No vectors and no searchable text: they follow the ranking, score null.
            await _fill_http(http, ["m", "x"], [4 * KiB] * 4)
            search = {"namespace_prefix": ["m"], "query": "coffee"}
            status, found, _ = await _search(http, {**search, "limit": 16})
            assert status == 200, found
            assert len(found["items"]) == 16
            assert all(item["score"] is not None for item in found["items"])
            status, body, _ = await _search(http, {**search, "limit": 17})
            assert status == 422, body
            assert "store.max_answer_bytes" in body["detail"]
            # The ranking ends inside the page: the unscored items follow, in one budget.
            status, tail, _ = await _search(http, {**search, "limit": 8, "offset": 10})
            assert status == 200, tail
            assert len(tail["items"]) == 8
            assert [item["score"] is None for item in tail["items"]] == [False] * 6 + [True] * 2
            assert tail["items"][:6] == found["items"][10:]
            status, body, _ = await _search(http, {**search, "limit": 20})
            assert status == 422, body
        assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


# -- all answers at once ------------------------------------------------------------------


async def test_answers_past_the_bytes_in_flight_get_503_with_retry_after_until_room_is_back(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """Past the bytes in flight a search or GET gets 503 with Retry-After (the detail fits
    the operation), except an answer of at most SMALL_ANSWER_BYTES, always served."""
    assert MiB == answers.SMALL_ANSWER_BYTES
    config = _config(
        tmp_path,
        store_database_url,
        max_body_bytes=2 * MiB,
        max_answer_bytes=4 * MiB,
        max_answer_bytes_in_flight=4 * MiB,
    )
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    pool = storage.answers
    try:
        await _fill(storage, ["f"], [256 * KiB] * 10)  # 2.5 MiB
        await _fill(storage, ["g"], [3 * MiB // 2])  # one item over the small answers
        get_small = {"namespace": "f", "key": "k0001", "refresh_ttl": "false"}
        get_large = {"namespace": "g", "key": "k0000", "refresh_ttl": "false"}
        async with aiohttp.ClientSession(store.url) as http:
            other = pool.budget()  # another answer, holding 2 MiB
            other.take(2 * MiB)
            status, body, headers = await _search(http, {"namespace_prefix": ["f"], "limit": 10})
            assert status == 503, body
            assert headers["Retry-After"] == "1"
            assert "store.max_answer_bytes_in_flight" in body["detail"]
            assert "store.answer_send_timeout_seconds" in body["detail"]
            assert "smaller limit" in body["detail"]
            assert pool.held == 2 * MiB and pool.open_answers == 1
            # What still fits is served: 5 items, one GET.
            status, body, _ = await _search(http, {"namespace_prefix": ["f"], "limit": 5})
            assert status == 200 and len(body["items"]) == 5
            async with http.get("/store/items", params=get_large) as got:
                assert got.status == 200
            other.take(2 * MiB)  # 4 MiB held: only small answers are served now
            async with http.get("/store/items", params=get_large) as got:
                assert got.status == 503
                assert got.headers["Retry-After"] == "1"
                detail = (await got.json())["detail"]
                assert "store.max_answer_bytes_in_flight" in detail
                assert "retry shortly" in detail and "limit" not in detail
            status, body, _ = await _search(http, {"namespace_prefix": ["f"], "limit": 5})
            assert status == 503, body
            async with http.get("/store/items", params=get_small) as got:
                assert got.status == 200
            status, body, _ = await _search(http, {"namespace_prefix": ["f"], "limit": 4})
            assert status == 200 and len(body["items"]) == 4  # 1 MiB: small
            assert pool.held == 4 * MiB
            other.close()
            assert _idle(pool)
            status, body, _ = await _search(http, {"namespace_prefix": ["f"], "limit": 10})
            assert status == 200 and len(body["items"]) == 10
        assert _idle(pool)
    finally:
        await store.runner.cleanup()


async def _stalled_search(
    url: str, body: dict[str, Any]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send a search on a connection that never reads its answer (a tiny receive buffer,
    so the answer cannot hide in the kernel)."""
    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * KiB)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    raw = json.dumps(body).encode()
    writer.write(
        b"POST /store/items/search HTTP/1.1\r\nHost: store\r\n"
        b"Content-Type: application/json\r\n"
        b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw
    )
    await writer.drain()
    return reader, writer


async def test_an_answer_holds_its_bytes_until_sent_and_a_client_gone_gives_them_back(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """An answer whose client does not read it keeps its bytes reserved while it waits to be
    sent (a second one as large is refused 503, a small one served); once the client goes
    away they are given back and the large search is served."""
    config = _config(
        tmp_path,
        store_database_url,
        max_answer_bytes=16 * MiB,
        max_answer_bytes_in_flight=20 * MiB,
    )
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    pool = storage.answers
    answer = 60 * 256 * KiB
    try:
        await _fill(storage, ["big"], [256 * KiB] * 60)  # 15 MiB
        search = {"namespace_prefix": ["big"], "limit": 60, "refresh_ttl": False}
        _, writer = await _stalled_search(store.url, search)
        try:
            await _until(lambda: pool.held >= answer)
            await asyncio.sleep(0.3)
            assert pool.held == answer and pool.open_answers == 1  # still being sent
            async with aiohttp.ClientSession(store.url) as http:
                status, body, headers = await _search(http, search)
                assert status == 503, body
                assert headers["Retry-After"] == "1"
                status, body, _ = await _search(http, {**search, "limit": 10})
                assert status == 200 and len(body["items"]) == 10
                assert pool.held == answer
                writer.close()  # gone, with most of the answer unread
                await _until(lambda: _idle(pool))
                status, body, _ = await _search(http, search)
                assert status == 200 and len(body["items"]) == 60
            assert _idle(pool)
        finally:
            writer.close()
    finally:
        await store.runner.cleanup()


async def _closed(reader: asyncio.StreamReader) -> bool:
    """Read what the server sent until the connection ends: True once it has."""
    try:
        while await reader.read(MiB):
            pass
    except ConnectionError:
        pass
    return True


async def test_a_client_that_stalls_is_cut_off_after_the_send_timeout_and_small_answers_go_on(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """A client that does not read a large answer holds every byte in flight; a GET and a
    one-item listing are still answered 200 meanwhile (small answers skip the in-flight
    check), a larger search 503; after store.answer_send_timeout_seconds the stalled
    connection is aborted and its bytes given back."""
    config = _config(
        tmp_path,
        store_database_url,
        max_answer_bytes=16 * MiB,
        max_answer_bytes_in_flight=16 * MiB,
        answer_send_timeout_seconds=1.5,
    )
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    pool = storage.answers
    answer = 64 * 256 * KiB  # all 16 MiB in flight
    try:
        await _fill(storage, ["big"], [256 * KiB] * 64)
        await _fill(storage, ["tiny"], [7 + _EMPTY])
        search = {"namespace_prefix": ["big"], "limit": 64, "refresh_ttl": False}
        reader, writer = await _stalled_search(store.url, search)
        try:
            await _until(lambda: pool.held >= answer)
            async with aiohttp.ClientSession(store.url) as http:
                params = {"namespace": "big", "key": "k0003", "refresh_ttl": "false"}
                async with http.get("/store/items", params=params) as got:
                    assert got.status == 200
                    assert (await got.json())["key"] == "k0003"
                params = {"namespace": "tiny", "key": "k0000", "refresh_ttl": "false"}
                async with http.get("/store/items", params=params) as got:
                    assert got.status == 200
                status, body, _ = await _search(http, {**search, "limit": 1})
                assert status == 200 and len(body["items"]) == 1
                status, body, headers = await _search(http, {**search, "limit": 8})
                assert status == 503, body  # 2 MiB: not small
                assert headers["Retry-After"] == "1"
                # All of that while the stalled answer was still held.
                assert pool.held == answer and pool.open_answers == 1
                await _until(lambda: _idle(pool), seconds=15.0)
                async with asyncio.timeout(15.0):
                    assert await _closed(reader)  # the server cut the connection
                status, body, _ = await _search(http, search)
                assert status == 200 and len(body["items"]) == 64
            assert _idle(pool)
        finally:
            writer.close()
    finally:
        await store.runner.cleanup()


async def test_a_request_cancelled_while_its_items_are_read_leaves_nothing_reserved(
    tmp_path: Path, store_database_url: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With aiohttp's handler cancellation, a client that disconnects cancels the search
    mid-read: its reservation is given back at once, and on SQLite the reader thread, which
    goes on, cannot reserve anything for the abandoned answer."""
    config = _config(tmp_path, store_database_url, read_threads=1)
    app = create_store_app(config)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    storage = app[STORAGE_KEY]
    pool = storage.answers
    reading = threading.Event()
    go_on = threading.Event()
    go_on_async = asyncio.Event()
    late_reservations: list[BaseException] = []
    try:
        await _fill(storage, ["c"], [64 * KiB] * 20)
        if store_database_url is None:
            take = AnswerBudget.take

            def take_then_wait(self: AnswerBudget, size: int) -> None:
                try:
                    take(self, size)
                except Exception as exc:  # the abandoned answer refuses the reader
                    late_reservations.append(exc)
                    raise
                if not reading.is_set():
                    reading.set()
                    go_on.wait(30)

            monkeypatch.setattr(AnswerBudget, "take", take_then_wait)
        else:
            read_page = pg_storage.aread_page

            async def read_then_wait(budget: AnswerBudget, fetch: Any, first_read: int) -> Any:
                async def fetch_later(cutoff: int) -> Any:
                    reading.set()
                    await go_on_async.wait()
                    return await fetch(cutoff)

                return await read_page(budget, fetch_later, first_read)

            monkeypatch.setattr(pg_storage, "aread_page", read_then_wait)
        _, writer = await _stalled_search(url, {"namespace_prefix": ["c"], "limit": 20})
        await asyncio.to_thread(reading.wait, 30)
        assert pool.held > 0 and pool.open_answers == 1
        writer.close()
        await _until(lambda: _idle(pool))
        go_on.set()
        go_on_async.set()
        async with aiohttp.ClientSession(url) as http:
            # On SQLite this waits for the one reader thread: the abandoned read is over.
            status, body, _ = await _search(http, {"namespace_prefix": ["c"], "limit": 20})
            assert status == 200 and len(body["items"]) == 20
        assert _idle(pool)
        if store_database_url is None:
            assert [type(exc).__name__ for exc in late_reservations] == ["AnswerClosedError"]
    finally:
        go_on.set()
        go_on_async.set()
        await runner.cleanup()


async def test_a_failed_answer_gives_its_bytes_back(
    tmp_path: Path, store_database_url: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(tmp_path, store_database_url, max_answer_bytes=MiB)
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    try:
        await _fill(storage, ["e"], [64 * KiB] * 20)
        async with aiohttp.ClientSession(store.url) as http:
            status, _, _ = await _search(http, {"namespace_prefix": ["e"], "limit": 20})
            assert status == 422
            assert _idle(storage.answers)
            status, _, _ = await _search(
                http, {"namespace_prefix": ["e"], "filter": {"a": {"$x": 1}}}
            )
            assert status == 422
            assert _idle(storage.answers)

            def broken(self: _Row, score: float | None) -> Any:
                raise RuntimeError("cannot build the item")

            monkeypatch.setattr(_Row, "search_item_json", broken)
            status, body, _ = await _search(http, {"namespace_prefix": ["e"], "limit": 10})
            assert status == 500, body
            assert _idle(storage.answers)
            monkeypatch.undo()
            status, body, _ = await _search(http, {"namespace_prefix": ["e"], "limit": 10})
            assert status == 200 and len(body["items"]) == 10
        assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


# -- never a short page: any sizes, any page, any budget --------------------------------


class _IdRanker:
    """Ranks like hybrid search without an embedding provider: the word ranking's ids, then
    the other searchable items of the scope by id, so the ranked path (rows by id, then the
    unscored items after the ranking) runs on both backends."""

    def __init__(self, items_table: str) -> None:
        self.items = items_table

    def __call__(
        self,
        connection: Any,
        scope_sql: str,
        scope_params: list[Any],
        bm25: Callable[[int], list[tuple[int, float]]],
        depth: int,
    ) -> list[tuple[int, float]]:
        ranking = [item for item, _ in bm25(depth)]
        rest = connection.execute(
            f"SELECT i.id FROM {self.items} AS i WHERE {scope_sql} "
            f"AND i.search_text IS NOT NULL ORDER BY i.id LIMIT {depth}",
            scope_params,
        ).fetchall()
        ranking += [int(row[0]) for row in rest if int(row[0]) not in ranking]
        return [(item, 1.0 / (1 + rank)) for rank, item in enumerate(ranking[:depth])]

    def unscored(self, dialect: Any) -> str:
        return "i.search_text IS NULL"


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    items = draw(
        st.lists(
            st.tuples(st.integers(0, 1500), st.sampled_from("xé中😀"), st.booleans()),
            max_size=9,
        )
    )
    per_answer = draw(st.integers(1, 12_000))
    others = draw(st.sampled_from([0, 0, 1, 2_000, 20_000]))
    return {
        "items": items,
        "mode": draw(st.sampled_from(["listing", "words", "ranked"])),
        "limit": draw(st.integers(1, 10)),
        "offset": draw(st.integers(0, 4)),
        "per_answer": per_answer,
        "in_flight": per_answer + draw(st.integers(0, 12_000)),
        "others": others,
        "first_read": draw(st.sampled_from([1, 700, 4 * MiB])),
        "small": draw(st.sampled_from([0, 0, 500, 5_000])),
    }


def test_an_answer_is_complete_or_refused_never_short(
    tmp_path: Path, store_database_url: str | None
) -> None:
    """For any item sizes (UTF-8 of 1 to 4 bytes a character), page, bounds, bytes held by
    other answers and first PostgreSQL read: the answer is exactly the unbounded one, or 422
    exactly when it holds more than one item and more than the per-answer bound, or 503
    exactly when other answers hold bytes and it would take the total past the in-flight
    bound and it is not small (an empty answer takes nothing). Never fewer items."""
    index = IndexConfig(model="test-embed", dims=8, url="http://127.0.0.1:1/v1")
    config = _config(tmp_path, store_database_url, index=index)
    loop = asyncio.new_event_loop()
    storage = create_storage(config)
    loop.run_until_complete(storage.open())
    ranker = _IdRanker(storage.vector_dialect.items)
    namespaces = itertools.count()

    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(case=_cases())
    def check(case: dict[str, Any]) -> None:
        namespace = f"p{next(namespaces)}"
        puts = []
        for n, (size, char, searchable) in enumerate(case["items"]):
            words = "apple " if searchable else ""
            body: dict[str, Any] = {
                "namespace": [namespace],
                "key": f"k{n}",
                "value": {"t": words + (char + " ") * (size // 2)},
            }
            if not searchable:
                body["index"] = False
            puts.append(storage.put(READ.json(StorePutRequest, body)))

        async def fill() -> None:
            for put in puts:  # in order: distinct update times
                await put

        loop.run_until_complete(fill())
        search: dict[str, Any] = {
            "namespace_prefix": [namespace],
            "limit": case["limit"],
            "offset": case["offset"],
            "refresh_ttl": False,
        }
        if case["mode"] != "listing":
            search["query"] = "apple"
        request = READ.json(StoreSearchRequest, search)
        use = ranker if case["mode"] == "ranked" else None
        reference = loop.run_until_complete(storage.search(request, use))
        total = sum(value_bytes(_text(item["value"])) for item in reference)
        pool = AnswerBytes(case["per_answer"], case["in_flight"], small=case["small"])
        other = pool.budget()
        if case["others"]:
            other.take(case["others"])
        if isinstance(storage, PostgresStorage):
            storage.first_read_bytes = case["first_read"]
        outcome: Any
        with pool.budget() as budget:
            try:
                outcome = loop.run_until_complete(storage.search(request, use, budget))
            except AnswerTooLargeError:
                outcome = 422
            except AnswersBusyError:
                outcome = 503
            held = budget.bytes
        other.close()
        assert _idle(pool)
        fits_answer = len(reference) <= 1 or total <= case["per_answer"]
        others = case["others"]
        fits_flight = (
            others == 0
            or not reference
            or total <= case["small"]
            or others + total <= case["in_flight"]
        )
        if outcome == 422:
            assert not fits_answer
        elif outcome == 503:
            assert not fits_flight
        else:
            assert outcome == reference
            assert fits_answer and fits_flight
            assert held == total

    try:
        check()
    finally:
        loop.run_until_complete(storage.close())
        loop.close()


def test_answer_budget_unit_rules() -> None:
    pool = AnswerBytes(100, 150, small=0)
    with pool.budget() as one:
        one.take(500)  # one item alone always fits
        with pytest.raises(AnswerTooLargeError):
            one.take(1)
        assert pool.held == 500
    assert _idle(pool)
    a, b = pool.budget(), pool.budget()
    a.take(90)
    with pytest.raises(AnswersBusyError):
        b.take(61)
    b.take(60)
    assert b.grant(1000) == 0 and pool.held == 150
    a.close()
    assert b.grant(1000) == 40  # its own bound: 100
    b.settle(40, 10, 1)
    assert pool.held == 70
    b.close()
    b.close()
    assert _idle(pool)
    with pytest.raises(AnswerClosedError):
        b.take(1)
    with pytest.raises(AnswerClosedError):
        b.grant(1)
    # Answers of at most `small` bytes skip the in-flight check (still counted).
    pool = AnswerBytes(100, 150, small=20)
    a, d, b, c = pool.budget(), pool.budget(), pool.budget(get=True), pool.budget()
    a.take(90)
    d.take(60)
    assert pool.held == 150
    b.take(15)
    assert c.grant(1000) == 20 and pool.held == 185
    c.settle(20, 5, 1)
    with pytest.raises(AnswersBusyError, match=r"retry shortly$"):
        b.take(6)  # 21 bytes: no longer small
    c.take(15)  # 20: small
    with pytest.raises(AnswersBusyError, match="smaller limit"):
        c.take(1)
    for budget in (a, d, b, c):
        budget.close()
    assert _idle(pool)


def test_postgres_first_reads_leave_half_the_bytes_in_flight(tmp_path: Path) -> None:
    """A PostgreSQL page read is allowed some bytes before its size is known; all the reads
    its pools can run at once are allowed at most half the bytes in flight."""
    url = "postgresql://gw@127.0.0.1:1/gateway"  # nothing connects here
    default = PostgresStorage(StoreConfig(data_dir=tmp_path, database_url=url))
    assert default.first_read_bytes == answers.FIRST_READ_BYTES
    small = StoreConfig(data_dir=tmp_path, database_url=url, max_answer_bytes=MiB)
    assert PostgresStorage(small).first_read_bytes == 4 * MiB // (2 * 10)
    indexed = dataclasses.replace(
        small, index=IndexConfig(model="m", dims=8, url="http://127.0.0.1:1/v1")
    )
    assert PostgresStorage(indexed).first_read_bytes == 4 * MiB // (2 * (10 + 5))


async def test_a_postgres_page_read_again_gets_the_time_of_its_second_statement(
    tmp_path: Path, pg_database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page larger than its first reservation is read twice: two statements of about the
    statement timeout each (here a little more) must not run past the call's deadline
    (2 x database_timeout) and be counted as an outage (the breaker opened); the re-read is
    given one statement's time more."""
    timeout = 1.0
    config = _config(tmp_path, pg_database_url, database_timeout_seconds=timeout)
    store = await start_store(config)
    storage = store.app[STORAGE_KEY]
    assert isinstance(storage, PostgresStorage)
    storage.first_read_bytes = 1  # every page that holds a value is read twice
    reads: list[int] = []
    real = pg_storage.aread_page

    async def slow_page(
        budget: AnswerBudget, fetch: Callable[[int], Any], first_read: int
    ) -> list[Any]:
        async def slow(cutoff: int) -> list[Any]:
            reads.append(cutoff)
            rows: list[Any] = await fetch(cutoff)
            await asyncio.sleep(timeout * 1.1)  # a statement as slow as it may be (and more)
            return rows

        return await real(budget, slow, first_read)

    monkeypatch.setattr(pg_storage, "aread_page", slow_page)
    try:
        await _fill(storage, ["slow"], [4 * KiB] * 3)
        async with aiohttp.ClientSession(store.url) as http:
            status, body, _ = await _search(http, {"namespace_prefix": ["slow"], "limit": 3})
            assert status == 200, body
            assert len(body["items"]) == 3
        assert len(reads) == 2 and reads[0] == 1 and reads[1] == 3 * 4 * KiB
        assert storage.breaker.state == "closed"
        assert _idle(storage.answers)
    finally:
        await store.runner.cleanup()


# -- the document -------------------------------------------------------------------------


async def test_the_openapi_document_names_the_answer_bounds(running_store: RunningStore) -> None:
    async with aiohttp.ClientSession(running_store.url) as http:
        async with http.get("/store/openapi.json") as response:
            document = await response.json()
    search = document["paths"]["/store/items/search"]["post"]["responses"]
    assert "store.max_answer_bytes" in search["422"]["description"]
    assert "store.max_answer_bytes_in_flight" in search["503"]["description"]
    get = document["paths"]["/store/items"]["get"]["responses"]
    assert "store.max_answer_bytes_in_flight" in get["503"]["description"]
    put = document["paths"]["/store/items"]["put"]["responses"]
    assert "max_answer_bytes" not in json.dumps(put)
