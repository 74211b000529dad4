"""Fixtures for the counter backend tests: real redis-server processes on free ports."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

# The helpers live in tests/support; make the repository root importable even when
# pytest runs without it on sys.path (tests/ has no __init__.py).
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.counters.base import CounterBackend  # noqa: E402
from gateway.counters.cluster import PerNodeBackend  # noqa: E402
from gateway.counters.factory import (  # noqa: E402
    open_counter_backend,
    parse_counter_url,
    redis_client,
    store_client,
)
from gateway.counters.memory import MemoryBackend  # noqa: E402
from gateway.counters.redis_backend import RedisBackend  # noqa: E402
from tests.support.redis_servers import RedisClusterProcess, RedisServer  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcess]:
    cluster = RedisClusterProcess(tmp_path_factory.mktemp("cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A server for one test only (for tests that kill, pause or restart it)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


# The contract suite runs against each of these.
# "redis" is the script over redis-py (what Sentinel uses), "redis-wire" over the lean
# connection (what redis://, rediss:// and unix:// use).
BACKENDS = ("memory", "redis", "redis-wire", "redis-stack", "cluster-stack")


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[CounterBackend]:
    kind = request.param
    made: CounterBackend
    if kind == "memory":
        made = MemoryBackend()
    elif kind == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        made = RedisBackend(redis_client(parse_counter_url(server.url)), name="redis")
    elif kind == "redis-wire":
        server = request.getfixturevalue("redis_server")
        made = RedisBackend(store_client(parse_counter_url(server.url)), name="redis")
    elif kind == "redis-stack":
        server = request.getfixturevalue("redis_server")
        made = open_counter_backend(server.url, region="us", timeout_seconds=2.0)
    else:
        cluster: RedisClusterProcess = request.getfixturevalue("redis_cluster")
        made = open_counter_backend(cluster.url, region="us", timeout_seconds=2.0)
        # The slot map known, as in a gateway past its first calls: every call of the
        # test goes over a master's lean connection, none through redis-py ("").
        nodes = getattr(made, "inner", None)
        assert isinstance(nodes, PerNodeBackend)
        await nodes.refresh_slot_map()
    yield made
    if kind == "cluster-stack":
        assert "" not in nodes.stores
        assert all(store.lean for store in nodes.stores.values())
    await made.close()
