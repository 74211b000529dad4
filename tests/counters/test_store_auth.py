"""A counter store that refuses the credentials is named as such (issue 24, item 11).

It used to be logged only as "circuit breaker open" and counted as
``gateway_counter_store_errors_total{kind="connection"}``, the same as a Redis that is
down, although waiting does not fix it. Now the kind is ``auth`` and a log line says
authentication failed and to check the password in the URL; no password (the wrong
one given, or the right one) ever appears in the log or the metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prometheus_client import generate_latest

from gateway.counters.base import CounterBackend, LimitCheck
from gateway.counters.factory import open_counter_backend, parse_counter_url, redis_client
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resilient import ResilientBackend
from gateway.metrics import Metrics
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisServer

RIGHT = "Right-Horse-Battery-7781"
WRONG = "Wrong-Staple-Correct-4412"


@pytest.fixture(scope="module")
def guarded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password=RIGHT)
    server.start()
    yield server
    server.stop()


def url_for(server: RedisServer, form: str, password: str | None) -> str:
    auth = f":{password}@" if password else ""
    if form == "unix":
        return f"unix://{auth}{server.unix_socket}"
    return f"redis://{auth}127.0.0.1:{server.port}/0"


def stack(client: str, url: str, metrics: Metrics) -> CounterBackend:
    """The gateway's stack (lean connection), or the store over redis-py (Sentinel's and
    Cluster's client) behind the same resilience wrapper."""
    events = metrics.counter_events("us")
    if client == "lean":
        return open_counter_backend(url, region="us", events=events)
    store = RedisBackend(redis_client(parse_counter_url(url)), name="redis-py store")
    return ResilientBackend(store, events=events)


@pytest.mark.parametrize("client", ["lean", "redis-py"])
@pytest.mark.parametrize("form", ["tcp", "unix"])
@pytest.mark.parametrize(
    ("given", "problem"),
    [
        (WRONG, "wrong user name or password"),
        (None, "the server requires a password and the counter URL has none"),
    ],
)
async def test_refused_credentials_are_reported_as_auth(
    guarded_redis: RedisServer,
    caplog: pytest.LogCaptureFixture,
    client: str,
    form: str,
    given: str | None,
    problem: str,
) -> None:
    caplog.set_level(logging.DEBUG)
    metrics = Metrics()
    backend = stack(client, url_for(guarded_redis, form, given), metrics)
    try:
        results = [await backend.hit([LimitCheck(new_key(), 5, 60_000, 1_000)]) for _ in range(8)]
    finally:
        await backend.close()
    assert {r.source for r in results} == {"fallback"}  # fail open, as for an outage
    exposition = generate_latest(metrics.registry).decode()
    assert 'gateway_counter_store_errors_total{kind="auth",region="us"}' in exposition
    assert 'kind="connection"' not in exposition
    lines = [r.getMessage() for r in caplog.records if "authentication failed" in r.getMessage()]
    assert len(lines) == 1, "one line, not one per failed call"
    assert problem in lines[0]
    assert "check the user and password in the counter URL" in lines[0]
    assert "region us" in lines[0] or client == "redis-py"
    everything = caplog.text + "".join(
        repr(r.args) + str(r.exc_info) + str(r.exc_text) for r in caplog.records
    )
    assert RIGHT not in everything and WRONG not in everything
    assert RIGHT not in exposition and WRONG not in exposition


async def test_the_right_password_is_not_an_error(guarded_redis: RedisServer) -> None:
    metrics = Metrics()
    backend = stack("lean", url_for(guarded_redis, "tcp", RIGHT), metrics)
    try:
        result = await backend.hit([LimitCheck(new_key(), 5, 60_000, 1_000)])
    finally:
        await backend.close()
    assert result.source == "redis" and result.admitted
    assert "gateway_counter_store_errors_total{" not in generate_latest(metrics.registry).decode()


def test_auth_kinds() -> None:
    from redis.exceptions import (
        AuthenticationError,
        AuthenticationWrongNumberOfArgsError,
        NoPermissionError,
    )
    from redis.exceptions import ConnectionError as RedisConnectionError

    from gateway.counters.resilient import auth_problem, failure_kind

    assert failure_kind(AuthenticationError("invalid password")) == "auth"
    assert failure_kind(AuthenticationWrongNumberOfArgsError("x")) == "auth"
    assert failure_kind(NoPermissionError("no permissions to run the 'evalsha' command")) == "auth"
    # redis-py wraps a refused AUTH in a ConnectionError on some connections.
    try:
        try:
            raise AuthenticationError("invalid username-password pair or user is disabled.")
        except AuthenticationError as inner:
            raise RedisConnectionError(str(inner)) from inner
    except RedisConnectionError as wrapped:
        assert failure_kind(wrapped) == "auth"
        assert auth_problem(wrapped) == "wrong user name or password"
    assert failure_kind(RedisConnectionError("Connection refused")) == "connection"
    assert "ACL" in auth_problem(NoPermissionError("no permissions"))
