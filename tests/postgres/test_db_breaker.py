"""The built-in Store's and control plane's PostgreSQL: fail fast while it is away.

Before the breaker, every request waited out the connect and pool timeouts for its 503,
and the control plane's requests did so one after another. Now the first request that finds
the database away opens a breaker: the next ones are answered 503 with ``Retry-After`` at
once, without asking the pool for a connection, one probe connection is tried per cool-down,
and the probe's success serves requests again. The breaker's state is what a readiness
check reports (``database_ready``).

The unit tests drive the breaker with a fake clock; the others stop and start a real
PostgreSQL (their own server, not the session's) under a Store and a control plane served on
loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import psycopg_pool
import pytest

from gateway.upstreams.control_plane.http_helpers import RUNTIME_KEY
from gateway.upstreams.control_plane.pg_storage import PostgresDatabase
from gateway.upstreams.postgres.breaker import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    DatabaseBreaker,
    database_breaker,
    database_ready,
)
from gateway.upstreams.postgres.connection import DatabaseUnavailable, is_outage, unavailable
from gateway.upstreams.store.app import STORAGE_KEY
from gateway.upstreams.store.config import StoreConfig
from gateway.upstreams.store.pg_storage import PostgresStorage
from tests.control_plane.support import (
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from tests.store.store_support import start_store
from tests.support.postgres_server import PostgresServer, postgres_server

TIMEOUT = 1.0  # database_timeout_seconds of both built-ins
RETRY = 0.5  # database_retry_seconds: the breaker's cool-down between probes
PASSWORD = "pw-never-logged-7f3a"
REFUSED_REQUESTS = 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _outage() -> DatabaseUnavailable:
    cause = psycopg.OperationalError("connection failed: Connection refused")
    failure = unavailable("store", cause)
    failure.__cause__ = cause
    return failure


# -- the breaker alone, on a fake clock ----------------------------------------------------


async def test_breaker_opens_on_an_outage_refuses_and_closes_on_one_probe() -> None:
    clock = FakeClock()
    # What each probe does: fail with an error, or wait for an event and succeed.
    answers: list[BaseException | asyncio.Event] = []
    probes = 0

    async def probe() -> None:
        nonlocal probes
        probes += 1
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        await answer.wait()

    breaker = DatabaseBreaker(
        "store", "postgresql://u:secret@db/x", probe=probe, retry_seconds=2.0, monotonic=clock
    )
    assert breaker.state == CLOSED and breaker.healthy
    breaker.refuse_unless_closed()  # closed: calls go through

    # A statement that fails on a database that answers does not open it.
    slow = unavailable("store", psycopg.errors.QueryCanceled("statement timeout"))
    breaker.failed(slow)
    assert breaker.state == CLOSED

    outage = _outage()
    breaker.failed(outage)
    assert breaker.state == OPEN and not breaker.healthy
    assert outage.retry_after == 2
    for _ in range(5):
        with pytest.raises(DatabaseUnavailable) as refused:
            breaker.refuse_unless_closed()
        assert refused.value.retry_after == 2
    assert breaker.refused == 5

    # Not before the cool-down: no probe.
    clock.now += 1.5
    assert await breaker.probe_once() is False
    assert probes == 0
    with pytest.raises(DatabaseUnavailable) as refused:
        breaker.refuse_unless_closed()
    assert refused.value.retry_after == 1  # 0.5 s left, rounded up

    # After it: one probe; it fails, so the breaker stays open for another cool-down.
    clock.now += 0.5
    answers.append(psycopg.OperationalError("still refused"))
    assert await breaker.probe_once() is False
    assert probes == 1 and breaker.state == OPEN
    assert await breaker.probe_once() is False  # the cool-down starts again
    assert probes == 1

    # A single probe at a time: while one runs, others do nothing.
    clock.now += 2.0
    gate = asyncio.Event()
    answers.append(gate)
    first = asyncio.create_task(breaker.probe_once())
    await asyncio.sleep(0)
    assert breaker.state == HALF_OPEN and not breaker.healthy
    assert await breaker.probe_once() is False
    with pytest.raises(DatabaseUnavailable):
        breaker.refuse_unless_closed()  # still refused while probing
    gate.set()
    assert await first is True
    assert probes == 2
    assert breaker.state == CLOSED and breaker.healthy
    breaker.refuse_unless_closed()
    assert breaker.openings == 1


async def test_breaker_logs_each_transition_once_without_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    fail = True

    async def probe() -> None:
        if fail:
            raise psycopg.OperationalError("refused")

    breaker = DatabaseBreaker(
        "store", f"postgresql://u:{PASSWORD}@db/x", probe=probe, retry_seconds=1, monotonic=clock
    )
    caplog.set_level(logging.DEBUG, logger="gateway.postgres")
    for _ in range(3):
        breaker.failed(_outage())
    for _ in range(3):
        clock.now += 1
        await breaker.probe_once()
    fail = False
    clock.now += 1
    assert await breaker.probe_once() is True
    await breaker.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert len(infos) == 1 and "answers again" in infos[0].getMessage()
    assert "postgresql://***@db/x" in warnings[0].getMessage()
    assert PASSWORD not in caplog.text


def test_what_counts_as_an_outage() -> None:
    assert is_outage(psycopg.OperationalError("connection refused"))  # client side
    assert is_outage(psycopg_pool.PoolTimeout("no connection"))
    assert is_outage(TimeoutError())
    assert is_outage(psycopg.errors.AdminShutdown("terminating connection"))
    assert is_outage(psycopg.errors.CannotConnectNow("starting up"))
    assert is_outage(psycopg.errors.TooManyConnections("too many"))
    # The database answered: one statement was slow, waited on a lock, or lost a race.
    assert not is_outage(psycopg.errors.QueryCanceled("statement timeout"))
    assert not is_outage(psycopg.errors.LockNotAvailable("lock timeout"))
    assert not is_outage(psycopg.errors.SerializationFailure("retry"))
    assert not is_outage(psycopg_pool.TooManyRequests("queue full"))


# -- a real PostgreSQL, stopped and started ------------------------------------------------


@pytest.fixture(scope="module")
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server these tests stop and start (not the session's)."""
    with postgres_server() as server:
        yield server


@pytest.fixture
def started_postgres(own_postgres: PostgresServer) -> Iterator[PostgresServer]:
    yield own_postgres
    # Whatever a test left it in, the next one finds it running.
    try:
        socket.create_connection(("127.0.0.1", own_postgres.port), timeout=5).close()
    except OSError:
        own_postgres.start()


def _requests(stats: dict[str, int]) -> int:
    """How many connections the pool was asked for."""
    return stats.get("requests_num", 0)


async def _answer(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> Any:
    async with http.request(method, url, **kw) as r:
        return r.status, dict(r.headers), await r.json(content_type=None)


def _assert_fast_503(status: int, response_headers: dict[str, str], body: Any) -> None:
    assert status == 503, body
    assert set(body) == {"detail"} and "unavailable" in body["detail"]
    assert int(response_headers["Retry-After"]) >= 1


async def _until_served(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> Any:
    """Ask until the answer is not 503 (the probe found the database back)."""
    deadline = time.monotonic() + 60
    while True:
        status, _, body = await _answer(http, method, url, **kw)
        if status != 503 or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.1)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def test_store_answers_503_at_once_while_postgres_is_stopped_then_serves_again(
    started_postgres: PostgresServer,
    tmp_path: Path,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    server = started_postgres
    name = server.create_database().rsplit("/", 1)[1]
    url = server.url(name, password=PASSWORD)  # trust auth: the password is only carried
    config = StoreConfig(
        data_dir=tmp_path,
        database_url=url,
        database_timeout_seconds=TIMEOUT,
        database_retry_seconds=RETRY,
    )
    store = await start_store(config)
    try:
        storage = store.app[STORAGE_KEY]
        assert isinstance(storage, PostgresStorage)
        breaker = database_breaker(store.app)
        assert breaker is not None and database_ready(store.app)
        item = {"namespace": ["b"], "key": "k", "value": {"n": 1}}
        get = {"namespace": "b", "key": "k"}
        async with http.put(store.url + "/store/items", json=item) as r:
            assert r.status == 204

        await asyncio.to_thread(server.stop)
        # The first request finds the database away (after its bounded wait): 503.
        status, response_headers, body = await _answer(
            http, "GET", store.url + "/store/items", params=get
        )
        _assert_fast_503(status, response_headers, body)
        assert not breaker.healthy and not database_ready(store.app)

        # The next ones are refused without asking the pool for a connection; the database
        # is connected to at most once per cool-down (by the probe).
        asked = _requests(storage.pool_stats())
        probes = breaker.probes
        started = time.monotonic()
        for n in range(REFUSED_REQUESTS):
            if n % 2:
                answer = await _answer(http, "GET", store.url + "/store/items", params=get)
            else:
                answer = await _answer(http, "PUT", store.url + "/store/items", json=item)
            _assert_fast_503(*answer)
        elapsed = time.monotonic() - started
        assert _requests(storage.pool_stats()) == asked
        assert breaker.probes - probes <= elapsed / RETRY + 1
        assert breaker.refused >= REFUSED_REQUESTS
        assert not database_ready(store.app)

        await asyncio.to_thread(server.start)  # same data, same port
        status, body = await _until_served(http, "GET", store.url + "/store/items", params=get)
        assert status == 200, body
        assert body["value"] == {"n": 1}
        assert breaker.healthy and database_ready(store.app)
        async with http.put(store.url + "/store/items", json=item) as r:
            assert r.status == 204
    finally:
        await store.runner.cleanup()
    transitions = [r.getMessage() for r in caplog.records if r.name == "gateway.postgres"]
    assert len([m for m in transitions if "unavailable" in m]) == 1, transitions
    assert len([m for m in transitions if "answers again" in m]) == 1, transitions
    assert PASSWORD not in caplog.text


async def test_control_plane_answers_503_at_once_while_postgres_is_stopped_then_serves_again(
    started_postgres: PostgresServer, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    server = started_postgres
    config = dataclasses.replace(
        make_config(tmp_path / "cp", step=0.05),
        database_url=server.create_database(),
        database_timeout_seconds=TIMEOUT,
        database_retry_seconds=RETRY,
    )
    async with running_control_plane(config) as cp:
        db = cp.app[RUNTIME_KEY].db
        assert isinstance(db, PostgresDatabase)
        breaker = database_breaker(cp.app)
        assert breaker is not None and database_ready(cp.app)
        async with http.post(
            cp.url + "/v2/deployments", json=deployment_body("survivor"), headers=headers()
        ) as r:
            assert r.status == 201
            deployment = (await r.json())["id"]
        one = f"{cp.url}/v2/deployments/{deployment}"

        await asyncio.to_thread(server.stop)
        # The first call to find the database away (a request, or the lifecycle driver's
        # pass) opens the breaker; the request is answered 503 either way.
        status, response_headers, body = await _answer(http, "GET", one, headers=headers())
        _assert_fast_503(status, response_headers, body)
        assert not database_ready(cp.app)

        # Concurrent requests no longer queue behind one another on the database thread:
        # every one is refused without asking the pool for a connection.
        asked = _requests(db.pool_stats())
        probes = breaker.probes
        started = time.monotonic()
        answers = await asyncio.gather(
            *(
                _answer(http, "GET", cp.url + "/v2/deployments", headers=headers())
                for _ in range(REFUSED_REQUESTS)
            )
        )
        for answer in answers:
            _assert_fast_503(*answer)
        elapsed = time.monotonic() - started
        assert _requests(db.pool_stats()) == asked
        assert breaker.probes - probes <= elapsed / RETRY + 1

        await asyncio.to_thread(server.start)
        status, body = await _until_served(http, "GET", one, headers=headers())
        assert status == 200, body
        assert body["name"] == "survivor"
        assert breaker.healthy and database_ready(cp.app)


async def test_sqlite_apps_report_ready_without_a_breaker(tmp_path: Path) -> None:
    store = await start_store(StoreConfig(data_dir=tmp_path))
    try:
        assert database_breaker(store.app) is None
        assert database_ready(store.app)
    finally:
        await store.runner.cleanup()
