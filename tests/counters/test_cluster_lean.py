"""Redis Cluster over the lean connections (issue 27): every master's calls go over its
own ``RespClient``, and a call a master redirects (a slot migrated, a failover) is
counted exactly once, where it belongs.

Real 3-master clusters (tests/support/redis_servers.py): the session's for what leaves
the topology as it was, a cluster of its own for each test that moves slots or masters.
What proves "exactly once": every counted call gets the store's count back (the limit
minus ``remaining``), so the answers for one key must be exactly 1, 2, ..., n, and the
hash the script keeps for it on its master must add up to n.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio.cluster import NodesManager
from redis.crc import key_slot
from redis.exceptions import ResponseError

from gateway.counters import cluster as cluster_module
from gateway.counters.base import CounterBackend, CounterUnavailableError, HitResult, LimitCheck
from gateway.counters.cluster import PerNodeBackend
from gateway.counters.factory import open_counter_backend
from gateway.counters.redis_backend import cross_slot_text, script_text
from gateway.counters.resp import RespClient
from tests.counters.helpers import RecordingEvents, ViaSubmit, eventually, keys_sharing_tag, new_key
from tests.support.redis_servers import REDIS_CLI, RedisClusterProcess, RedisServer

LIMIT = 1_000_000


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterProcess]:
    """A cluster for one test (slots and masters move). Partial coverage: a master that
    died does not stop the others (as the failover tests want)."""
    cluster = RedisClusterProcess(tmp_path / "cluster", full_coverage=False)
    cluster.start()
    yield cluster
    cluster.stop()


def check(key: str, *, fail_open: bool = True) -> LimitCheck:
    return LimitCheck(key, LIMIT, 60_000, 1_000, fail_open=fail_open)


def name(server: RedisServer) -> str:
    return f"127.0.0.1:{server.port}"


def nodes_of(backend: CounterBackend) -> PerNodeBackend:
    inner = getattr(backend, "inner", backend)  # under the deny cache, when there is one
    assert isinstance(inner, PerNodeBackend)
    return inner


def owners(cluster: RedisClusterProcess) -> dict[int, RedisServer]:
    """The master of every slot, read once from CLUSTER NODES."""
    by_port = {s.port: s for s in cluster.servers}
    found: dict[int, RedisServer] = {}
    for line in cluster.servers[0].cli("CLUSTER", "NODES").splitlines():
        fields = line.split()
        if "master" not in fields[2]:
            continue
        server = by_port[int(fields[1].split("@")[0].rsplit(":", 1)[1])]
        for ranges in fields[8:]:
            low, _, high = ranges.partition("-")
            if low.isdigit():
                for slot in range(int(low), int(high or low) + 1):
                    found[slot] = server
    return found


def keys_by_master(cluster: RedisClusterProcess, per_master: int) -> dict[int, list[str]]:
    """``per_master`` fresh keys served by each master (by port)."""
    slots = owners(cluster)
    keys: dict[int, list[str]] = {s.port: [] for s in cluster.servers}
    while any(len(group) < per_master for group in keys.values()):
        key = new_key()
        group = keys[slots[key_slot(key.encode())].port]
        if len(group) < per_master:
            group.append(key)
    return keys


# The sum of the counts: the second double of a counter's trailer (sliding_window.lua).
COUNTED = (
    "local v = redis.call('GET', KEYS[1]) if not v then return 0 end "
    "return struct.unpack('<d', v, #v - 15)"
)


def counted(server: RedisServer, key: str, *, asking: bool = False) -> int:
    """What the script counted for ``key`` on ``server`` (the sum in its value's
    header); ``asking``: on a node the key's slot is being migrated to."""
    command = ("EVAL", f'"{COUNTED}"' if asking else COUNTED, "1", key)
    if not asking:
        return sum(int(v) for v in server.cli(*command).split())
    done = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(server.port)],
        input=f"ASKING\n{' '.join(command)}\n",
        capture_output=True,
        timeout=10,
        check=True,
        text=True,
    )
    return sum(int(v) for v in done.stdout.split()[1:])  # after ASKING's OK


def assert_each_counted_once(key: str, results: list[HitResult]) -> None:
    """The store answered every call with a count of its own: 1, 2, ..., n."""
    assert {r.source for r in results} == {"redis"}, key
    counts = sorted(LIMIT - r.states[0].remaining for r in results)
    assert counts == list(range(1, len(results) + 1)), key


def client_addresses(server: RedisServer, command: str | None = None) -> list[str]:
    """The addresses of ``server``'s clients (those whose last command was ``command``)."""
    found = []
    for line in server.cli("CLIENT", "LIST").splitlines():
        fields = dict(item.split("=", 1) for item in line.split() if "=" in item)
        if command is None or fields.get("cmd") == command:
            found.append(fields["addr"])
    return found


def seen_as_replica(cluster: RedisClusterProcess, server: RedisServer, of: RedisServer) -> bool:
    """Whether every node of ``cluster`` lists ``server`` as a replica of ``of``."""
    me, master = cluster.node_id(server), cluster.node_id(of)
    for other in cluster.servers:
        fields = [line.split() for line in other.cli("CLUSTER", "NODES").splitlines()
                  if line.startswith(me)]  # fmt: skip
        if not fields or "slave" not in fields[0][2] or fields[0][3] != master:
            return False
    return True


def gone(server: RedisServer, address: str) -> Callable[[], bool]:
    return lambda: address not in client_addresses(server)


async def test_each_master_is_counted_over_its_own_lean_connection(
    redis_cluster: RedisClusterProcess,
) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    wires: dict[int, str] = {}
    try:
        await nodes.refresh_slot_map()  # the map known: no call goes through redis-py
        keys = keys_by_master(redis_cluster, 5)
        for server in redis_cluster.servers:
            server.cli("SCRIPT", "LOAD", script_text())  # no NOSCRIPT retries to count
            server.cli("CONFIG", "RESETSTAT")
        calls = [key for group in keys.values() for key in group for _ in range(4)]
        by_submit = ViaSubmit(backend)
        results = await asyncio.gather(
            *((by_submit if i % 2 else backend).hit([check(k)]) for i, k in enumerate(calls))
        )
        assert {r.source for r in results} == {"redis"}
        assert set(nodes.stores) == {name(s) for s in redis_cluster.servers}  # no "" stack
        for server in redis_cluster.servers:
            store = nodes.stores[name(server)]
            wire = store.client
            assert store.lean and isinstance(wire, RespClient) and store.round_trips >= 1
            assert wire.connects == 1
            # Server side: this master ran exactly the calls for its keys...
            assert server.commandstats().get("evalsha") == 4 * len(keys[server.port])
            # ...and every one came over the lean connection (the only client whose last
            # command was EVALSHA; redis-py's connections sent CLUSTER SLOTS at most).
            wires[server.port] = wire.local_address
            assert client_addresses(server, "evalsha") == [wires[server.port]]
    finally:
        await backend.close()
    # close() closed every master's connection.
    for server in redis_cluster.servers:
        await eventually(5, gone(server, wires[server.port]), f"{server.port}'s lean connection")


async def test_concurrent_calls_across_masters_are_counted_exactly(
    redis_cluster: RedisClusterProcess,
) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        keys = keys_by_master(redis_cluster, 8)
        times = 25
        calls = [key for group in keys.values() for key in group for _ in range(times)]
        by_submit = ViaSubmit(backend)
        results = await asyncio.gather(
            *((by_submit if i % 2 else backend).hit([check(k)]) for i, k in enumerate(calls))
        )
        by_key: dict[str, list[HitResult]] = {}
        for key, result in zip(calls, results, strict=True):
            by_key.setdefault(key, []).append(result)
        total = 0
        for server in redis_cluster.servers:
            for key in keys[server.port]:
                assert_each_counted_once(key, by_key[key])
                assert counted(server, key) == times
                total += counted(server, key)
        assert total == len(calls) == 3 * 8 * times
        # Pipelined per master: far fewer round trips than calls.
        trips = sum(store.round_trips for store in nodes.stores.values())
        assert 3 <= trips < len(calls) / 4
    finally:
        await backend.close()


async def test_requests_of_one_slot_share_a_script_call(
    redis_cluster: RedisClusterProcess,
) -> None:
    """Requests that arrive together go to their master in one script call, in order:
    those of one slot (one client's, one identity) in the script's own form, those of
    several slots in its cross-slot form (Redis 7). Every one is counted exactly once,
    and each answer is its own request's."""
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        master = redis_cluster.servers[0]
        slots = owners(redis_cluster)
        tags: list[list[str]] = []  # three identities (three slots) this master serves
        while len(tags) < 3:
            keys = keys_sharing_tag(2)
            slot = key_slot(keys[0].encode())
            if slots[slot] is master and all(key_slot(k[0].encode()) != slot for k in tags):
                tags.append(keys)
        for text in (script_text(), cross_slot_text()):  # no NOSCRIPT retries to count
            master.cli("SCRIPT", "LOAD", text)
        by_submit = ViaSubmit(backend)
        warm = new_key()  # the lean connection opened (the first call connects, alone)
        while slots[key_slot(warm.encode())] is not master:
            warm = new_key()
        await by_submit.hit([check(warm)])
        master.cli("CONFIG", "RESETSTAT")
        # Two identities interleaved, 30 and 20 requests, and one request alone in its
        # slot among them: each answer must be its own request's, in order.
        sizes = (30, 20)
        order = [0, 1] * 20 + [0] * 10
        order.insert(25, 2)
        calls = [[check(key) for key in tags[which]] for which in order]
        results = await asyncio.gather(*(by_submit.hit(checks) for checks in calls))
        for which, size in enumerate((*sizes, 1)):
            mine = [r for r, w in zip(results, order, strict=True) if w == which]
            assert len(mine) == size
            for k, key in enumerate(tags[which]):
                # The n-th request of an identity is its n-th count: none swapped with
                # another slot's, none out of order within its own.
                assert [LIMIT - r.states[k].remaining for r in mine] == list(range(1, size + 1))
                assert counted(master, key) == size
        # Far fewer script calls than requests; calls across slots, none failed.
        assert 1 <= int(master.commandstats().get("evalsha", 0)) <= len(calls) / 5
        store = nodes.stores[name(master)]
        assert store.cross_slot_calls >= 1
        assert store.cross_slot_failed == 0
    finally:
        await backend.close()


@pytest.mark.parametrize("moved_first", [False, True], ids=["moved-later", "moved-first"])
async def test_a_cross_slot_call_with_a_slot_that_moved_counts_each_request_once(
    own_cluster: RedisClusterProcess, moved_first: bool
) -> None:
    """A call across slots that names a slot its master no longer serves (the gateway's
    slot map is stale): the master refuses it before counting anything (the moved key
    is read first; or, when it is the first request's, the call is redirected), and
    each of its requests goes again on its own, to its slot's owner. Each is counted
    exactly once, in order, where its slot now lives."""
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        slots = owners(own_cluster)
        source = own_cluster.servers[0]
        target = own_cluster.servers[1]
        keys: list[str] = []  # three keys of three slots of the source
        while len(keys) < 3:
            key = new_key()
            slot = key_slot(key.encode())
            if slots[slot] is source and all(key_slot(k.encode()) != slot for k in keys):
                keys.append(key)
        by_submit = ViaSubmit(backend)
        await by_submit.hit([check(keys[0])])  # connected, scripts loaded
        moved = keys[0] if moved_first else keys[1]
        own_cluster.migrate_slot(key_slot(moved.encode()), source, target)
        for server in (source, target):
            for text in (script_text(), cross_slot_text()):
                server.cli("SCRIPT", "LOAD", text)
        store = nodes.stores[name(source)]
        times = 25  # 75 requests: two calls of 64 and 11, both naming the moved slot
        calls = [key for _ in range(times) for key in keys]
        results = await asyncio.gather(*(by_submit.hit([check(k)]) for k in calls))
        assert store.cross_slot_calls >= 1 and store.cross_slot_failed >= 1
        assert nodes.moved >= 1
        for key in keys:
            before = 1 if key == keys[0] else 0
            mine = [r for k, r in zip(calls, results, strict=True) if k == key]
            assert {r.source for r in mine} == {"redis"}
            assert [LIMIT - r.states[0].remaining for r in mine] == list(
                range(before + 1, before + times + 1)
            ), key
            assert counted(target if key == moved else source, key) == before + times
    finally:
        await backend.close()


async def test_a_master_that_lost_the_cross_slot_form_loads_it_and_counts_each_once(
    own_cluster: RedisClusterProcess,
) -> None:
    """A master that does not know the cross-slot form (a restart, SCRIPT FLUSH) answers
    NOSCRIPT: the form is loaded, the call's requests go again and are counted once each;
    the calls after that go across slots."""
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        master = own_cluster.servers[0]
        keys = [k for k in keys_by_master(own_cluster, 4)[master.port]]
        by_submit = ViaSubmit(backend)
        await by_submit.hit([check(keys[0])])  # connected
        master.cli("SCRIPT", "FLUSH")
        store = nodes.stores[name(master)]
        loads = store.script_loads
        for round_ in range(1, 3):
            results = await asyncio.gather(*(by_submit.hit([check(k)]) for k in keys * 5))
            for key in keys:
                mine = [r for k, r in zip(keys * 5, results, strict=True) if k == key]
                before = 1 if key == keys[0] else 0
                assert sorted(LIMIT - r.states[0].remaining for r in mine) == list(
                    range(before + 5 * round_ - 4, before + 5 * round_ + 1)
                ), key
        assert store.script_loads == loads + 1
        assert store.cross_slot_calls >= 2 and store.cross_slot_failed == 0
        for key in keys:
            assert counted(master, key) == (11 if key == keys[0] else 10)
    finally:
        await backend.close()


async def test_ask_then_moved_while_a_slot_migrates(own_cluster: RedisClusterProcess) -> None:
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        moved_key, staying_key, fresh_key = keys_sharing_tag(3)  # one slot
        slot = key_slot(moved_key.encode())
        source = own_cluster.server_for_key(moved_key)
        target = next(s for s in own_cluster.servers if s is not source)
        for key in (moved_key, staying_key):
            for _ in range(3):
                assert (await backend.hit([check(key)])).source == "redis"

        own_cluster.start_migration(slot, source, target)
        own_cluster.move_keys(slot, source, target, [moved_key])
        # Gone from the source: ASK, then ASKING and the call on the target's connection.
        assert (await backend.hit([check(moved_key)])).states[0].remaining == LIMIT - 4
        # A key that exists nowhere yet is made on the target (by submit, the data plane's way).
        assert (await ViaSubmit(backend).hit([check(fresh_key)])).states[0].remaining == LIMIT - 1
        # Still on the source: counted there.
        assert (await backend.hit([check(staying_key)])).states[0].remaining == LIMIT - 4
        assert (nodes.asked, nodes.moved) == (2, 0)
        assert nodes.node_for(moved_key) == name(source)  # ASK leaves the map as it is
        # A call of two keys, one moved and one not: TRYAGAIN until the migration ends;
        # after a few tries it fails (here fail closed) and neither key is counted. (A
        # backend of its own: the failure asks for a refresh of the map, which would
        # spoil the count of refreshes below.)
        other = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
        try:
            await nodes_of(other).refresh_slot_map()
            with pytest.raises(CounterUnavailableError):
                await other.hit([check(staying_key, fail_open=False), check(moved_key)])
            assert nodes_of(other).tried_again >= 2
        finally:
            await other.close()
        assert counted(target, moved_key, asking=True) == 4
        assert counted(target, fresh_key, asking=True) == 1
        assert counted(source, staying_key) == 4
        assert source.cli("EXISTS", moved_key).startswith("ASK ")  # not on the source

        own_cluster.move_keys(slot, source, target)
        own_cluster.finish_migration(slot, source, target)
        refreshes = nodes.refreshes
        times = 20
        calls = [key for key in (moved_key, staying_key, fresh_key) for _ in range(times)]
        results = await asyncio.gather(*(backend.hit([check(k)]) for k in calls))
        # MOVED: each call sent again to the target at once, the map refreshed in the
        # background, once for all of them.
        await eventually(5, lambda: nodes.node_for(moved_key) == name(target), "map refreshed")
        assert nodes.moved >= 1 and nodes.refreshes == refreshes + 1
        assert {r.source for r in results} == {"redis"}
        for key, before in ((moved_key, 4), (staying_key, 4), (fresh_key, 1)):
            mine = [r for k, r in zip(calls, results, strict=True) if k == key]
            counts = sorted(LIMIT - r.states[0].remaining for r in mine)
            assert counts == list(range(before + 1, before + times + 1)), key
            assert counted(target, key) == before + times
        assert source.cli("CLUSTER", "COUNTKEYSINSLOT", str(slot)).strip() == "0"
        # Now the map is right: the call of two keys goes straight to the target.
        both = await backend.hit([check(staying_key), check(moved_key)])
        assert [s.remaining for s in both.states] == [LIMIT - 25, LIMIT - 25]
    finally:
        await backend.close()


class Traffic:
    """Workers hitting each key in a loop, by ``hit`` and by ``submit``, until stopped."""

    def __init__(self, backend: CounterBackend, keys: list[str]) -> None:
        self.answers: dict[str, list[HitResult]] = {key: [] for key in keys}
        self.failures: list[str] = []
        self._stop = False
        by_submit = ViaSubmit(backend)
        self._tasks = [
            asyncio.create_task(self._work(via, key))
            for key in keys
            for via in (backend, by_submit)
        ]

    async def _work(self, via: CounterBackend, key: str) -> None:
        while not self._stop:
            try:
                self.answers[key].append(await via.hit([check(key)]))
            except Exception as exc:  # a failure of the test, reported below
                self.failures.append(f"{key}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(0.002)

    def count(self) -> int:
        return sum(len(a) for a in self.answers.values())

    async def stop(self) -> None:
        self._stop = True
        await asyncio.gather(*self._tasks)


async def test_counts_stay_exact_while_a_slot_migrates_under_traffic(
    own_cluster: RedisClusterProcess,
) -> None:
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    migrating = keys_sharing_tag(6)
    elsewhere = [new_key() for _ in range(6)]
    slot = key_slot(migrating[0].encode())
    source = own_cluster.server_for_key(migrating[0])
    target = next(s for s in own_cluster.servers if s is not source)
    try:
        await nodes.refresh_slot_map()
        traffic = Traffic(backend, migrating + elsewhere)
        try:
            await eventually(10, lambda: traffic.count() >= 200, "traffic runs")
            # Off the loop: the workers keep calling while the slot moves.
            moved = await asyncio.to_thread(own_cluster.migrate_slot, slot, source, target)
            seen = traffic.count()
            await eventually(10, lambda: traffic.count() >= seen + 200, "traffic goes on")
        finally:
            await traffic.stop()
        assert traffic.failures == []
        assert moved == len(migrating)
        for key in migrating + elsewhere:
            assert_each_counted_once(key, traffic.answers[key])
            assert counted(own_cluster.server_for_key(key), key) == len(traffic.answers[key])
        assert nodes.moved >= 1  # the map named the source until a MOVED said otherwise
        assert nodes.node_for(migrating[0]) == name(target)
    finally:
        await backend.close()


async def test_a_replica_promoted_by_a_failover_gets_its_own_stack(
    own_cluster: RedisClusterProcess,
) -> None:
    old = own_cluster.servers[0]
    replica = own_cluster.add_replica(old)
    slots = owners(own_cluster)
    on_old = [k for k in (new_key() for _ in range(200)) if slots[key_slot(k.encode())] is old][:4]
    elsewhere = [k for k in (new_key() for _ in range(9)) if slots[key_slot(k.encode())] is not old]
    events = RecordingEvents()
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0, events=events)
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        traffic = Traffic(backend, on_old + elsewhere[:4])
        try:
            await eventually(10, lambda: traffic.count() >= 200, "traffic runs")
            # The old master stops taking writes until its replica has caught up, then
            # they swap roles: it answers MOVED from then on.
            await asyncio.to_thread(own_cluster.manual_failover, replica)
            seen = traffic.count()
            await eventually(10, lambda: traffic.count() >= seen + 200, "traffic goes on")
        finally:
            await traffic.stop()
        assert traffic.failures == []
        for key in on_old + elsewhere[:4]:
            assert_each_counted_once(key, traffic.answers[key])
        for key in on_old:
            assert counted(replica, key) == len(traffic.answers[key])
            assert nodes.node_for(key) == name(replica)
        store = nodes.stores[name(replica)]
        assert store.lean and isinstance(store.client, RespClient)
        assert store.client is not nodes.stores[name(old)].client
        assert nodes.moved >= 1
        assert events.breaker == [] and events.errors == []  # no call failed
    finally:
        await backend.close()


async def test_a_dead_masters_replica_takes_over_without_a_restart(
    own_cluster: RedisClusterProcess,
) -> None:
    victim = own_cluster.servers[0]
    replica = own_cluster.add_replica(victim)
    slots = owners(own_cluster)
    keys = [k for k in (new_key() for _ in range(200)) if slots[key_slot(k.encode())] is victim][:3]
    events = RecordingEvents()
    backend = open_counter_backend(
        own_cluster.url,
        region="us",
        timeout_seconds=0.25,
        breaker_reset_seconds=0.2,
        events=events,
    )
    nodes = nodes_of(backend)
    try:
        await nodes.refresh_slot_map()
        for key in keys:
            assert (await backend.hit([check(key)])).source == "redis"
        await asyncio.to_thread(victim.kill9)
        started = time.monotonic()
        sources: list[str] = []

        async def back_in_redis() -> bool:
            result = await backend.hit([check(keys[0])])
            sources.append(result.source)
            return result.source == "redis"

        # Fallback while no master serves the slots; then the replica is elected (node
        # timeout 2 s), a failed call's refresh finds it, and its keys go to it.
        while not await back_in_redis():
            assert time.monotonic() - started < 20, "the promoted replica was never used"
            await asyncio.sleep(0.05)
        assert "fallback" in sources and "connection" in events.errors
        assert nodes.node_for(keys[0]) == name(replica)
        assert nodes.stores[name(replica)].lean
        assert own_cluster.server_for_key(keys[0]) is replica
        assert replica.cli("EXISTS", keys[0]).strip() == "1"
        # The region's breaker reports the masters that serve slots: closed again.
        await eventually(5, lambda: events.breaker[-1:] == ["closed"], "the breaker closes")
    finally:
        await backend.close()


async def test_a_redirect_out_of_time_leaves_the_target_connection_alone(
    own_cluster: RedisClusterProcess,
) -> None:
    """The budget of a redirection runs out while its call waits on the target: the call
    fails (the fallback answers it), but the round trip is not cancelled, so the target's
    one connection stays up and the other calls in flight on it get their own answers."""
    # A store timeout far longer than the budget, so the two stay told apart however
    # slow the machine (the elapsed time's upper bound below has seconds of room).
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=10.0)
    nodes = nodes_of(backend)
    moved_key = new_key()
    slot = key_slot(moved_key.encode())
    source = own_cluster.server_for_key(moved_key)
    target = next(s for s in own_cluster.servers if s is not source)
    on_target = keys_by_master(own_cluster, 1)[target.port][0]
    try:
        await nodes.refresh_slot_map()
        assert (await backend.hit([check(on_target)])).source == "redis"
        assert (await backend.hit([check(moved_key)])).source == "redis"
        wire = nodes.stores[name(target)].client
        assert isinstance(wire, RespClient) and wire.connects == 1
        address = wire.local_address
        own_cluster.start_migration(slot, source, target)
        own_cluster.move_keys(slot, source, target, [moved_key])
        target.pause()  # the ASK's hop waits on it
        try:
            normal = asyncio.ensure_future(backend.hit([check(on_target)]))
            by_submit = asyncio.ensure_future(ViaSubmit(backend).hit([check(on_target)]))
            await asyncio.sleep(0.05)  # both sent (or queued) on the target's connection
            started = time.monotonic()
            redirected = await backend.hit([check(moved_key)])
            elapsed = time.monotonic() - started
            assert not normal.done()
        finally:
            target.resume()
        assert redirected.source == "fallback"  # StoreTimeoutError, answered by the fallback
        # The redirection's budget, not the store timeout (10 s) nor the paused target.
        assert cluster_module.REDIRECT_SECONDS <= elapsed < cluster_module.REDIRECT_SECONDS + 2.0
        answers = await asyncio.gather(normal, by_submit)
        assert {r.source for r in answers} == {"redis"}
        assert sorted(LIMIT - r.states[0].remaining for r in answers) == [2, 3]
        assert counted(target, on_target) == 3
        # The same connection all along: never dropped, never made again.
        assert wire.connects == 1 and wire.local_address == address
        assert address in client_addresses(target)
    finally:
        await backend.close()


async def test_moved_goes_to_the_named_master_while_the_map_refreshes_slowly(
    own_cluster: RedisClusterProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    key = new_key()
    slot = key_slot(key.encode())
    source = own_cluster.server_for_key(key)
    target = next(s for s in own_cluster.servers if s is not source)
    try:
        await nodes.refresh_slot_map()
        for _ in range(3):
            assert (await backend.hit([check(key)])).source == "redis"
        manager = nodes.client.nodes_manager
        initialize = NodesManager.initialize
        # The refresh is held until both calls are answered (not for a fixed time, which a
        # slow machine could outlast): a call that waited for it would run out of its
        # redirection budget, or take until the refresh's own timeout.
        held = asyncio.Event()

        async def slow_initialize(self: NodesManager, *args: Any, **kwargs: Any) -> None:
            if self is manager:  # this backend's refreshes only
                await held.wait()
            await initialize(self, *args, **kwargs)

        # On the class: the instance's slots are read-only.
        monkeypatch.setattr(NodesManager, "initialize", slow_initialize)
        assert await asyncio.to_thread(own_cluster.migrate_slot, slot, source, target) == 1
        refreshes = nodes.refreshes
        results = []
        for via in (backend, ViaSubmit(backend)):
            started = time.monotonic()
            results.append(await via.hit([check(key)]))  # the map still names the source
            assert time.monotonic() - started < cluster_module.REFRESH_SECONDS
        held.set()  # the refresh goes on (its REFRESH_SECONDS run from its start)
        assert [r.source for r in results] == ["redis", "redis"]
        assert [r.states[0].remaining for r in results] == [LIMIT - 4, LIMIT - 5]
        assert nodes.moved == 2
        assert nodes.refreshes == refreshes + 1  # the second MOVED joined the running one
        await eventually(5, lambda: nodes.node_for(key) == name(target), "map refreshed")
        assert counted(target, key) == 5
    finally:
        await backend.close()


async def test_calls_after_close_are_refused_and_make_nothing(
    redis_cluster: RedisClusterProcess,
) -> None:
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    await nodes.refresh_slot_map()
    key = new_key()
    slot = key_slot(key.encode())
    owner = redis_cluster.server_for_key(key)
    await backend.close()
    with pytest.raises(CounterUnavailableError):
        await nodes.hit([check(key)])
    with pytest.raises(CounterUnavailableError):
        await ViaSubmit(nodes).hit([check(key)])
    # A redirection that comes back after close is answered, and sent nowhere.
    moved = ResponseError(f"MOVED {slot} {name(owner)}")
    (result,) = await nodes._redirected([[check(key)]], [moved])
    assert isinstance(result, CounterUnavailableError)
    assert nodes.stacks == {} and nodes.stores == {}
    assert counted(owner, key) == 0


async def test_stacks_of_masters_that_serve_no_slot_are_closed(
    own_cluster: RedisClusterProcess,
) -> None:
    """Two failovers in a row, each to a new replica: the stack of the master that left
    is closed (its connection too) a few refreshes later, so only masters' stacks stay."""
    master = own_cluster.servers[0]
    slots = owners(own_cluster)
    keys = [k for k in (new_key() for _ in range(200)) if slots[key_slot(k.encode())] is master][:3]
    events = RecordingEvents()
    backend = open_counter_backend(own_cluster.url, region="us", timeout_seconds=2.0, events=events)
    nodes = nodes_of(backend)
    nodes.retire_seconds = 0.3
    try:
        await nodes.refresh_slot_map()
        calls = 1
        for key in keys:
            assert (await backend.hit([check(key)])).source == "redis"
        for _ in range(2):
            old, new = master, await asyncio.to_thread(own_cluster.add_replica, master)
            wire = nodes.stores[name(old)].client
            assert isinstance(wire, RespClient)
            address = wire.local_address
            # A node joins as a master without slots and turns replica a moment later
            # (now and then of another master, right after a failover): made the old
            # one's for sure, and known as such everywhere before the failover, whose
            # wait for "every node sees it as a master" would pass at once otherwise.
            assert new.cli("CLUSTER", "REPLICATE", own_cluster.node_id(old)).strip() == "OK"
            await eventually(
                10,
                lambda new=new, old=old: (
                    seen_as_replica(own_cluster, new, old)
                    and "master_link_status:up" in new.cli("INFO", "replication")
                ),
                "every node knows the replica",
            )
            await asyncio.to_thread(own_cluster.manual_failover, new)
            master = new
            calls += 1
            for key in keys:  # MOVED, followed to the new master
                assert (await backend.hit([check(key)])).states[0].remaining == LIMIT - calls
            await eventually(10, lambda old=old: name(old) not in nodes.stacks, "stack closed")
            await eventually(5, gone(old, address), "its connection closed")
            masters = {name(s) for s in own_cluster.servers if own_cluster.is_master(s)}
            assert name(new) in nodes.stacks
            assert set(nodes.stacks) == set(nodes.stores) <= masters
        assert nodes.retired == 2
        for key in keys:
            assert counted(master, key) == calls
        assert events.breaker == [] and events.errors == []
    finally:
        await backend.close()


async def test_an_ask_without_a_usable_address_is_the_answer(
    redis_cluster: RedisClusterProcess,
) -> None:
    key = new_key()
    slot = key_slot(key.encode())
    owner = redis_cluster.server_for_key(key)
    for known in (True, False):  # the slot map loaded, or not yet
        backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
        nodes = nodes_of(backend)
        try:
            if known:
                await nodes.refresh_slot_map()
            stores = dict(nodes.stores)
            asks = [ResponseError(f"ASK {slot} {where}") for where in ("?:7000", "garbage", ":1")]
            results = await nodes._redirected([[check(key)] for _ in asks], list(asks))
            assert results == asks  # each call's own error reply, at once
            assert nodes.asked == len(asks)
            assert nodes.stores == stores  # nothing sent anywhere
            assert counted(owner, key) == 0
        finally:
            await backend.close()


async def test_a_keys_master_is_its_slots_own_whatever_the_cache_holds(
    redis_cluster: RedisClusterProcess,
) -> None:
    """``node_for`` keeps each key's slot (a pure function of the key), bounded: the
    master it names is always the one the cluster says serves that slot, for keys seen
    again and after the cache started over."""
    backend = open_counter_backend(redis_cluster.url, region="us", timeout_seconds=2.0)
    nodes = nodes_of(backend)
    nodes.max_cached_slots = 64
    try:
        await nodes.refresh_slot_map()
        slots = owners(redis_cluster)
        keys = [new_key() for _ in range(200)]
        for _ in range(2):  # new, then seen again (or dropped when the cache started over)
            for key in keys:
                assert nodes.node_for(key) == name(slots[key_slot(key.encode())])
                assert 1 <= nodes.cached_slots <= 64
    finally:
        await backend.close()
