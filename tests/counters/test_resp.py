"""The lean Redis connection (``gateway.counters.resp``) against real redis-server processes.

Each scenario runs on both event loops the gateway may run on: asyncio's own and uvloop's
(the one ``gateway serve`` uses; its transports are not ``asyncio.Transport`` subclasses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop
from redis.exceptions import AuthenticationError, ConnectionError, ResponseError

from gateway.counters.base import LimitCheck
from gateway.counters.errors import GivenUpError
from gateway.counters.factory import parse_counter_url, store_client
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resp import RespClient, pack
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisServer, free_port

Runner = Callable[[Awaitable[Any]], Any]
RUNNERS: dict[str, Runner] = {"asyncio": asyncio.run, "uvloop": uvloop.run}


@pytest.fixture(params=sorted(RUNNERS))
def run(request: pytest.FixtureRequest) -> Runner:
    return RUNNERS[request.param]


def client_for(url: str) -> RespClient:
    made = store_client(parse_counter_url(url))
    assert isinstance(made, RespClient)
    return made


def test_pipelines_of_concurrent_calls_get_their_own_replies_in_order(
    run: Runner, redis_server: RedisServer
) -> None:
    async def scenario() -> None:
        client = client_for(redis_server.url)
        keys = [new_key() for _ in range(40)]

        async def count(key: str, times: int) -> list[Any]:
            data = b"".join(pack(("INCR", key)) for _ in range(times))
            return await client.call(data, times)

        try:
            for _ in range(3):
                replies = await asyncio.gather(*(count(k, 1 + i % 5) for i, k in enumerate(keys)))
            for i, got in enumerate(replies):
                times = 1 + i % 5
                assert got == list(range(2 * times + 1, 3 * times + 1))
            assert client.connects == 1  # every round trip on one connection
        finally:
            await client.close()

    run(scenario())


def test_an_error_reply_is_its_own_entry(run: Runner, redis_server: RedisServer) -> None:
    async def scenario() -> None:
        client = client_for(redis_server.url)
        key = new_key()
        try:
            data = pack(("INCR", key)) + pack(("NOSUCHCOMMAND",)) + pack(("INCR", key))
            first, error, third = await client.call(data, 3)
            assert (first, third) == (1, 2)
            assert isinstance(error, ResponseError) and "NOSUCHCOMMAND" in str(error).upper()
            with pytest.raises(ResponseError):
                await client.command("NOSUCHCOMMAND")
            assert await client.command("PING") == b"PONG"  # the stream is still in step
        finally:
            await client.close()

    run(scenario())


def test_credentials_and_database(run: Runner, tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "auth", password="s3cret-pw").start()

    async def scenario() -> None:
        url = server.url.rsplit("/", 1)[0] + "/3"
        client = client_for(url)
        key = new_key()
        try:
            assert await client.command("SET", key, "x") == b"OK"
        finally:
            await client.close()
        assert server.cli("-n", "3", "GET", key).strip() == "x"
        assert server.cli("-n", "0", "EXISTS", key).strip() == "0"
        wrong = client_for(server.url.replace("s3cret-pw", "nope"))
        try:
            with pytest.raises(AuthenticationError) as caught:
                await wrong.command("PING")
            assert "nope" not in str(caught.value) and "s3cret" not in str(caught.value)
        finally:
            await wrong.close()

    try:
        run(scenario())
    finally:
        server.stop()


def test_a_restarted_server_costs_no_failed_call(run: Runner, own_redis: RedisServer) -> None:
    async def scenario() -> None:
        client = client_for(own_redis.url)
        key = new_key()
        try:
            assert await client.command("INCR", key) == 1
            own_redis.restart()  # the kept connection is dead; the next call replaces it
            assert await client.command("INCR", key) == 1  # no persistence: counts restart
            assert client.connects == 2
        finally:
            await client.close()

    run(scenario())


def test_a_call_given_up_drops_the_connection(run: Runner, own_redis: RedisServer) -> None:
    async def scenario() -> None:
        client = client_for(own_redis.url)
        key = new_key()
        try:
            assert await client.command("INCR", key) == 1
            own_redis.pause()
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.2):
                        await client.command("INCR", key)
            finally:
                own_redis.resume()
            # The late reply of the given-up call is never taken for this call's.
            assert await client.command("GET", key) in (b"1", b"2")
            assert client.connects == 2
        finally:
            await client.close()

    run(scenario())


def test_no_server_is_a_connection_error_naming_the_address(run: Runner) -> None:
    async def scenario() -> None:
        port = free_port()
        client = client_for(f"redis://user:pw-secret@127.0.0.1:{port}/0")
        try:
            with pytest.raises(ConnectionError) as caught:
                await client.command("PING")
            assert f"127.0.0.1:{port}" in str(caught.value)
            assert "pw-secret" not in str(caught.value)
        finally:
            await client.close()
        with pytest.raises(ConnectionError, match="closed"):
            await client.command("PING")

    run(scenario())


def test_a_peer_that_does_not_speak_resp_is_dropped(run: Runner) -> None:
    async def scenario() -> None:
        async def not_redis(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(100)
            writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(1)
            writer.close()

        server = await asyncio.start_server(not_redis, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = client_for(f"redis://127.0.0.1:{port}/0")
        try:
            with pytest.raises(GivenUpError, match="not RESP"):  # not sent again
                await client.command("PING")
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    run(scenario())


def test_the_counter_backend_on_the_wire_under_uvloop(redis_server: RedisServer) -> None:
    # What `gateway serve` runs: the counter script over the lean connection on uvloop,
    # including the script's first load (NOSCRIPT, then SCRIPT LOAD, then again).
    async def scenario() -> None:
        backend = RedisBackend(client_for(redis_server.url), name="redis")
        try:
            redis_server.cli("SCRIPT", "FLUSH")
            check = LimitCheck(new_key(), limit=3, window_ms=60_000, bucket_ms=1_000)
            assert [(await backend.hit([check])).admitted for _ in range(4)] == [
                True,
                True,
                True,
                False,
            ]
            batch = await backend.hit_many([[check], [LimitCheck(new_key(), 1, 1_000, 100)]])
            assert [r.admitted for r in batch if not isinstance(r, Exception)] == [False, True]
            assert await backend.healthy()
        finally:
            await backend.close()

    uvloop.run(scenario())


def test_a_setup_that_runs_out_of_time_closes_its_connection(run: Runner) -> None:
    # A server that accepts and never answers AUTH: each failed setup must close its
    # socket, or a slow server would collect one open connection per attempt.
    async def scenario() -> None:
        accepted = 0
        ended = 0

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted, ended
            accepted += 1
            while await reader.read(100):
                pass
            ended += 1  # the client closed its side
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = RespClient(host="127.0.0.1", port=port, password="pw", connect_timeout=0.2)
        try:
            for _ in range(3):
                with pytest.raises(ConnectionError, match=r"within 0\.2s"):
                    await client.command("PING")
            async with asyncio.timeout(5):
                while ended < 3:
                    await asyncio.sleep(0.01)
            assert accepted == 3 and ended == 3
        finally:
            await client.close()
            server.close()
            await server.wait_closed()

    run(scenario())


def test_a_health_check_that_gives_up_keeps_the_shared_connection(
    run: Runner, own_redis: RedisServer
) -> None:
    async def scenario() -> None:
        client = client_for(own_redis.url)
        key = new_key()
        try:
            assert await client.ping()
            own_redis.pause()
            try:
                counting = asyncio.ensure_future(client.command("INCR", key))
                await asyncio.sleep(0.05)
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.1):
                        await client.ping()
            finally:
                own_redis.resume()
            assert await counting == 1  # the round in flight was not failed by the check
            assert await client.ping()
            assert client.connects == 1
        finally:
            await client.close()

    run(scenario())


def test_an_empty_password_means_no_auth(run: Runner, redis_server: RedisServer) -> None:
    async def scenario() -> None:
        client = client_for(redis_server.url.replace("redis://", "redis://:@"))
        try:
            assert await client.command("PING") == b"PONG"
        finally:
            await client.close()

    run(scenario())
