"""A Redis Cluster master killed with kill -9 under traffic, then restarted.

Through the full stack ``open_counter_backend("redis+cluster://…")``: keys served by
the dead master fail open to the local fallback or fail closed, keys on the other
masters keep being counted in Redis (each master has its own breaker), every call
returns quickly, and once the node is back on its port (same ``nodes.conf``, so the
same identity and slots) its keys go back to Redis without a restart.

The cluster runs with ``cluster-require-full-coverage no``, as a deployment that
wants the other masters to keep serving must: with the default, every node refuses
every command (``CLUSTERDOWN``) once the dead master is marked failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gateway.counters.base import CounterBackend, CounterUnavailableError, LimitCheck
from gateway.counters.factory import PerNodeBackend, _NodeBreakers, open_counter_backend
from tests.counters.helpers import RecordingEvents, eventually, new_key
from tests.support.redis_servers import RedisClusterProcess, RedisServer

WAIT_SECONDS = 15.0
CALL_BOUND_SECONDS = 3.0  # the store timeout (1 s) and room for a slow machine's delays


@dataclass
class Answer:
    phase: str  # when the call started: before, down, back
    kind: str  # dead (fail open), dead-closed (fail closed), live
    key: str
    source: str  # redis, fallback, deny-cache, unavailable, or an exception's name
    remaining: int
    seconds: float


@dataclass
class Traffic:
    backend: CounterBackend
    phase: str = "before"
    answers: list[Answer] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, keys: dict[str, list[str]]) -> None:
        for kind, group in keys.items():
            for key in group:
                self._tasks.append(asyncio.create_task(self._work(kind, key)))

    async def _work(self, kind: str, key: str) -> None:
        check = LimitCheck(
            key, limit=1_000_000, window_ms=60_000, bucket_ms=1_000, fail_open=kind != "dead-closed"
        )
        while not self._stop:
            phase, started = self.phase, time.monotonic()
            remaining = -1
            try:
                result = await self.backend.hit([check])
                source = result.source
                remaining = result.states[0].remaining
            except CounterUnavailableError:
                source = "unavailable"
            except Exception as exc:  # anything else is a failure of the test
                source = type(exc).__name__
            self.answers.append(
                Answer(phase, kind, key, source, remaining, time.monotonic() - started)
            )
            await asyncio.sleep(0.003)

    def sources(self, phase: str, kind: str) -> list[str]:
        return [a.source for a in self.answers if a.phase == phase and a.kind == kind]

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


@pytest.fixture
def partial_cluster(tmp_path: Path) -> Iterator[RedisClusterProcess]:
    cluster = RedisClusterProcess(tmp_path / "cluster", full_coverage=False)
    cluster.start()
    yield cluster
    cluster.stop()


def keys_by_master(cluster: RedisClusterProcess, victim: RedisServer) -> dict[str, list[str]]:
    """Four keys on the victim (one fail-closed) and two on each other master."""
    dead: list[str] = []
    live: dict[int, list[str]] = {s.port: [] for s in cluster.servers if s is not victim}
    while len(dead) < 4 or any(len(v) < 2 for v in live.values()):
        key = new_key()
        owner = cluster.server_for_key(key)
        group = dead if owner is victim else live[owner.port]
        if len(group) < (4 if owner is victim else 2):
            group.append(key)
    return {
        "dead": dead[:3],
        "dead-closed": dead[3:],
        "live": [k for group in live.values() for k in group],
    }


async def test_master_killed_under_traffic_then_restarted(
    partial_cluster: RedisClusterProcess,
) -> None:
    victim = partial_cluster.servers[0]
    keys = keys_by_master(partial_cluster, victim)
    events = RecordingEvents()
    # Every call to the dead master marks redis-py's slot map for a refresh, which
    # runs inside the next call to any master (a CLUSTER SLOTS round trip, some ms):
    # the store timeout is far wider than the default 50 ms so that cost, or a healthy
    # master's process not scheduled for a while on a slow, loaded test machine, is not
    # taken for an outage of a healthy master. (The dead master's calls fail at once,
    # whatever the timeout: its port refuses connections.)
    backend = open_counter_backend(
        partial_cluster.url,
        region="us",
        events=events,
        timeout_seconds=1.0,
        breaker_reset_seconds=0.2,
    )
    traffic = Traffic(backend)
    traffic.start(keys)
    try:
        await eventually(
            WAIT_SECONDS,
            lambda: all(traffic.sources("before", k).count("redis") >= 20 for k in keys),
            "every key is counted in Redis",
        )
        # Off the loop: the workers keep running while the process dies.
        await asyncio.to_thread(victim.kill9)
        traffic.phase = "down"
        await eventually(
            WAIT_SECONDS,
            lambda: (
                "open" in events.breaker
                and len(traffic.sources("down", "dead")) >= 100
                and len(traffic.sources("down", "live")) >= 200
            ),
            "traffic goes on while the master is down",
        )
        live_marks = {
            a.key: a.remaining for a in traffic.answers if a.phase == "down" and a.kind == "live"
        }
        await asyncio.sleep(0.3)
        # Restarted on the same port with its nodes.conf: same node, same slots. A
        # restarted master refuses commands (CLUSTERDOWN) for its first 2 s.
        await asyncio.to_thread(victim.restart)
        traffic.phase = "back"
        await eventually(
            WAIT_SECONDS,
            lambda: (
                traffic.sources("back", "dead")[-30:].count("redis") == 30
                and traffic.sources("back", "dead-closed")[-10:].count("redis") == 10
            ),
            "the restarted master's keys go back to Redis",
        )
    finally:
        await traffic.stop()
        healthy = await backend.healthy()
        await backend.close()

    down = [a for a in traffic.answers if a.phase == "down"]
    assert {a.source for a in down if a.kind == "dead"} == {"fallback"}
    assert {a.source for a in down if a.kind == "dead-closed"} == {"unavailable"}
    # The other masters' keys never left Redis, and were counted there.
    assert {a.source for a in down if a.kind == "live"} == {"redis"}
    for key, remaining in live_marks.items():
        last = [a.remaining for a in traffic.answers if a.key == key and a.phase == "down"]
        assert last[-1] < remaining
        owner = partial_cluster.server_for_key(key)
        assert owner is not victim and owner.cli("EXISTS", key).strip() == "1"
    # Every call returned well within bound, before, during and after the outage.
    assert max(a.seconds for a in traffic.answers) < CALL_BOUND_SECONDS
    # Only the sources the stack may give; no exception other than fail-closed.
    assert {a.source for a in traffic.answers} <= {"redis", "fallback", "unavailable"}
    assert "connection" in events.errors
    # The region's breaker (the worst of the masters') went back to closed.
    assert events.breaker[0] == "open" and events.breaker[-1] == "closed"
    assert healthy
    # kill -9 lost the victim's data; what is there now was counted after the restart.
    for key in keys["dead"] + keys["dead-closed"]:
        assert victim.cli("EXISTS", key).strip() == "1"


async def test_one_stack_per_master(redis_cluster: RedisClusterProcess) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    try:
        per_node = backend.inner  # type: ignore[attr-defined]
        assert isinstance(per_node, PerNodeBackend)
        ports: dict[str, int] = {}
        masters = {f"127.0.0.1:{s.port}" for s in redis_cluster.servers}
        # The first call goes out before the slot map is known, through one shared
        # stack (""), so keep calling until every master has been seen after that.
        for _ in range(300):
            if set(per_node.stacks) - {""} == masters:
                break
            key = new_key()
            result = await backend.hit([LimitCheck(key, 5, 1_000, 100)])
            assert result.source == "redis"
            ports[key] = redis_cluster.server_for_key(key).port
        for key, port in ports.items():
            assert per_node.node_for(key) == f"127.0.0.1:{port}"
        assert set(per_node.stacks) - {""} == masters
        assert await backend.healthy()
    finally:
        await backend.close()


def test_breakers_of_the_masters_are_reported_as_the_worst() -> None:
    events = RecordingEvents()
    breakers = _NodeBreakers(events)
    a, b = breakers.for_node("a"), breakers.for_node("b")
    a.breaker_changed("open")
    b.breaker_changed("open")
    a.breaker_changed("half_open")
    a.breaker_changed("closed")
    assert events.breaker == ["open"]  # b is still open
    b.breaker_changed("half_open")
    b.breaker_changed("closed")
    assert events.breaker == ["open", "half_open", "closed"]
    a.store_error("connection")
    b.fallback_used()
    assert events.errors == ["connection"] and events.fallbacks == 1
