"""The built-in APIs' own ports (the Store, the control plane) answer every error as their
documented ``{"detail": ...}`` JSON, also the requests aiohttp's parser refuses before any
middleware runs (a request line over 8190 bytes, a malformed header, broken chunked
framing): never plain text quoting the request's bytes, and only statuses their OpenAPI
documents list. And no answer names the server software's versions in ``Server``.

Everything is real HTTP on loopback: raw sockets for what a client library will not send.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.upstreams.control_plane import create_control_plane_app
from gateway.upstreams.http_api.serving import (
    CODED_BODY_DETAIL,
    SERVER_NAME,
    TRANSFER_CODED_DETAIL,
    ApiAppRunner,
    runner_for,
)
from gateway.upstreams.store import StoreConfig, create_store_app
from tests.control_plane.support import make_config
from tests.support.gateway import running_gateway

from .store_support import StoreProcess, spawn_store_process

# Bytes a client sends that an answer must never quote back.
MARKER = b"Zq9MarkerZq9"


@dataclass
class Served:
    name: str
    port: int
    url: str
    document: str  # the path of its OpenAPI document


def _store(tmp_path: Path) -> web.Application:
    return create_store_app(StoreConfig(data_dir=tmp_path / "store"))


def _control_plane(tmp_path: Path) -> web.Application:
    return create_control_plane_app(make_config(tmp_path / "cp"))


APPS: dict[str, tuple[Callable[[Path], web.Application], str]] = {
    "store": (_store, "/store/openapi.json"),
    "control-plane": (_control_plane, "/openapi.json"),
}


@asynccontextmanager
async def _served_on_loopback(runner: web.AppRunner) -> AsyncIterator[int]:
    """``runner`` serving on a free loopback port (yielded), cleaned up after."""
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@pytest.fixture(params=sorted(APPS))
async def served(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Served]:
    """The app served as the gateway serves its built-in upstreams (``runner_for``)."""
    factory, document = APPS[request.param]
    runner = runner_for(factory(tmp_path), access_log=None)
    assert isinstance(runner, ApiAppRunner)
    async with _served_on_loopback(runner) as port:
        yield Served(request.param, port, f"http://127.0.0.1:{port}", document)


async def _raw(port: int, data: bytes) -> bytes:
    """Send ``data`` and read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), timeout=30)
    finally:
        writer.close()


def _parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return status, fields, body


def _assert_no_version_banner(fields: dict[str, str]) -> None:
    server = fields.get("server", "")
    assert "aiohttp" not in server.lower() and "python" not in server.lower(), server


async def _documented_statuses(url: str, document: str) -> list[set[int]]:
    async with aiohttp.ClientSession() as http, http.get(url + document) as r:
        doc = await r.json()
    return [
        {int(status) for status in operation["responses"]}
        for operations in doc["paths"].values()
        for operation in operations.values()
    ]


MALFORMED = {
    "request line over 8190 bytes": (
        b"GET /" + MARKER + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    ),
    "header line over 8190 bytes": (
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + MARKER + b"b" * 9000 + b"\r\n\r\n"
    ),
    "header name with a space": b"GET / HTTP/1.1\r\nHost: x\r\nBad " + MARKER + b": y\r\n\r\n",
    "unknown method": b"G(T / HTTP/1.1\r\nHost: x\r\nX-M: " + MARKER + b"\r\n\r\n",
    "broken chunk size": (
        b"POST /store/items/search HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\nzz" + MARKER + b"\r\n{}\r\n0\r\n\r\n"
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_malformed_requests_get_documented_json_without_their_bytes(
    served: Served, case: str
) -> None:
    answer = await _raw(served.port, MALFORMED[case])
    status, fields, body = _parse(answer)
    assert MARKER not in answer and b"aaaaaaaa" not in answer and b"bbbbbbbb" not in answer
    assert 400 <= status < 500, answer[:300]
    assert fields["content-type"].startswith("application/json"), answer[:300]
    detail = json.loads(body)
    assert set(detail) == {"detail"} and isinstance(detail["detail"], str)
    _assert_no_version_banner(fields)
    # Listed by every operation of the API's document (the request names no operation).
    for statuses in await _documented_statuses(served.url, served.document):
        assert status in statuses


async def test_ordinary_answers_name_no_server_version(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        for method, path in (
            ("GET", served.document),  # 200
            ("GET", "/no/such/path"),  # 404
            ("PUT", served.document),  # 405
        ):
            async with http.request(method, served.url + path) as r:
                assert r.headers.get("Server") == SERVER_NAME, (method, path, r.status)
                _assert_no_version_banner({"server": r.headers.get("Server", "")})


async def _assert_nothing_written(served: Served) -> None:
    if served.name == "store":  # (the control plane's refusals write nothing either way)
        params = {"namespace": "coded", "key": "k"}
        async with aiohttp.ClientSession() as http:
            async with http.get(served.url + "/store/items", params=params) as r:
                assert r.status == 200 and await r.json() is None  # no such item


# --- request bodies with a content coding (aiohttp would inflate them, unbounded per chunk)

ITEM = json.dumps({"namespace": ["coded"], "key": "k", "value": {"x": 1}}).encode()
# 64 MiB of zeros in ~65 KB: inflated as it arrived, it held the loop for ~0.1 s a request.
BOMB = zlib.compress(b"\0" * (64 << 20), 9)

CODED_BODIES: dict[str, tuple[list[str], bytes]] = {
    "gzip": (["gzip"], gzip.compress(ITEM)),
    "GZIP, any case": (["GZip"], gzip.compress(ITEM)),
    "x-gzip": (["x-gzip"], gzip.compress(ITEM)),
    "deflate": (["deflate"], zlib.compress(ITEM)),
    "br": (["br"], b"\x0b\x02\x80" + ITEM),
    "an unknown coding": (["zstd"], ITEM),
    "identity, then gzip": (["identity, gzip"], gzip.compress(ITEM)),
    "gzip on a second field line": (["identity", "gzip"], gzip.compress(ITEM)),
    "bytes that are not gzip": (["gzip"], b"\x1f\x8bnot gzip at all" * 50),
    "a deflate bomb": (["deflate"], BOMB),
}


def _coded_request(path: str, codings: list[str], body: bytes, chunked: bool = False) -> bytes:
    fields = b"".join(b"Content-Encoding: " + c.encode() + b"\r\n" for c in codings)
    if chunked:
        framing, payload = (
            b"Transfer-Encoding: chunked\r\n",
            b"%x\r\n%s\r\n0\r\n\r\n"
            % (
                len(body),
                body,
            ),
        )
    else:
        framing, payload = b"Content-Length: %d\r\n" % len(body), body
    return (
        b"PUT " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + fields + framing + b"Connection: close\r\n\r\n" + payload
    )  # fmt: skip


@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
@pytest.mark.parametrize("case", sorted(CODED_BODIES))
async def test_a_body_with_a_content_coding_is_refused_before_anything_reads_it(
    served: Served, case: str, chunked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    codings, body = CODED_BODIES[case]
    path = "/store/items" if served.name == "store" else "/v2/deployments"
    with caplog.at_level(logging.DEBUG):
        answer = await _raw(served.port, _coded_request(path, codings, body, chunked))
    status, fields, raw = _parse(answer)
    assert status == 415, answer[:300]
    assert json.loads(raw) == {"detail": CODED_BODY_DETAIL}
    assert fields["accept-encoding"] == "identity"
    assert fields["content-type"].startswith("application/json")
    # Nothing inflated it: no decoding error, no traceback, at any level.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    for statuses in await _documented_statuses(served.url, served.document):
        assert 415 in statuses
    await _assert_nothing_written(served)


# Transfer codings besides chunked (RFC 9112 6.1): aiohttp framed the chunks and handed the
# body on still coded (422 "malformed JSON"); the gateway's own port answers 501. (Two
# Transfer-Encoding field lines are refused by aiohttp's parser already: 400, as JSON.)
TRANSFER_CODED: dict[str, list[bytes]] = {
    "gzip, chunked": [b"gzip, chunked"],
    "GZIP, any case": [b"GZip, chunked"],
    "an unknown coding": [b"x-zstd, chunked"],
}


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
@pytest.mark.parametrize("case", sorted(TRANSFER_CODED))
async def test_a_body_with_a_transfer_coding_but_chunked_is_not_implemented(
    served: Served, case: str, expect: bool
) -> None:
    path = "/store/items" if served.name == "store" else "/v2/deployments"
    fields = b"".join(b"Transfer-Encoding: " + value + b"\r\n" for value in TRANSFER_CODED[case])
    coded = gzip.compress(ITEM)
    answer = await _raw(
        served.port,
        b"PUT " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + fields + (b"Expect: 100-continue\r\n" if expect else b"") + b"Connection: close\r\n\r\n"
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(coded), coded),
    )  # fmt: skip
    status, headers, raw = _parse(answer)
    assert status == 501, answer[:300]
    assert b"100 Continue" not in answer  # the body is not asked for
    assert json.loads(raw) == {"detail": TRANSFER_CODED_DETAIL}
    assert headers["content-type"].startswith("application/json")
    for statuses in await _documented_statuses(served.url, served.document):
        assert 501 in statuses
    await _assert_nothing_written(served)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    codings=st.lists(
        st.lists(
            st.sampled_from(["identity", "IDENTITY", " identity ", "", "gzip", "br", "x-y"]),
            min_size=1,
            max_size=3,
        ).map(",".join),
        min_size=1,
        max_size=3,
    )
)
async def test_only_identity_codings_reach_the_store(tmp_path: Path, codings: list[str]) -> None:
    """Property: a PUT is refused with 415 exactly when some listed coding is not
    ``identity`` (any case, any spacing, any number of field lines); otherwise stored."""
    coded = any(
        token.strip(" \t").lower() not in ("", "identity")
        for line in codings
        for token in line.split(",")
    )
    runner = runner_for(_store(tmp_path / str(abs(hash(tuple(codings))))), access_log=None)
    async with _served_on_loopback(runner) as port:
        answer = await _raw(port, _coded_request("/store/items", codings, ITEM))
    assert _parse(answer)[0] == (415 if coded else 204), (codings, answer[:300])


async def test_the_built_in_apis_server_hands_a_coded_body_on_as_sent() -> None:
    """``ApiAppRunner`` never inflates: what a handler reads is the bytes on the wire (so a
    bomb costs its compressed size), whatever ``Content-Encoding`` says."""
    seen: list[bytes] = []

    async def echo(request: web.Request) -> web.Response:
        seen.append(await request.read())
        return web.Response(status=204)

    app = web.Application(client_max_size=1 << 20)
    app.router.add_put("/echo", echo)
    async with _served_on_loopback(ApiAppRunner(app, access_log=None)) as port:
        for codings, body in (CODED_BODIES["gzip"], CODED_BODIES["a deflate bomb"]):
            answer = await _raw(port, _coded_request("/echo", codings, body))
            assert _parse(answer)[0] == 204, answer[:300]
            assert seen.pop() == body  # not inflated (the bomb: 64 MiB if it were)


async def _head_then_read(port: int, head: bytes) -> tuple[asyncio.StreamReader, Any]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    return reader, writer


async def _final_answer_to_head(port: int, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send a request's head only (its body announced with ``Expect: 100-continue``) and
    read the answer: a final one, not ``100 Continue``."""
    reader, writer = await _head_then_read(port, head)
    try:
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
        assert not answer.startswith(b"HTTP/1.1 100"), answer[:200]
        status, fields, _ = _parse(answer)
        raw = await asyncio.wait_for(reader.readexactly(int(fields["content-length"])), timeout=30)
    finally:
        writer.close()
    return status, fields, raw


@pytest.mark.parametrize("case", ["gzip", "a deflate bomb"])
async def test_a_coded_body_is_refused_before_100_continue_asks_for_it(
    served: Served, case: str
) -> None:
    """With ``Expect: 100-continue`` aiohttp's own handler answered ``100 Continue`` and
    the client uploaded the body only to be refused: now the head alone is answered."""
    codings, body = CODED_BODIES[case]
    # An operation each API serves (an unserved method or path is refused the same way:
    # test_expect_on_a_request_no_route_takes_is_answered_as_the_routes_answer_it).
    path = "/store/items" if served.name == "store" else "/v2/deployments"
    head = _coded_request(path, codings, body).split(b"\r\n\r\n", 1)[0]
    head = head.replace(b"Connection: close", b"Expect: 100-continue") + b"\r\n\r\n"
    if served.name != "store":
        head = b"POST" + head.removeprefix(b"PUT")
    status, fields, raw = await _final_answer_to_head(served.port, head)
    assert status == 415 and json.loads(raw) == {"detail": CODED_BODY_DETAIL}
    assert fields["accept-encoding"] == "identity"
    assert fields["connection"].lower() == "close"  # the announced body is not wanted


async def test_an_uncoded_body_still_gets_100_continue(tmp_path: Path) -> None:
    head = (
        b"PUT /store/items HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(ITEM)
    )
    async with _served_on_loopback(runner_for(_store(tmp_path), access_log=None)) as port:
        reader, writer = await _head_then_read(port, head)
        try:
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
            assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(ITEM)
            final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
            assert final.startswith(b"HTTP/1.1 204"), final
        finally:
            writer.close()


async def test_an_unknown_expectation_is_answered_as_json_without_its_bytes(
    served: Served,
) -> None:
    head = b"GET " + served.document.encode() + b" HTTP/1.1\r\nHost: x\r\nExpect: x-" + MARKER
    answer = await _raw(served.port, head + b"\r\n\r\n")
    status, fields, raw = _parse(answer)
    assert status == 417 and MARKER not in answer, answer[:300]
    assert fields["content-type"].startswith("application/json")
    assert set(json.loads(raw)) == {"detail"}
    _assert_no_version_banner(fields)
    for statuses in await _documented_statuses(served.url, served.document):
        assert 417 in statuses


@pytest.mark.parametrize("where", ["no such path", "no such method"])
async def test_expect_on_a_request_no_route_takes_is_answered_as_the_routes_answer_it(
    served: Served, where: str
) -> None:
    """aiohttp's default Expect handler ran where no route matched: ``100 Continue`` (the
    client sent a body only to get 404) and, for an unknown expectation, plain text quoting
    the header. Now its 404/405 comes at once, as JSON, without ``100 Continue``."""
    path, method = ("/nowhere", b"POST") if where == "no such path" else (
        served.document, b"DELETE"
    )  # fmt: skip
    status_wanted = 404 if where == "no such path" else 405
    head = (
        method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    )
    status, fields, raw = await _final_answer_to_head(served.port, head)
    assert status == status_wanted and set(json.loads(raw)) == {"detail"}, (status, raw)
    assert fields["connection"].lower() == "close"  # the announced body is not wanted
    _assert_no_version_banner(fields)
    # An expectation no one knows, where no route is: the routes' JSON 417, not quoted.
    unknown = head.replace(b"Expect: 100-continue", b"Expect: x-" + MARKER)
    answer = await _raw(served.port, unknown)
    status, fields, raw = _parse(answer)
    assert status == 417 and MARKER not in answer, answer[:300]
    assert set(json.loads(raw)) == {"detail"}
    _assert_no_version_banner(fields)
    # A header that is not UTF-8 beside it (aiohttp keeps such bytes as surrogates, which
    # a re-encoding of the request refused: 500 and an error in the log).
    odd = head.replace(b"Host: x\r\n", b"Host: x\r\nX-Api-Key: \xff\xfe" + MARKER + b"\r\n")
    status, fields, raw = await _final_answer_to_head(served.port, odd)
    assert status == status_wanted and set(json.loads(raw)) == {"detail"}, (status, raw)
    # An empty Expect is no expectation (as aiohttp treats it where a route is).
    empty = (
        head.replace(b"Expect: 100-continue", b"Expect:").replace(
            b"Content-Length: 2\r\n", b"Content-Length: 2\r\nConnection: close\r\n"
        )
        + b"{}"
    )
    status, fields, raw = _parse(await _raw(served.port, empty))
    assert status == status_wanted and set(json.loads(raw)) == {"detail"}, (status, raw)


async def test_a_bodiless_request_passes_whatever_its_content_encoding_says(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        headers = {"Content-Encoding": "gzip"}
        async with http.get(served.url + served.document, headers=headers) as r:
            assert r.status == 200


@asynccontextmanager
async def _store_behind_a_gateway(tmp_path: Path) -> AsyncIterator[str]:
    """The gateway's URL, in front of a Store served as the gateway serves it."""
    async with (
        _served_on_loopback(runner_for(_store(tmp_path), access_log=None)) as port,
        running_gateway(None, builtin={"store": f"http://127.0.0.1:{port}"}) as gw,
    ):
        yield gw.url


async def test_a_coded_body_through_the_gateway_is_refused_by_the_store(tmp_path: Path) -> None:
    async with (
        _store_behind_a_gateway(tmp_path) as url,
        aiohttp.ClientSession(auto_decompress=False) as http,
    ):
        headers = {"Content-Encoding": "deflate", "Content-Type": "application/json"}
        async with http.put(url + "/store/items", data=BOMB, headers=headers) as r:
            assert r.status == 415
            assert (await r.json()) == {"detail": CODED_BODY_DETAIL}
        async with http.put(url + "/store/items", data=ITEM) as r:
            assert r.status == 204, await r.text()  # the same connection serves on


@pytest.fixture
async def store_process(tmp_path: Path) -> AsyncIterator[StoreProcess]:
    process = await spawn_store_process(tmp_path / "store")
    try:
        yield process
    finally:
        process.stop()


async def test_stand_alone_store_answers_a_long_request_line_as_json(
    store_process: StoreProcess,
) -> None:
    port = int(store_process.url.rsplit(":", 1)[1])
    answer = await _raw(port, MALFORMED["request line over 8190 bytes"])
    status, fields, body = _parse(answer)
    assert status == 400 and MARKER not in answer
    assert fields["content-type"].startswith("application/json")
    assert set(json.loads(body)) == {"detail"}
    _assert_no_version_banner(fields)


async def test_no_version_banner_reaches_clients_through_the_proxy(tmp_path: Path) -> None:
    async with _store_behind_a_gateway(tmp_path) as url, aiohttp.ClientSession() as http:
        params = {"namespace": "a", "key": "k"}
        async with http.get(url + "/store/items", params=params) as r:
            assert r.status == 200
            for value in r.headers.getall("Server", []):
                _assert_no_version_banner({"server": value})


def test_other_applications_keep_aiohttps_runner() -> None:
    runner: Any = runner_for(web.Application())
    assert type(runner) is web.AppRunner
