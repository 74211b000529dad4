"""Fixtures for the Store tests: a real Store server on a loopback port and SDK clients.

Every SDK-driven test reaches the Store through ``store_base_url``. Override that one
fixture (for example in a conftest that starts ``python -m gateway serve --embedded``) to
run the same tests through the gateway proxy.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from langgraph_sdk import get_client

from gateway.upstreams.store import StoreConfig

from .store_support import RunningStore, StoreProcess, start_store


@pytest.fixture(params=["sqlite", "postgresql"])
def store_database_url(request: pytest.FixtureRequest) -> str | None:
    """Every Store test runs on both backends: the SQLite file and a fresh PostgreSQL
    database on the session's throwaway server."""
    if request.param == "sqlite":
        return None
    url: str = request.getfixturevalue("pg_database_url")
    return url


@pytest.fixture
def store_config(tmp_path: Path, store_database_url: str | None) -> StoreConfig:
    return StoreConfig(data_dir=tmp_path / "store-data", database_url=store_database_url)


@pytest.fixture
async def running_store(store_config: StoreConfig) -> AsyncIterator[RunningStore]:
    store = await start_store(store_config)
    try:
        yield store
    finally:
        await store.runner.cleanup()


@pytest.fixture
async def store_base_url(running_store: RunningStore) -> str:
    """Base URL the SDK tests talk to (the Store directly; override for the gateway)."""
    return running_store.url


@pytest.fixture
async def sdk(store_base_url: str) -> AsyncIterator[Any]:
    """``langgraph_sdk`` StoreClient pointed at ``store_base_url``."""
    client = get_client(url=store_base_url, api_key=None)
    try:
        yield client.store
    finally:
        await client.aclose()


@pytest.fixture
async def http(store_base_url: str) -> AsyncIterator[aiohttp.ClientSession]:
    """A raw HTTP session for requests the SDK refuses to send (bad input)."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(base_url=store_base_url, timeout=timeout) as session:
        yield session


@pytest.fixture
def store_processes() -> Iterator[list[StoreProcess]]:
    """Collects spawned store processes and stops any still running at the end."""
    spawned: list[StoreProcess] = []
    yield spawned
    for child in spawned:
        child.stop()


@pytest.fixture
async def embedding_server() -> AsyncIterator[Any]:
    """The deterministic OpenAI-compatible embedding server on a loopback port."""
    from .semantic_support import running_embedding_server

    async for server in running_embedding_server():
        yield server
