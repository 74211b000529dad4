"""Sliding-window counters in Redis (standalone, Sentinel or Cluster).

One Lua script (``lua/sliding_window.lua``) checks every limit of a request and counts
it in all of them or none, with the store's own clock. The script runs by SHA; when
the server does not know it (first use, ``SCRIPT FLUSH``, a restarted or failed-over
server) it is loaded once and the affected calls are sent again, so no extra round
trip is spent on ``SCRIPT EXISTS`` in the common case.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Coroutine, Sequence
from functools import lru_cache
from importlib.resources import files
from typing import Any, Final, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError, ResponseError

from gateway.counters.base import HitResult, LimitCheck, LimitState
from gateway.counters.resp import GivenUpError, RespClient, pack, reply_error

SCRIPT_RESOURCE: Final = "sliding_window.lua"
HEALTH_TIMEOUT_SECONDS: Final = 1.0
MAX_CACHED_CALLS: Final = 50_000  # identities whose EVALSHA bytes are kept (then it starts over)

RedisClient: TypeAlias = Redis | RedisCluster
# What ``send_many`` hands back: one result or exception per entry, or why all failed.
BatchSettled: TypeAlias = Callable[[list[HitResult | Exception] | Exception], None]


@lru_cache(maxsize=1)
def script_text() -> str:
    """The Lua source shipped as package data."""
    return (files("gateway.counters") / "lua" / SCRIPT_RESOURCE).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def script_sha() -> str:
    """SHA1 of the script, as ``EVALSHA`` expects it."""
    return hashlib.sha1(script_text().encode("utf-8"), usedforsecurity=False).hexdigest()


def script_args(checks: Sequence[LimitCheck]) -> list[str | int]:
    """``EVALSHA`` arguments after the SHA: key count, keys, then four values per key."""
    args: list[str | int] = [len(checks)]
    args.extend(check.key for check in checks)
    for check in checks:
        if check.window_ms <= 0 or check.bucket_ms <= 0 or check.limit < 0:
            raise ValueError("limit checks need window_ms > 0, bucket_ms > 0 and limit >= 0")
        args.extend((check.limit, check.window_ms, check.bucket_ms, 1 if check.enforce else 0))
    return args


def parse_reply(reply: Any, count: int) -> tuple[HitResult, int]:
    """Turn the script's flat integer array into a result and the store's time (ms)."""
    if not isinstance(reply, list) or len(reply) != 2 + 3 * count:
        raise ResponseError("unexpected reply from the sliding-window script")
    if count == 1:  # the common case, without a generator
        state = LimitState(bool(reply[2]), int(reply[3]), int(reply[4]))
        return HitResult(bool(reply[0]), (state,), source="redis"), int(reply[1])
    states = tuple(
        LimitState(bool(reply[2 + 3 * i]), int(reply[3 + 3 * i]), int(reply[4 + 3 * i]))
        for i in range(count)
    )
    return HitResult(bool(reply[0]), states, source="redis"), int(reply[1])


def _fill(
    batch: Sequence[Sequence[LimitCheck]],
    todo: Sequence[int],
    replies: Sequence[Any],
    results: list[HitResult | Exception],
) -> list[int]:
    """Each call's reply (``replies[k]`` for ``batch[todo[k]]``) as its result, in place;
    an error reply is that call's exception. Returns the entries whose script the server
    did not know (NOSCRIPT), left for the caller to send again."""
    missing: list[int] = []
    for k, index in enumerate(todo):
        reply = replies[k]
        if isinstance(reply, ResponseError):
            reply = reply_error(reply)
        if isinstance(reply, NoScriptError):
            missing.append(index)
        elif isinstance(reply, Exception):
            results[index] = reply
        else:
            try:
                results[index] = parse_reply(reply, len(batch[index]))[0]
            except ResponseError as exc:
                results[index] = exc
    return missing


class _Call:
    """One request's EVALSHA: its arguments, validated, and once sent its bytes.

    The limiter hands the same checks object for an identity seen again (its own cache),
    so the call is kept per identity and its bytes are packed once: redis-py's packing
    was about half of the client's CPU per counter check in a pipeline of 50
    (benchmarks/README.md, "Data plane", the Redis rows)."""

    __slots__ = ("args", "checks", "packed")

    def __init__(self, checks: Sequence[LimitCheck], args: list[str | int]) -> None:
        self.checks = checks
        self.args = args
        self.packed: bytes | None = None


class RedisBackend:
    """A ``CounterBackend`` on one client: the lean ``RespClient`` (standalone servers)
    or a redis-py asyncio client (Sentinel, Cluster).

    ``hit_many`` sends several requests' checks in one pipeline (one round trip per
    node); ``CoalescingBackend`` uses it to batch concurrent requests.
    """

    def __init__(
        self, client: RedisClient | RespClient, *, name: str, close_client: bool = True
    ) -> None:
        self._client = client
        self._wire = client if isinstance(client, RespClient) else None
        self._name = name
        # False when several backends share one client (one per cluster master); the
        # owner closes it.
        self._close_client = close_client
        self._cluster = isinstance(client, RedisCluster)
        self._sha = script_sha()
        self._calls: dict[str, _Call] = {}  # first key of the checks -> their call
        self._tasks: set[asyncio.Task[None]] = set()  # the rare awaited follow-ups of send_many
        # Round trips started (single calls, pipelines, script loads); for benchmarks.
        self.round_trips = 0
        self.script_loads = 0

    @property
    def name(self) -> str:
        return self._name

    @property
    def client(self) -> RedisClient | RespClient:
        return self._client

    @property
    def lean(self) -> bool:
        """Whether ``send_many`` can send (the lean connection, not redis-py)."""
        return self._wire is not None

    async def hit(self, checks: Sequence[LimitCheck]) -> HitResult:
        return (await self.hit_timed(checks))[0]

    async def hit_timed(self, checks: Sequence[LimitCheck]) -> tuple[HitResult, int]:
        """Like ``hit``, plus the store's clock (ms since the epoch) at decision time."""
        if not checks:
            return HitResult(True, (), source="redis"), 0
        call = self._call(checks)
        self.round_trips += 1
        try:
            reply = await self._evalsha(call)
        except NoScriptError:
            # Loaded below, not here: compiled (mypyc) code must not await inside an
            # except or finally block (the exception being handled can resurface).
            reply = None
        if reply is None:
            await self.load_script()
            self.round_trips += 1
            reply = await self._evalsha(call)
        return parse_reply(reply, len(checks))

    async def _evalsha(self, call: _Call) -> Any:
        """One EVALSHA; an error reply raises. Standalone servers take the same lean
        round trip as a pipeline (``_direct_pipeline``)."""
        if self._cluster:
            cluster: Any = self._client
            return await cluster.execute_command("EVALSHA", self._sha, *call.args)
        if self._wire is not None:
            reply = (await self._wire_pipeline(self._wire, [call]))[0]
        else:
            reply = (await self._direct_pipeline([call]))[0]
        if isinstance(reply, Exception):
            raise reply
        return reply

    async def hit_many(self, batch: Sequence[Sequence[LimitCheck]]) -> list[HitResult | Exception]:
        """Run many independent ``hit`` calls in one pipeline.

        Each entry is a result or the exception for that entry alone (a bad check, a
        script error). Losing the connection raises, since it fails every entry.
        """
        results: list[HitResult | Exception] = [HitResult(True, (), source="redis")] * len(batch)
        todo: list[int] = []
        commands: list[_Call] = []
        for index, checks in enumerate(batch):
            if not checks:
                continue
            try:
                commands.append(self._call(checks))
            except ValueError as exc:
                results[index] = exc
                continue
            todo.append(index)
        if not commands:
            return results
        replies = await self._pipeline(commands)
        missing = _fill(batch, todo, replies, results)
        if missing:
            await self.load_script()
            again = await self._pipeline([self._call(batch[index]) for index in missing])
            for index in _fill(batch, missing, again, results):
                results[index] = NoScriptError("the server lost the script again")
        return results

    def send_many(self, batch: Sequence[Sequence[LimitCheck]], done: BatchSettled) -> bool:
        """``hit_many`` without a coroutine, on the lean connection already open: the
        pipeline is written now and ``done`` gets the results later, from the read that
        completes them. False, and nothing sent, without an open lean connection (then
        ``hit_many``, which connects).

        The rare cases that need to wait for something else go on in a task, with the
        same outcome as ``hit_many``: a script the server lost (``NOSCRIPT``: loaded,
        then those calls sent again) and a connection that died under the round trip
        (sent once more on a new connection, as ``hit_many`` retries once).
        """
        wire = self._wire
        if wire is None:
            return False
        results: list[HitResult | Exception] = [HitResult(True, (), source="redis")] * len(batch)
        todo: list[int] = []
        packed: list[bytes] = []
        sha = self._sha
        for index, checks in enumerate(batch):
            if not checks:
                continue
            try:
                call = self._call(checks)
                if call.packed is None:  # a key that cannot be encoded fails here, alone
                    call.packed = pack(("EVALSHA", sha, *call.args))
            except ValueError as exc:
                results[index] = exc
                continue
            packed.append(call.packed)
            todo.append(index)

        def replied(replies: list[Any] | Exception) -> None:
            if isinstance(replies, Exception):
                if isinstance(replies, GivenUpError):
                    done(replies)
                else:
                    self._follow_up(self._again(batch, done))
                return
            missing = _fill(batch, todo, replies, results)
            if missing:
                self._follow_up(self._reload_then(batch, missing, results, done))
                return
            done(results)

        if not todo:  # nothing to ask the store
            asyncio.get_running_loop().call_soon(done, results)
            return True
        if not wire.send_now(b"".join(packed), len(packed), replied):
            return False
        self.round_trips += 1
        return True

    def drop_connection(self, why: str) -> None:
        """Drop the lean connection (a round trip on it was given up)."""
        if self._wire is not None:
            self._wire.drop(why)

    def _follow_up(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _again(self, batch: Sequence[Sequence[LimitCheck]], done: BatchSettled) -> None:
        # The connection died under the round trip (a restarted server): once more on
        # a new one, as the awaited way retries once.
        outcome: list[HitResult | Exception] | Exception
        try:
            outcome = await self.hit_many(batch)
        except Exception as exc:
            outcome = exc
        done(outcome)

    async def _reload_then(
        self,
        batch: Sequence[Sequence[LimitCheck]],
        missing: list[int],
        results: list[HitResult | Exception],
        done: BatchSettled,
    ) -> None:
        outcome: list[HitResult | Exception] | Exception = results
        try:
            await self.load_script()
            again = await self.hit_many([batch[i] for i in missing])
        except Exception as exc:
            outcome = exc
        else:
            for index, result in zip(missing, again, strict=True):
                results[index] = result
        done(outcome)

    async def _pipeline(self, commands: Sequence[_Call]) -> list[Any]:
        self.round_trips += 1
        if self._wire is not None:
            return await self._wire_pipeline(self._wire, commands)
        if not self._cluster:
            return await self._direct_pipeline(commands)
        cluster: Any = self._client
        pipe: Any = cluster.pipeline(transaction=False)
        for call in commands:
            pipe.execute_command("EVALSHA", self._sha, *call.args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def _wire_pipeline(self, wire: RespClient, commands: Sequence[_Call]) -> list[Any]:
        """The EVALSHA calls in one write on the lean connection; an error reply is that
        call's result alone (``NoScriptError`` for a script the server lost)."""
        sha = self._sha
        wire_bytes: list[bytes] = []
        for call in commands:
            packed = call.packed
            if packed is None:
                packed = call.packed = pack(("EVALSHA", sha, *call.args))
            wire_bytes.append(packed)
        replies = await wire.call(b"".join(wire_bytes), len(wire_bytes))
        for k, reply in enumerate(replies):
            if isinstance(reply, ResponseError):
                replies[k] = reply_error(reply)
        return replies

    async def _direct_pipeline(self, commands: Sequence[_Call]) -> list[Any]:
        """The EVALSHA calls written in one send on one pooled connection and their
        replies read in order; an error reply is that call's result alone.

        What redis-py's ``Pipeline`` does around the same bytes (a command stack,
        response callbacks, error annotation per call) cost about as much again as the
        calls themselves: ~12 vs ~6.6 us of client CPU per counter check in a pipeline
        of 50 (benchmarks/README.md, "Data plane", the Redis rows). Like redis-py, a
        connection error retries the round trip once on a new connection (a pooled one
        may have died with a restarted server), and any failure while reading (a
        timeout's cancellation too) drops the connection: its reply stream is
        unusable.
        """
        client: Any = self._client
        pool = client.connection_pool
        conn = await pool.get_connection()
        replies: list[Any] = []
        failure: BaseException | None = None
        try:
            replies = await conn.retry.call_with_retry(
                lambda: self._send_and_read(conn, commands), lambda _: conn.disconnect()
            )
        except BaseException as exc:  # released first (no await in except/finally: above)
            failure = exc
        await pool.release(conn)
        if failure is not None:
            raise failure
        return replies

    async def _send_and_read(self, conn: Any, commands: Sequence[_Call]) -> list[Any]:
        sha = self._sha
        wire: list[bytes] = []
        for call in commands:
            packed = call.packed
            if packed is None:
                # redis-py's own packing and encoder, once per call
                packed = call.packed = b"".join(conn.pack_command("EVALSHA", sha, *call.args))
            wire.append(packed)
        await conn.send_packed_command(b"".join(wire))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:  # NOSCRIPT, a script error: this call only
                replies.append(exc)
        return replies

    async def load_script(self) -> None:
        """Load the script (on every primary, for a cluster); normally done on demand."""
        self.round_trips += 1
        self.script_loads += 1
        sha: Any
        if self._wire is not None:
            sha = await self._wire.command("SCRIPT", "LOAD", script_text())
        else:
            redis: Any = self._client
            sha = await redis.script_load(script_text())
        if isinstance(sha, bytes):
            sha = sha.decode("ascii")
        if sha != self._sha:
            raise ResponseError("the server computed another SHA for the script")

    def _call(self, checks: Sequence[LimitCheck]) -> _Call:
        """The call for these checks: kept while the limiter hands the same checks
        object (a reloaded rule builds new ones, so nothing stale is sent)."""
        key = checks[0].key
        found = self._calls.get(key)
        if found is not None and found.checks is checks:
            return found
        call = _Call(checks, self._args(checks))
        if len(self._calls) >= MAX_CACHED_CALLS:
            self._calls.clear()
        self._calls[key] = call
        return call

    def _args(self, checks: Sequence[LimitCheck]) -> list[str | int]:
        if self._cluster and len(checks) > 1:
            slot = key_slot(checks[0].key.encode())
            if any(key_slot(c.key.encode()) != slot for c in checks[1:]):
                raise ValueError("the keys of one call must share a Redis Cluster hash tag")
        return script_args(checks)

    async def healthy(self) -> bool:
        try:
            async with asyncio.timeout(HEALTH_TIMEOUT_SECONDS):
                if self._wire is not None:
                    return await self._wire.ping()
                redis: Any = self._client
                return bool(await redis.ping())
        except Exception:
            return False

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if not self._close_client:
            return
        client = self._client
        if isinstance(client, RespClient):
            await client.close()
        else:
            await client.aclose()
