"""Fixtures the integration tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis_servers import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of the test's own, on a free loopback port, stopped after it."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
