"""Fixtures for the Store's embedding-index tests: the deterministic embedding server and
a Store configured to use it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway.upstreams.store import StoreConfig
from gateway.upstreams.store.index_config import IndexConfig
from tests.support.embedding_server import EmbeddingServer

DIMS = 64


def index_config(server: EmbeddingServer, **overrides: Any) -> IndexConfig:
    """An index on the test server: fast retries so fault tests stay short."""
    settings: dict[str, Any] = {
        "model": "test-embed",
        "dims": DIMS,
        "url": server.url,
        "timeout_seconds": 2.0,
        "retries": 2,
    }
    settings.update(overrides)
    return IndexConfig(**settings)


def indexed_store_config(
    data_dir: Path, server: EmbeddingServer, database_url: str | None = None, **overrides: Any
) -> StoreConfig:
    """An indexed Store in ``data_dir`` (SQLite) or, with ``database_url``, in PostgreSQL."""
    return StoreConfig(
        data_dir=data_dir, database_url=database_url, index=index_config(server, **overrides)
    )


def with_index(config: StoreConfig, **overrides: Any) -> StoreConfig:
    assert config.index is not None
    return replace(config, index=replace(config.index, **overrides))


async def running_embedding_server() -> AsyncIterator[EmbeddingServer]:
    server = await EmbeddingServer(dims=DIMS).start()
    try:
        yield server
    finally:
        await server.stop()
