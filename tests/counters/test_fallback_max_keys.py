"""The fallback counters used while Redis is down honour ``memory_max_keys`` (issue 24,
item 11): they used to keep up to a fixed 1,000,000 keys whatever the setting, so a
small sidecar could be pushed out of memory by an outage plus a flood of identities."""

from __future__ import annotations

from pathlib import Path

from gateway.counters.base import CounterBackend, LimitCheck
from gateway.counters.factory import open_counter_backend
from gateway.counters.memory import MemoryBackend
from gateway.counters.resilient import ResilientBackend
from tests.counters.helpers import new_key
from tests.support.redis_servers import RedisServer


def resilient_of(backend: CounterBackend) -> ResilientBackend:
    inner = getattr(backend, "inner", None)
    assert isinstance(inner, ResilientBackend)
    return inner


async def test_the_fallback_keeps_at_most_memory_max_keys(tmp_path: Path) -> None:
    down = RedisServer(tmp_path / "never-started")  # a free port nobody listens on
    backend = open_counter_backend(down.url, region="us", memory_max_keys=1_000)
    fallback = resilient_of(backend).fallback
    try:
        assert fallback.max_keys == 1_000
        results = [
            await backend.hit([LimitCheck(new_key(), 5, 60_000, 1_000)]) for _ in range(1_500)
        ]
        assert {r.source for r in results} == {"fallback"}
        assert all(r.admitted for r in results)
        assert len(fallback) == 1_000
    finally:
        await backend.close()


async def test_the_default_and_memory_urls_take_the_cap_too() -> None:
    for url in (None, "memory://"):
        memory = open_counter_backend(url, region="us", memory_max_keys=2_000)
        assert isinstance(memory, MemoryBackend) and memory.max_keys == 2_000
    backend = open_counter_backend("redis://127.0.0.1:1/0", region="us")
    try:
        assert resilient_of(backend).fallback.max_keys == 1_000_000  # the setting's default
    finally:
        await backend.close()


async def test_the_gateway_passes_its_setting_to_the_fallback(tmp_path: Path) -> None:
    # How ``gateway serve`` builds each region's backend.
    from gateway.app import open_backend
    from gateway.metrics import Metrics
    from gateway.settings import Settings

    down = RedisServer(tmp_path / "never-started")
    settings = Settings(memory_max_keys=1_000)
    backend = open_backend(settings, "us", down.url, Metrics())
    try:
        assert resilient_of(backend).fallback.max_keys == 1_000
    finally:
        await backend.close()
    memory = open_backend(settings, "us", None, Metrics())
    assert isinstance(memory, MemoryBackend) and memory.max_keys == 1_000
