"""Redis Cluster: a timeout, breaker, coalescer and lean connection per master.

Each call goes to the stack of the master that serves its keys' slot, as redis-py's
cluster client's slot map says at that moment. Each master's stack sends over its own
``RespClient`` (``gateway/counters/resp.py``), the same pipelined connection a
standalone server gets; redis-py's ``RedisCluster`` stays the source of the slot map
(``CLUSTER SLOTS``, refreshed as below) and carries the calls sent before the map is
known (the ``""`` stack) and the health check.

What keeps the counts exact while slots move (resharding, failover). The script counts
a call in all its keys or none, and a master that does not serve a call's slot answers
with an error reply before running anything, so a redirected call is sent again:

* ``MOVED slot host:port``: the slot has a new owner. The call goes to the named
  master at once, on that master's connection, while the slot map is refreshed in the
  background (once for all the calls redirected together, and not when it already
  names that owner; concurrent refreshes are one): waiting for it would only add its
  time, which during a failover can be the whole budget. Only a call whose ``MOVED``
  names no usable address waits for the refresh, then goes where the map says.
* ``ASK slot host:port``: the slot is being migrated and this call's keys are gone from
  the old owner. The call goes to the named master right after ``ASKING``, in one write
  on its connection; the map is not changed (the old owner still serves the slot). An
  ``ASK`` that names no usable address is that call's answer (its error reply).
* ``TRYAGAIN`` (a call of several keys, some of them moved already): sent again to the
  slot's owner after a short pause, until the migration ends.

A call is followed for at most ``MAX_REDIRECTIONS`` hops and ``REDIRECT_SECONDS``; what
the master it ends at answers is its result. The budget is checked before each hop; a
hop already sent is never cancelled for it (that would drop the target master's only
connection and fail every other round in flight on it): the call fails with
``StoreTimeoutError`` at the deadline and the late reply is dropped. A lost connection
(a master that died or left) fails only the calls in flight on it. Whether the master
ran them is unknown, so they are never sent to another master (no double count); as
for a standalone server they go once more to the same address on a new connection, and
when that fails too its stack's breaker and fallback answer them. Every store failure
schedules a refresh of the map (``REFRESH_INTERVAL_SECONDS`` apart at most), so a
replica promoted in its place gets its own stack and connection and the slot's calls go
there. The stack of a master that has served no slot for ``RETIRE_REFRESHES`` refreshes
in a row and ``RETIRE_SECONDS`` is closed with its connection (repeated failovers do
not pile up stacks); a later refresh while such a stack waits is scheduled for it.

Once ``close`` has run, every call is answered with ``CounterUnavailableError`` and no
stack or connection is made any more.
"""

from __future__ import annotations

import asyncio
import logging
from binascii import crc_hqx
from collections.abc import Callable, Sequence
from typing import Final

from redis.asyncio.cluster import RedisCluster

from gateway.counters.base import (
    CounterBackend,
    CounterEvents,
    CounterUnavailableError,
    HitResult,
    HitSettled,
    LimitCheck,
)
from gateway.counters.errors import StoreTimeoutError
from gateway.counters.redis_backend import RedisBackend, redirection
from gateway.counters.resilient import CLOSED, HALF_OPEN, OPEN
from gateway.counters.resp import RespClient

log = logging.getLogger("gateway.counters")

# Following one batch's redirections (slot-map refresh and the calls sent again): well
# inside the coalescer's hard bound on a round trip (1 s at least).
REDIRECT_SECONDS: Final = 0.5
MAX_REDIRECTIONS: Final = 5
TRYAGAIN_PAUSE_SECONDS: Final = 0.01
# One slot-map refresh (CLUSTER SLOTS from a reachable node; redis-py reads it without a
# timeout of its own), and how often store failures may ask for one.
REFRESH_SECONDS: Final = 1.0
REFRESH_INTERVAL_SECONDS: Final = 0.5
# A redirected call's round trip that outlives the budget goes on in the background (its
# reply dropped); past this it is given up, which drops that master's connection as a
# stack's own hard bound does for a hung server (far longer than any healthy answer).
LATE_SEND_SECONDS: Final = 10.0
# A master's stack that served no slot for this many refreshes in a row, the first at
# least this long ago, is closed: longer than a call stays in a stack (its queue and
# hard bounds with the default timeouts), so none is in flight on it any more.
RETIRE_REFRESHES: Final = 3
RETIRE_SECONDS: Final = 10.0
MAX_CACHED_SLOTS: Final = 50_000  # keys whose slot node_for keeps (then it starts over)
CLUSTER_SLOTS: Final = 16384  # Redis Cluster's key space (redis.crc.REDIS_CLUSTER_HASH_SLOTS)

_BREAKER_RANK = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}

NodeClient = Callable[[str, int], RespClient]


class _NodeBreakers:
    """The breakers of every master reported as one: the worst state among them.

    Errors, fallback decisions and deny-cache hits pass through unchanged; a store
    error also tells ``failed`` which master it came from. The breaker of a node that
    serves no slot any more (a master that failed over, the stack of the calls sent
    before the slot map was known) no longer counts (``departed``).
    """

    def __init__(self, events: CounterEvents, failed: Callable[[str], None] | None = None) -> None:
        self._events = events
        self._failed = failed
        self._states: dict[str, str] = {}
        self._departed: frozenset[str] = frozenset()
        self._reported = CLOSED

    def for_node(self, node: str) -> _NodeEvents:
        return _NodeEvents(self, node)

    def changed(self, node: str, state: str) -> None:
        self._states[node] = state
        self._report()

    def forget(self, node: str) -> None:
        """A node whose stack was closed: its breaker no longer counts."""
        if self._states.pop(node, None) is not None:
            self._report()

    def departed(self, nodes: frozenset[str]) -> None:
        """The nodes that serve no slot now (the slot map just read), until they do."""
        if nodes != self._departed:
            self._departed = nodes
            self._report()

    def store_error(self, node: str, kind: str) -> None:
        self._events.store_error(kind)
        if self._failed is not None:
            self._failed(node)

    def _report(self) -> None:
        departed = self._departed
        states = [state for node, state in self._states.items() if node not in departed]
        worst = max(states, key=lambda s: _BREAKER_RANK.get(s, 1)) if states else CLOSED
        if worst != self._reported:
            self._reported = worst
            self._events.breaker_changed(worst)

    @property
    def events(self) -> CounterEvents:
        return self._events


class _NodeEvents:
    def __init__(self, breakers: _NodeBreakers, node: str) -> None:
        self._breakers = breakers
        self._node = node
        # Set when the node's stack is closed: what its closing fails must not count
        # for a stack of the same name made later.
        self.retired = False

    def store_error(self, kind: str) -> None:
        self._breakers.store_error(self._node, kind)

    def breaker_changed(self, state: str) -> None:
        if not self.retired:
            self._breakers.changed(self._node, state)

    def fallback_used(self) -> None:
        self._breakers.events.fallback_used()

    def deny_cache_hit(self) -> None:
        self._breakers.events.deny_cache_hit()


def slot_of(key: str) -> int:
    """The Redis Cluster slot of ``key`` (CRC16 of its hash tag, or of the whole key
    without one), as ``redis.crc.key_slot`` computes it from the key's UTF-8 bytes; here
    compiled (gateway.native), where that one runs as Python code for every call.
    tests/counters/test_cluster_slots.py checks the two agree."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc_hqx(data, 0) % CLUSTER_SLOTS


def _address(node: str) -> tuple[str, int] | None:
    """``host:port`` (as redis-py names nodes and Redis names them in redirections) as a
    pair; None for an endpoint a redirection leaves unknown (``?:port``, ``:port``)."""
    host, _, port = node.rpartition(":")
    if not host or host == "?" or not port.isdigit():
        return None
    return host, int(port)


def _out_of_time() -> StoreTimeoutError:
    return StoreTimeoutError("following a Redis Cluster redirection ran out of time")


def _closed() -> CounterUnavailableError:
    return CounterUnavailableError("the counter backend is closed")


class PerNodeBackend:
    """Redis Cluster: a timeout, breaker and coalescer per master (module docstring).

    ``node_client`` makes the lean connection to one master; without it every master's
    stack sends through redis-py's cluster client (which follows redirections itself).
    """

    def __init__(
        self,
        client: RedisCluster,
        build: Callable[[RedisBackend, CounterEvents], CounterBackend],
        *,
        name: str,
        events: CounterEvents,
        node_client: NodeClient | None = None,
    ) -> None:
        self._client = client
        self._build = build
        self._name = name
        self._node_client = node_client
        self._breakers = _NodeBreakers(events, self._store_failed)
        self._stacks: dict[str, CounterBackend] = {}
        self._slots: dict[str, int] = {}  # key -> its slot (node_for)
        self._stores: dict[str, RedisBackend] = {}
        self._submits: dict[str, Callable[[Sequence[LimitCheck], HitSettled], bool] | None] = {}
        self._events: dict[str, _NodeEvents] = {}
        self._probe = RedisBackend(client, name=name, close_client=False)
        self._refreshing: asyncio.Task[None] | None = None
        self._refresh_started = float("-inf")
        # Redirected round trips (``_send``) and the closing of retired stacks: kept
        # until they end, so none is collected early or left behind by ``close``.
        self._sends: set[asyncio.Task[list[HitResult | Exception]]] = set()
        self._closing: set[asyncio.Task[None]] = set()
        # Nodes serving no slot: (loop time of the first such refresh, refreshes so far).
        self._departed_since: dict[str, tuple[float, int]] = {}
        self._retire_timer: asyncio.TimerHandle | None = None
        self._closed = False
        # Redirections followed, by kind, slot-map refreshes run and stacks closed for
        # serving no slot; for tests and /info.
        self.moved = 0
        self.asked = 0
        self.tried_again = 0
        self.refreshes = 0
        self.retired = 0
        # Kept per instance (tests shorten it): a module constant is inlined where this
        # module is compiled (gateway.native).
        self.retire_seconds = RETIRE_SECONDS
        self.max_cached_slots = MAX_CACHED_SLOTS

    @property
    def name(self) -> str:
        return self._name

    @property
    def client(self) -> RedisCluster:
        """redis-py's cluster client, which keeps the slot map."""
        return self._client

    @property
    def stacks(self) -> dict[str, CounterBackend]:
        """The stack per master (``host:port``; ``""`` before the slot map is known)."""
        return self._stacks

    @property
    def stores(self) -> dict[str, RedisBackend]:
        """The store at the bottom of each stack, by the same names."""
        return self._stores

    @property
    def cached_slots(self) -> int:
        """How many keys' slots ``node_for`` keeps now (at most ``max_cached_slots``)."""
        return len(self._slots)

    def node_for(self, key: str) -> str:
        # The slot of a key never changes: kept per key (computing it was 3,700 of the
        # ~200,000 instructions a proxied request costs the gateway, twice a request:
        # benchmarks/dataplane_instructions.py --kinds cluster), bounded as the other
        # per-identity caches are.
        slot = self._slots.get(key)
        if slot is None:
            if len(self._slots) >= self.max_cached_slots:
                self._slots.clear()
            slot = self._slots[key] = slot_of(key)
        return self.node_for_slot(slot)

    def node_for_slot(self, slot: int) -> str:
        nodes = self._client.nodes_manager.slots_cache.get(slot)
        return nodes[0].name if nodes else ""

    def stack_for(self, key: str) -> CounterBackend:
        node = self.node_for(key)
        stack = self._stacks.get(node)
        if stack is None:
            stack = self._new_stack(node)
        return stack

    def _new_stack(self, node: str) -> CounterBackend:
        if self._closed:
            # A call racing shutdown: nothing new that no one would close.
            raise _closed()
        label = f"{self._name} [{node or 'any'}]"
        address = _address(node) if self._node_client is not None else None
        if self._node_client is not None and address is not None:
            store = RedisBackend(
                self._node_client(*address), name=label, cluster=True, redirect=self._redirected
            )
        else:
            # redis-py's client routes these calls itself, and loads the slot map on the
            # first one; meanwhile it is loaded here too, so the lean stacks take over.
            store = RedisBackend(self._client, name=label, close_client=False)
            if self._node_client is not None:
                self._refresh_soon()
        events = self._breakers.for_node(node)
        stack = self._build(store, events)
        self._events[node] = events
        self._stores[node] = store
        self._stacks[node] = stack
        self._submits[node] = getattr(stack, "submit", None)
        return stack

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        if self._closed:
            raise _closed()
        if not checks:
            return HitResult(True, (), source="redis")
        return await self.stack_for(checks[0].key).hit(checks)

    def submit(self, checks: Sequence[LimitCheck], done: HitSettled) -> bool:
        """``hit`` by callback, through the stack of the master that serves the keys."""
        if self._closed:
            # Answered as the coalescer answers once closed: later, by ``done``.
            asyncio.get_running_loop().call_soon(done, _closed())
            return True
        if not checks:
            return False
        node = self.node_for(checks[0].key)
        if node not in self._stacks:
            self._new_stack(node)
        submit = self._submits[node]
        return bool(submit(checks, done)) if submit is not None else False

    # --- redirections

    async def _redirected(
        self, batch: list[Sequence[LimitCheck]], errors: list[Exception]
    ) -> list[HitResult | Exception]:
        """Follow the calls a master redirected (``RedisBackend``'s ``redirect``): one
        result or exception per call, never raises (but for cancellation)."""
        results: list[HitResult | Exception] = list(errors)
        deadline = asyncio.get_running_loop().time() + REDIRECT_SECONDS
        await self._follow(batch, results, deadline)
        return results

    async def _follow(
        self,
        batch: list[Sequence[LimitCheck]],
        results: list[HitResult | Exception],
        deadline: float,
    ) -> None:
        """One hop per turn, until no call is redirected any more, for at most
        ``MAX_REDIRECTIONS`` hops and until ``deadline`` (loop time): no hop starts past
        it, and a hop in flight at it is left to finish in the background (``_send``)
        while its calls fail with ``StoreTimeoutError``."""
        loop = asyncio.get_running_loop()
        todo = [index for index, result in enumerate(results) if redirection(result)]
        for _ in range(MAX_REDIRECTIONS):
            if not todo:
                return
            groups: dict[tuple[str, bool], list[int]] = {}
            wait = pause = False
            for index in todo:
                kind, _, rest = str(results[index]).partition(" ")
                slot_text, _, node = rest.partition(" ")
                usable = _address(node) is not None
                asking = kind == "ASK"
                if kind == "MOVED":
                    self.moved += 1
                    slot = int(slot_text) if slot_text.isdigit() else -1
                    if slot < 0 or self.node_for_slot(slot) != node:
                        if usable:
                            self._refresh_now()  # sent to the named owner meanwhile
                        else:
                            wait = True  # sent where the refreshed map says
                elif asking:
                    self.asked += 1
                    if not usable:
                        # Only the named node has this call's keys: its answer is the
                        # error reply (its old owner would just ask again).
                        continue
                else:  # TRYAGAIN: the slot's owner again, after a pause
                    self.tried_again += 1
                    pause = True
                    usable = False
                groups.setdefault((node if usable else "", asking), []).append(index)
            if wait:
                await self._refresh_until(deadline)
            if pause:
                await asyncio.sleep(min(TRYAGAIN_PAUSE_SECONDS, max(0.0, deadline - loop.time())))
            failure: Exception | None = None
            if self._closed:
                failure = _closed()
            elif loop.time() >= deadline:
                failure = _out_of_time()
            if failure is not None:
                for indices in groups.values():
                    for index in indices:
                        results[index] = failure
                return
            sends: list[tuple[asyncio.Task[list[HitResult | Exception]], list[int]]] = []
            for (node, asking), indices in groups.items():
                if not node:
                    # Grouped by the owner each call's slot has now.
                    for index in indices:
                        owner = self.node_for(batch[index][0].key)
                        sends.append((self._send(owner, [batch[index]], asking), [index]))
                else:
                    calls = [batch[i] for i in indices]
                    sends.append((self._send(node, calls, asking), indices))
            if not sends:
                return
            # Waited for until the deadline only: never cancelled here (``_send``).
            await asyncio.wait([task for task, _ in sends], timeout=deadline - loop.time())
            todo = []
            for task, indices in sends:
                if not task.done():
                    for index in indices:
                        results[index] = _out_of_time()
                    continue
                if task.cancelled():  # by ``close``
                    for index in indices:
                        results[index] = _closed()
                    continue
                outcome = task.exception()
                if outcome is not None:
                    if not isinstance(outcome, Exception):
                        raise outcome
                    # The round trip failed as a whole (a lost connection): whether the
                    # master ran these is unknown, so they go nowhere else.
                    for index in indices:
                        results[index] = outcome
                    continue
                for index, result in zip(indices, task.result(), strict=True):
                    results[index] = result
                    if redirection(result):
                        todo.append(index)

    def _send(
        self, node: str, calls: list[Sequence[LimitCheck]], asking: bool
    ) -> asyncio.Task[list[HitResult | Exception]]:
        """The redirected calls sent to ``node``'s store, in a task of their own: a
        caller that stops waiting (the budget, or its own caller's bound) does not
        cancel the round trip, which would drop that master's connection and fail every
        other round in flight on it. Bounded by ``LATE_SEND_SECONDS``."""
        store = self._store(node)
        task = asyncio.get_running_loop().create_task(self._bounded(store, calls, asking))
        self._sends.add(task)
        task.add_done_callback(self._sent)
        return task

    @staticmethod
    async def _bounded(
        store: RedisBackend, calls: list[Sequence[LimitCheck]], asking: bool
    ) -> list[HitResult | Exception]:
        async with asyncio.timeout(LATE_SEND_SECONDS):
            return await store.hit_redirected(calls, asking)

    def _sent(self, task: asyncio.Task[list[HitResult | Exception]]) -> None:
        self._sends.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved here: a late one's caller has gone

    def _store(self, node: str) -> RedisBackend:
        # A node redirected to is in use, whatever the map says (an ASK target may serve
        # no slot yet): not retired before it has been left alone again for a while.
        self._departed_since.pop(node, None)
        store = self._stores.get(node)
        if store is None:
            self._new_stack(node)
            store = self._stores[node]
        return store

    # --- the slot map

    async def refresh_slot_map(self) -> None:
        """Load the slot map again (bounded by ``REFRESH_SECONDS``; a failure is logged
        at debug and left for the next redirection or store failure to retry). One
        refresh serves everyone who asks while it runs; a caller that gives up does not
        stop it."""
        if self._closed:
            return
        task = self._refreshing
        if task is None or task.done():
            task = self._start_refresh()
        await asyncio.shield(task)

    async def _refresh_until(self, deadline: float) -> None:
        """``refresh_slot_map``, waited for until ``deadline`` (loop time) at most; the
        refresh itself goes on."""
        try:
            async with asyncio.timeout_at(deadline):
                await self.refresh_slot_map()
        except TimeoutError:
            pass

    def _refresh_now(self) -> None:
        """A refresh in the background, unless one runs (a ``MOVED``: the map is
        known to be stale, so no interval applies)."""
        task = self._refreshing
        if not self._closed and (task is None or task.done()):
            self._start_refresh()

    def _refresh_soon(self) -> None:
        """A refresh in the background, unless one runs or ran within
        ``REFRESH_INTERVAL_SECONDS``."""
        if self._closed:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # pragma: no cover - stores fail only inside the loop
            return
        task = self._refreshing
        if task is not None and not task.done():
            return
        if loop.time() - self._refresh_started < REFRESH_INTERVAL_SECONDS:
            return
        self._start_refresh()

    def _start_refresh(self) -> asyncio.Task[None]:
        loop = asyncio.get_running_loop()
        self._refresh_started = loop.time()
        task = self._refreshing = loop.create_task(self._refresh())
        return task

    async def _refresh(self) -> None:
        self.refreshes += 1
        client = self._client
        try:
            async with asyncio.timeout(REFRESH_SECONDS):
                if client.nodes_manager.slots_cache:
                    await client.nodes_manager.initialize()
                else:
                    await client.initialize()
        except Exception as exc:  # the next failure or redirection asks again
            log.debug("Redis Cluster slot map not refreshed: %s", type(exc).__name__)
            self._check_retiring_later()  # a stack waiting to retire: try again then
            return
        slots = client.nodes_manager.slots_cache
        masters = {nodes[0].name for nodes in slots.values() if nodes}
        if len(slots) < CLUSTER_SLOTS:
            masters.add("")  # a slot without a master: its calls go to "" (redis-py)
        departed = frozenset(node for node in self._stacks if node not in masters)
        self._retire(departed)
        self._breakers.departed(frozenset(node for node in departed if node in self._stacks))

    def _retire(self, departed: frozenset[str]) -> None:
        """Count one more refresh for each stack of a node that serves no slot, close
        those past ``RETIRE_REFRESHES`` and ``RETIRE_SECONDS``, and schedule a refresh
        for those still waiting (with no failure to ask for one, none would come)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        since = self._departed_since
        for node in [node for node in since if node not in departed]:
            del since[node]  # serves slots again, or gone already
        for node in departed:
            first, seen = since.get(node, (now, 0))
            seen += 1
            if seen < RETIRE_REFRESHES or now - first < self.retire_seconds:
                since[node] = (first, seen)
                continue
            del since[node]
            stack = self._stacks.pop(node)
            self._stores.pop(node, None)
            self._submits.pop(node, None)
            events = self._events.pop(node, None)
            if events is not None:
                events.retired = True
            self._breakers.forget(node)
            self.retired += 1
            log.info("Redis Cluster: %s serves no slot any more; its connection is closed", node)
            task = loop.create_task(stack.close())
            self._closing.add(task)
            task.add_done_callback(self._closed_stack)
        self._check_retiring_later()

    def _check_retiring_later(self) -> None:
        if self._departed_since and self._retire_timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._retire_timer = loop.call_later(self.retire_seconds, self._retire_check)

    def _retire_check(self) -> None:
        # Not held back by REFRESH_INTERVAL_SECONDS: the chain of checks would end.
        self._retire_timer = None
        self._refresh_now()

    def _closed_stack(self, task: asyncio.Task[None]) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("Redis Cluster: closing a stack failed: %r", task.exception())

    def _store_failed(self, node: str) -> None:
        # A master that failed may have left (failover): what the cluster says now.
        if self._node_client is not None:
            self._refresh_soon()

    async def healthy(self) -> bool:
        return await self._probe.healthy()

    async def close(self) -> None:
        self._closed = True
        if self._retire_timer is not None:
            self._retire_timer.cancel()
            self._retire_timer = None
        task = self._refreshing
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sends = list(self._sends)
        for send in sends:
            send.cancel()
        await asyncio.gather(*sends, *self._closing, return_exceptions=True)
        for stack in list(self._stacks.values()):
            await stack.close()  # each lean store closes its connection
        self._stacks.clear()
        self._stores.clear()
        self._submits.clear()
        await self._client.aclose()
