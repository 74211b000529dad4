"""Sliding-window counters in Redis (standalone, Sentinel or Cluster).

One Lua script (``lua/sliding_window.lua``) checks every limit of a request and counts
it in all of them or none, with the store's own clock. The script runs by SHA; when
the server does not know it (first use, ``SCRIPT FLUSH``, a restarted or failed-over
server) it is loaded once and the affected calls are sent again, so no extra round
trip is spent on ``SCRIPT EXISTS`` in the common case.

A Redis Cluster master is reached like a standalone server, over its own lean
connection (``gateway/counters/cluster.py`` routes each call to its master). A call
the master does not serve comes back as ``MOVED`` or ``ASK`` (or ``TRYAGAIN`` while its
slot migrates): nothing was counted, and the ``redirect`` the backend was built with
sends it again where it belongs.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import lru_cache
from importlib.resources import files
from typing import Any, Final, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoScriptError, ResponseError

from gateway.counters.base import HitResult, LimitCheck, LimitState
from gateway.counters.resp import GivenUpError, RespClient, pack, reply_error

log = logging.getLogger("gateway.counters")

SCRIPT_RESOURCE: Final = "sliding_window.lua"
# Its cross-slot form: this file in place of the script's marker line, the flag first.
CROSS_SLOT_RESOURCE: Final = "cross_slot_prelude.lua"
CROSS_SLOT_MARKER: Final = "local KEYS, ARGV, read = KEYS, ARGV, nil\n"
CROSS_SLOT_SHEBANG: Final = "#!lua flags=allow-cross-slot-keys\n"
HEALTH_TIMEOUT_SECONDS: Final = 1.0
MAX_CACHED_CHECKS: Final = 50_000  # checks whose packed form is kept (then it starts over)
# Requests in one script call: it holds the server about 10 us a request, so 64 bound
# the time other clients wait behind one call to well under a millisecond.
MAX_REQUESTS_PER_CALL: Final = 64

RedisClient: TypeAlias = Redis | RedisCluster
# What ``send_many`` hands back: one result or exception per entry, or why all failed.
BatchSettled: TypeAlias = Callable[[list[HitResult | Exception] | Exception], None]
# Follows calls a cluster master redirected (their checks, and the error reply each got:
# ``MOVED``, ``ASK``, ``TRYAGAIN``) to where they belong; one result or exception per call.
Redirect: TypeAlias = Callable[
    [list[Sequence[LimitCheck]], list[Exception]], Awaitable[list[HitResult | Exception]]
]

# What SCRIPT LOAD answers for the cross-slot form on a server without script flags
# (before Redis 7.0: the "#!" line does not compile) or without this flag.
NO_SCRIPT_FLAGS: Final = ("compil", "shebang", "flag")
# A script that touches keys of two slots without the flag allow-cross-slot-keys.
CROSS_SLOT_REFUSED: Final = "do not hash to the same slot"

# Error replies that mean "not counted here, send it again" (a cluster redirection, or a
# multi-key call during a slot migration).
REDIRECTIONS: Final = ("MOVED ", "ASK ", "TRYAGAIN")
ASKING: Final = pack(("ASKING",))
# What a cluster master answers, before the cross-slot form writes anything, when one of
# its keys is not its own (a slot that moved: the form reads every key first), or when
# the cluster cannot serve at all; and what it answers when it ignores the form's flag.
NOT_SERVED_HERE: Final = ("non local key", "CLUSTERDOWN", "CROSSSLOT", CROSS_SLOT_REFUSED)


def redirection(reply: object) -> bool:
    """Whether a call's result is a redirection (``REDIRECTIONS``): the master did not
    run the script, so nothing was counted."""
    return isinstance(reply, ResponseError) and str(reply).startswith(REDIRECTIONS)


def _errors(results: Sequence[HitResult | Exception], indices: Sequence[int]) -> list[Exception]:
    """The exceptions among ``results`` at ``indices`` (the redirected calls')."""
    found: list[Exception] = []
    for index in indices:
        result = results[index]
        if isinstance(result, Exception):
            found.append(result)
    return found


@lru_cache(maxsize=1)
def script_text() -> str:
    """The Lua source shipped as package data."""
    return (files("gateway.counters") / "lua" / SCRIPT_RESOURCE).read_text(encoding="utf-8")


@lru_cache(maxsize=1)
def script_sha() -> str:
    """SHA1 of the script, as ``EVALSHA`` expects it."""
    return _sha(script_text())


@lru_cache(maxsize=1)
def cross_slot_text() -> str:
    """The script's cross-slot form (``lua/cross_slot_prelude.lua``): the requests of
    several slots one Redis Cluster master serves, in one call (Redis 7.0 and later)."""
    text = script_text()
    if text.count(CROSS_SLOT_MARKER) != 1:
        raise RuntimeError(f"{SCRIPT_RESOURCE} lost its line {repr(CROSS_SLOT_MARKER.strip())}")
    prelude = (files("gateway.counters") / "lua" / CROSS_SLOT_RESOURCE).read_text("utf-8")
    return CROSS_SLOT_SHEBANG + text.replace(CROSS_SLOT_MARKER, prelude)


@lru_cache(maxsize=1)
def cross_slot_sha() -> str:
    return _sha(cross_slot_text())


def _sha(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8"), usedforsecurity=False).hexdigest()


LIMIT_VALUES: Final = struct.Struct("<4d")  # limit, window_ms, bucket_ms, enforce
# The bulk-string header of a request's ARGV string, by its number of checks.
ARGV_HEADS: Final = tuple(b"$%d\r\n" % (LIMIT_VALUES.size * n) for n in range(9))


def script_args(checks: Sequence[LimitCheck]) -> list[str | int | bytes]:
    """``EVALSHA`` arguments after the SHA for one request: key count, keys, then (its
    ``ARGV``) one string of four little-endian doubles a key: limit, window, bucket,
    enforce (the script reads them with ``struct``: a tenth of its cost went to parsing
    decimal strings, benchmarks/script_instructions.py)."""
    args: list[str | int | bytes] = [len(checks)]
    args.extend(check.key for check in checks)
    args.append(b"".join([limit_values(check) for check in checks]))
    return args


def limit_values(check: LimitCheck) -> bytes:
    """One check's part of its request's ``ARGV`` string: its four doubles (32 bytes)."""
    if check.window_ms <= 0 or check.bucket_ms <= 0 or check.limit < 0:
        raise ValueError("limit checks need window_ms > 0, bucket_ms > 0 and limit >= 0")
    return LIMIT_VALUES.pack(
        check.limit, check.window_ms, check.bucket_ms, 1 if check.enforce else 0
    )


def parse_reply(reply: Any, count: int) -> tuple[HitResult, int]:
    """Turn the script's flat integer array into a result and the store's time (ms)."""
    if not isinstance(reply, list) or len(reply) != 2 + 3 * count:
        raise ResponseError("unexpected reply from the sliding-window script")
    items: list[Any] = reply  # (compiled: a list's own indexing, not a generic one)
    if count == 1:  # the common cases (a rule; a rule and its ceiling), without a generator
        state = LimitState(bool(items[2]), _int(items[3]), _int(items[4]))
        return HitResult(bool(items[0]), (state,), source="redis"), _int(items[1])
    if count == 2:
        first = LimitState(bool(items[2]), _int(items[3]), _int(items[4]))
        second = LimitState(bool(items[5]), _int(items[6]), _int(items[7]))
        return HitResult(bool(items[0]), (first, second), source="redis"), _int(items[1])
    states = tuple(
        LimitState(bool(items[2 + 3 * i]), _int(items[3 + 3 * i]), _int(items[4 + 3 * i]))
        for i in range(count)
    )
    return HitResult(bool(items[0]), states, source="redis"), _int(items[1])


def _int(value: Any) -> int:
    """``int(value)``: a RESP integer as it is (compiled, ``int()`` of an object is a
    call of the type, ~300 instructions; five a request), anything else converted."""
    if type(value) is int:  # (exactly: a bool is converted, as int() converts it)
        return value
    return int(value)


def _fill(
    batch: Sequence[Sequence[LimitCheck]],
    todo: Sequence[int],
    replies: Sequence[Any],
    results: list[HitResult | Exception],
    redirected: list[int] | None = None,
) -> list[int]:
    """Each call's reply (``replies[k]`` for ``batch[todo[k]]``) as its result, in place;
    an error reply is that call's exception. Returns the entries whose script the server
    did not know (NOSCRIPT), left for the caller to send again; the redirected ones
    (``redirection``) are added to ``redirected`` when given."""
    missing: list[int] = []
    for k, index in enumerate(todo):
        reply = replies[k]
        if isinstance(reply, ResponseError):
            reply = reply_error(reply)
        if isinstance(reply, NoScriptError):
            missing.append(index)
        elif isinstance(reply, Exception):
            results[index] = reply
            if redirected is not None and redirection(reply):
                redirected.append(index)
        else:
            try:
                results[index] = parse_reply(reply, len(batch[index]))[0]
            except ResponseError as exc:
                results[index] = exc
    return missing


class _Wire:
    """One limit check as the script takes it, packed once per check object (the
    limiter hands the same object for an identity seen again): its key as a RESP bulk
    string, its ``ARGV`` doubles, and on a cluster its key's slot; ``alone``: the call of
    a request with this check only (a rule of one limit without a ceiling; on a cluster,
    where a rule and its ceiling are two calls, each of one limit), made once."""

    __slots__ = ("alone", "check", "key", "slot", "values")

    def __init__(self, check: LimitCheck, cluster: bool) -> None:
        raw = check.key.encode()  # a key that cannot be encoded raises ValueError here
        self.check = check
        self.key = b"$%d\r\n%s\r\n" % (len(raw), raw)
        self.values = limit_values(check)
        self.slot = key_slot(raw) if cluster else 0
        self.alone: _Call | None = None


class _Call:
    """One request's EVALSHA, assembled from its checks' packed forms (``_Wire``).

    Packed per check, not per request: a request's checks are its rule's and its
    ceiling's, and the pairs of identity and client address are far more than the ones
    of either alone (the bench's 10,000 keys over 50 addresses made nearly every request
    a new pair, and packing its call again cost ~29,000 instructions a request:
    benchmarks/README.md, "ninth step"); a pair is joined from its two packed checks,
    and kept while the limiter hands the same list. ``parts``: its keys and its one
    ``ARGV`` string as RESP bulk strings, for a call that carries several
    requests (``batched``); ``slot``: on a cluster, the slot of its keys (one hash tag)."""

    __slots__ = ("_args", "_parts", "checks", "packed", "slot")

    def __init__(self, checks: Sequence[LimitCheck], wires: Sequence[_Wire]) -> None:
        self.checks = checks
        self.packed: bytes | None = None
        self._args: list[str | int | bytes] | None = None
        self.slot = wires[0].slot  # its keys' Redis Cluster slot (0 on a single server)
        count = len(wires)
        if count == 1:
            keys, values = wires[0].key, wires[0].values
        elif count == 2:  # a rule and its ceiling: the common pair
            keys = wires[0].key + wires[1].key
            values = wires[0].values + wires[1].values
        else:
            keys = b"".join([wire.key for wire in wires])
            values = b"".join([wire.values for wire in wires])
        head = ARGV_HEADS[count] if count < len(ARGV_HEADS) else b"$%d\r\n" % len(values)
        self._parts = (keys, head + values + b"\r\n")

    @property
    def args(self) -> list[str | int | bytes]:
        """Its ``EVALSHA`` arguments after the SHA (the ways through redis-py), once."""
        args = self._args
        if args is None:
            args = self._args = script_args(self.checks)
        return args

    def parts(self) -> tuple[bytes, bytes]:
        """Its keys' and its ``ARGV`` string's bulk strings."""
        return self._parts

    def evalsha(self, sha: str) -> bytes:
        """Its own ``EVALSHA`` (a request alone in its script call), packed once."""
        packed = self.packed
        if packed is None:
            count = len(self.checks)
            keys, values = self._parts
            packed = self.packed = _evalsha_head(sha.encode(), count, 3 + count) + keys + values
        return packed


def batched(sha: bytes, calls: Sequence[_Call]) -> bytes:
    """One EVALSHA carrying several requests' calls, in order (the script decides each as
    if it came alone, after the ones before it)."""
    parts = [call.parts() for call in calls]
    key_count = 0
    for call in calls:
        key_count += len(call.checks)
    arg_count = len(calls)  # each request: its limits, one string
    return b"".join(
        [
            _evalsha_head(sha, key_count, 2 + key_count + arg_count),
            *[keys for keys, _ in parts],
            *[argv for _, argv in parts],
        ]
    )


def cross_batched(sha: bytes, calls: Sequence[_Call]) -> bytes:
    """``batched`` in the script's cross-slot form (``cross_slot_text``): requests of
    several slots of one cluster master. The first request's keys are the call's
    declared keys; the others' follow the limits in ``ARGV``."""
    parts = [call.parts() for call in calls]
    declared = len(calls[0].checks)
    rest = 0
    for call in calls[1:]:
        rest += len(call.checks)
    count_text = b"%d" % len(calls)
    return b"".join(
        [
            _evalsha_head(sha, declared, 2 + declared + 1 + len(calls) + rest),
            parts[0][0],
            b"$%d\r\n%s\r\n" % (len(count_text), count_text),
            *[argv for _, argv in parts],
            *[keys for keys, _ in parts[1:]],
        ]
    )


def _evalsha_head(sha: bytes, key_count: int, args: int) -> bytes:
    """An EVALSHA's array header, its name, the SHA and the key count (``args``: the
    arguments after the command's name)."""
    count_text = b"%d" % key_count
    return b"*%d\r\n$7\r\nEVALSHA\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
        1 + args,
        len(sha),
        sha,
        len(count_text),
        count_text,
    )


def _by_slot(todo: list[int], calls: list[_Call]) -> tuple[list[int], list[_Call]]:
    """The calls (and their requests' places, ``todo``) grouped by slot, each group in
    the order of its first request and in order within it."""
    runs: dict[int, list[int]] = {}
    for k, call in enumerate(calls):
        run = runs.get(call.slot)
        if run is None:
            runs[call.slot] = [k]
        else:
            run.append(k)
    if len(runs) == 1 or len(runs) == len(calls):
        return todo, calls  # one slot, or each call its own: already in order
    order = [k for run in runs.values() for k in run]
    return [todo[k] for k in order], [calls[k] for k in order]


def _check_sha(sha: Any, expected: str) -> None:
    if isinstance(sha, bytes):
        sha = sha.decode("ascii")
    if sha != expected:
        raise ResponseError("the server computed another SHA for the script")


def _failed_whole(reply: Any) -> bool:
    """Whether a cross-slot call's error reply is one given before anything was written
    (``NOT_SERVED_HERE``): its requests can go again, each on its own. Any other error
    (a write that failed part way, in theory) is every request's answer, as for a call
    of one slot; ``NOSCRIPT`` is loaded and sent again as for any call."""
    if not isinstance(reply, ResponseError):
        return False
    text = str(reply)
    return text.startswith(REDIRECTIONS) or any(sign in text for sign in NOT_SERVED_HERE)


def _refuses_cross_slot(reply: Any) -> bool:
    """Whether a server ran the cross-slot form without its flag (its keys then had to
    share one slot): the form is of no use on it."""
    return isinstance(reply, ResponseError) and CROSS_SLOT_REFUSED in str(reply)


def split_reply(reply: Any, calls: Sequence[_Call]) -> list[Any]:
    """The reply of a ``batched`` call, cut into each request's own (as a call of its
    own would have answered); an error reply, or a reply of the wrong length, is every
    request's."""
    if isinstance(reply, Exception):
        return [reply] * len(calls)
    if not isinstance(reply, list):
        return [ResponseError("unexpected reply from the sliding-window script")] * len(calls)
    parts: list[Any] = []
    offset = 0
    for call in calls:
        end = offset + 2 + 3 * len(call.checks)
        parts.append(reply[offset:end])
        offset = end
    if offset != len(reply):
        return [ResponseError("unexpected reply from the sliding-window script")] * len(calls)
    return parts


class RedisBackend:
    """A ``CounterBackend`` on one client: the lean ``RespClient`` (a standalone server,
    or one master of a cluster) or a redis-py asyncio client (Sentinel; a cluster's calls
    sent before its slot map is known).

    ``hit_many`` sends several requests' checks in one pipeline (one round trip per
    node); ``CoalescingBackend`` uses it to batch concurrent requests. ``cluster``: the
    keys of one request must share a hash tag (a master takes the requests of several
    slots in one call, in the script's cross-slot form); ``redirect`` follows the calls
    a cluster master redirected (without it they fail with the master's error reply).
    """

    def __init__(
        self,
        client: RedisClient | RespClient,
        *,
        name: str,
        close_client: bool = True,
        cluster: bool = False,
        redirect: Redirect | None = None,
    ) -> None:
        self._client = client
        self._wire = client if isinstance(client, RespClient) else None
        self._name = name
        # False when several backends share one client (redis-py's cluster client); the
        # owner closes it.
        self._close_client = close_client
        # redis-py's cluster client routes each call itself (and follows redirections)
        self._redis_cluster = isinstance(client, RedisCluster)
        self._cluster = cluster or self._redis_cluster
        self._redirect = redirect
        self._sha = script_sha()
        # A lean cluster master's calls carry requests of several slots (the script's
        # cross-slot form) until the server refuses that form (before Redis 7.0).
        self._cross_slot = self._cluster and self._wire is not None
        self._cross_sha_bytes = cross_slot_sha().encode()
        self._wires: dict[str, _Wire] = {}  # a check's key -> its packed form
        self._calls: dict[str, _Call] = {}  # a call's first key -> its last call of several
        self._tasks: set[asyncio.Task[None]] = set()  # the rare awaited follow-ups of send_many
        # Round trips started (single calls, pipelines, script loads); for benchmarks.
        self.round_trips = 0
        # Script calls sent in the cross-slot form, and those that failed as a whole
        # (their requests sent again on their own); for tests and benchmarks.
        self.cross_slot_calls = 0
        self.cross_slot_failed = 0
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
        """Like ``hit``, plus the store's clock (ms since the epoch) at decision time (0
        for a call a cluster master redirected: the master that counted it answered)."""
        if not checks:
            return HitResult(True, (), source="redis"), 0
        call = self._call(checks)
        self.round_trips += 1
        reply = await self._evalsha(call)
        if isinstance(reply, NoScriptError):
            await self.load_script()
            self.round_trips += 1
            reply = await self._evalsha(call)
        if isinstance(reply, Exception):
            redirect = self._redirect
            if redirect is None or not redirection(reply):
                raise reply
            result = (await redirect([checks], [reply]))[0]
            if isinstance(result, Exception):
                raise result
            return result, 0
        return parse_reply(reply, len(checks))

    async def _evalsha(self, call: _Call) -> Any:
        """One EVALSHA: its reply, or its error reply as an exception (returned, not
        raised; over redis-py only ``NOSCRIPT`` is, the others raise). Standalone
        servers take the same lean round trip as a pipeline (``_direct_pipeline``)."""
        if self._redis_cluster:
            cluster: Any = self._client
            try:
                return await cluster.execute_command("EVALSHA", self._sha, *call.args)
            except NoScriptError as exc:
                return exc
        if self._wire is not None:
            return (await self._wire_pipeline(self._wire, [call]))[0]
        return (await self._direct_pipeline([call]))[0]

    async def hit_many(self, batch: Sequence[Sequence[LimitCheck]]) -> list[HitResult | Exception]:
        """Run many independent ``hit`` calls in one pipeline.

        Each entry is a result or the exception for that entry alone (a bad check, a
        script error). Losing the connection raises, since it fails every entry.
        """
        return await self._hit_many(batch, False, True)

    async def hit_redirected(
        self, batch: Sequence[Sequence[LimitCheck]], asking: bool
    ) -> list[HitResult | Exception]:
        """``hit_many`` for calls another cluster master redirected here: ``asking``
        sends each right after ``ASKING`` on the same connection (an ``ASK``
        redirection: the slot is being migrated here). A call redirected once more is
        left as its error reply, for the caller to follow."""
        return await self._hit_many(batch, asking, False)

    async def _hit_many(
        self, batch: Sequence[Sequence[LimitCheck]], asking: bool, follow: bool
    ) -> list[HitResult | Exception]:
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
        replies = await self._pipeline(commands, asking)
        redirected: list[int] = []
        missing = _fill(batch, todo, replies, results, redirected)
        if missing:
            await self.load_script()
            again = await self._pipeline([self._call(batch[index]) for index in missing], asking)
            for index in _fill(batch, missing, again, results, redirected):
                results[index] = NoScriptError("the server lost the script again")
        redirect = self._redirect
        if follow and redirected and redirect is not None:
            followed = await redirect([batch[i] for i in redirected], _errors(results, redirected))
            for index, result in zip(redirected, followed, strict=True):
                results[index] = result
        return results

    def send_many(self, batch: Sequence[Sequence[LimitCheck]], done: BatchSettled) -> bool:
        """``hit_many`` without a coroutine, on the lean connection already open: the
        pipeline is written now and ``done`` gets the results later, from the read that
        completes them. False, and nothing sent, without an open lean connection (then
        ``hit_many``, which connects).

        The rare cases that need to wait for something else go on in a task, with the
        same outcome as ``hit_many``: a script the server lost (``NOSCRIPT``: loaded,
        then those calls sent again), calls a cluster master redirected (followed by
        ``redirect``) and a connection that died under the round trip (sent once more
        on a new connection, as ``hit_many`` retries once).
        """
        wire = self._wire
        if wire is None:
            return False
        results: list[HitResult | Exception] = [HitResult(True, (), source="redis")] * len(batch)
        todo: list[int] = []
        calls: list[_Call] = []
        for index, checks in enumerate(batch):
            if not checks:
                continue
            try:
                call = self._call(checks)  # a key that cannot be encoded fails here, alone
            except ValueError as exc:
                results[index] = exc
                continue
            calls.append(call)
            todo.append(index)
        if not todo:  # nothing to ask the store
            asyncio.get_running_loop().call_soon(done, results)
            return True
        cross = self._cross_slot
        if self._cluster and not cross:
            # A cluster master runs a call's keys of one slot only: the requests are
            # grouped by slot first, in order within each (one client's requests share
            # its identity's slot, so a burst of them is still one call). Requests of
            # different slots share no key, so their order between them is free.
            todo, calls = _by_slot(todo, calls)
        # The requests go MAX_REQUESTS_PER_CALL to a script call, which costs Redis about
        # half as much a request as a call each (benchmarks/script_cost.py); on a
        # cluster master of Redis 7, requests of several slots go in one call too, in the
        # script's cross-slot form (``mixed``).
        # A request alone in its call (its slot's only one, or a quiet moment) goes as
        # its own EVALSHA, packed once per identity, and its reply is its own.
        groups: list[list[_Call]] = []
        mixed: list[bool] = []
        packed: list[bytes] = []
        sha = self._sha
        sha_bytes = sha.encode()
        singles = True  # every call carries one request
        start, count = 0, len(calls)
        while start < count:
            end = min(start + MAX_REQUESTS_PER_CALL, count)
            slot = calls[start].slot
            several = False
            for k in range(start + 1, end):
                if calls[k].slot != slot:
                    if cross:
                        several = True
                    else:
                        end = k
                    break
            group = calls[start:end]
            groups.append(group)
            mixed.append(several)
            if end - start == 1:
                packed.append(group[0].evalsha(sha))
            else:
                singles = False
                if several:
                    self.cross_slot_calls += 1
                    packed.append(cross_batched(self._cross_sha_bytes, group))
                else:
                    packed.append(batched(sha_bytes, group))
            start = end

        def replied(replies: list[Any] | Exception) -> None:
            if isinstance(replies, Exception):
                if isinstance(replies, GivenUpError):
                    done(replies)
                else:
                    self._follow_up(self._again(batch, done))
                return
            apart: list[int] = []
            if not singles:
                each: list[Any] = []
                for group, several, reply in zip(groups, mixed, replies, strict=True):
                    if len(group) == 1:
                        each.append(reply)
                        continue
                    if several and _failed_whole(reply):
                        # Nothing was counted (a key of a slot this master no longer
                        # serves, the first request's slot redirected, ...): each of its
                        # requests goes again on its own, and follows its own
                        # redirection.
                        self.cross_slot_failed += 1
                        apart.extend(todo[len(each) + k] for k in range(len(group)))
                        if _refuses_cross_slot(reply):
                            self._no_cross_slot(reply)
                    each.extend(split_reply(reply, group))
                replies = each
            redirected: list[int] | None = [] if self._redirect is not None else None
            missing = _fill(batch, todo, replies, results, redirected)
            if apart and redirected:
                again = set(apart)
                redirected = [index for index in redirected if index not in again]
            if missing or redirected or apart:
                self._follow_up(
                    self._complete(batch, missing, redirected or [], results, done, apart)
                )
                return
            done(results)

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

    async def _complete(
        self,
        batch: Sequence[Sequence[LimitCheck]],
        missing: list[int],
        redirected: list[int],
        results: list[HitResult | Exception],
        done: BatchSettled,
        apart: Sequence[int] = (),
    ) -> None:
        """The rest of a round trip ``send_many`` wrote: the calls whose script the
        server lost (loaded, then sent again), the calls a cluster master redirected
        (followed) and the requests of a cross-slot call that failed as a whole
        (``apart``: each sent again on its own, its redirections followed)."""
        outcome: list[HitResult | Exception] | Exception = results
        try:
            if apart:
                again = await self._hit_many([batch[i] for i in apart], False, True)
                for index, result in zip(apart, again, strict=True):
                    results[index] = result
            if missing:
                await self.load_script()
                again = await self._hit_many([batch[i] for i in missing], False, False)
                for index, result in zip(missing, again, strict=True):
                    results[index] = result
                    if redirection(result):
                        redirected.append(index)
            redirect = self._redirect
            if redirected and redirect is not None:
                followed = await redirect(
                    [batch[i] for i in redirected], _errors(results, redirected)
                )
                for index, result in zip(redirected, followed, strict=True):
                    results[index] = result
        except Exception as exc:
            outcome = exc
        done(outcome)

    async def _pipeline(self, commands: Sequence[_Call], asking: bool = False) -> list[Any]:
        self.round_trips += 1
        if self._wire is not None:
            return await self._wire_pipeline(self._wire, commands, asking)
        if asking:
            raise ValueError("ASKING needs the lean connection")
        if not self._redis_cluster:
            return await self._direct_pipeline(commands)
        cluster: Any = self._client
        pipe: Any = cluster.pipeline(transaction=False)
        for call in commands:
            pipe.execute_command("EVALSHA", self._sha, *call.args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        return replies

    async def _wire_pipeline(
        self, wire: RespClient, commands: Sequence[_Call], asking: bool = False
    ) -> list[Any]:
        """The EVALSHA calls in one write on the lean connection; an error reply is that
        call's result alone (``NoScriptError`` for a script the server lost). With
        ``asking`` each goes right after an ``ASKING`` (one write: nothing comes between
        them on the connection), whose replies are dropped."""
        sha = self._sha
        wire_bytes: list[bytes] = []
        for call in commands:
            if asking:
                wire_bytes.append(ASKING)
            wire_bytes.append(call.evalsha(sha))
        replies = await wire.call(b"".join(wire_bytes), len(wire_bytes))
        if asking:
            replies = replies[1::2]
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
            wire.append(call.evalsha(sha))
        await conn.send_packed_command(b"".join(wire))
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await conn.read_response())
            except ResponseError as exc:  # NOSCRIPT, a script error: this call only
                replies.append(exc)
        return replies

    async def load_script(self) -> None:
        """Load the script (on this backend's server; on every primary through redis-py's
        cluster client); normally done on demand. A lean cluster master gets the
        cross-slot form too, unless it refuses it (then its calls keep to one slot)."""
        self.round_trips += 1
        self.script_loads += 1
        sha: Any
        if self._wire is not None:
            sha = await self._wire.command("SCRIPT", "LOAD", script_text())
        else:
            redis: Any = self._client
            sha = await redis.script_load(script_text())
        _check_sha(sha, self._sha)
        if self._cross_slot and self._wire is not None:
            self.round_trips += 1
            try:
                sha = await self._wire.command("SCRIPT", "LOAD", cross_slot_text())
            except ResponseError as exc:
                if not any(sign in str(exc) for sign in NO_SCRIPT_FLAGS):
                    raise
                self._no_cross_slot(exc)  # a server before 7.0: no script flags
                return
            _check_sha(sha, self._cross_sha_bytes.decode())

    def _no_cross_slot(self, why: Exception) -> None:
        """This master's calls keep to one slot each from now on (until a restart)."""
        if self._cross_slot:
            self._cross_slot = False
            log.info(
                "%s: one script call per slot from now on (the server refused the "
                "cross-slot form: %s)",
                self._name,
                why,
            )

    def _call(self, checks: Sequence[LimitCheck]) -> _Call:
        """The call for these checks, from each check's packed form, kept while the
        limiter hands the same check object (a reloaded rule builds new ones, so
        nothing stale is sent). A bad check raises ``ValueError``."""
        if len(checks) == 1:
            wire = self._packed_check(checks[0])
            alone = wire.alone
            if alone is None:
                alone = wire.alone = _Call([wire.check], [wire])
            return alone
        # Several checks (a rule and its ceiling): kept per identity while the limiter
        # hands the same list (it keeps an identity's last pair), replaced by the next.
        calls = self._calls
        first = checks[0].key
        found = calls.get(first)
        if found is not None and found.checks is checks:
            return found
        wires = [self._packed_check(check) for check in checks]
        if self._cluster:
            slot = wires[0].slot
            for wire in wires:
                if wire.slot != slot:
                    raise ValueError("the keys of one call must share a Redis Cluster hash tag")
        call = _Call(checks, wires)
        if len(calls) >= MAX_CACHED_CHECKS:
            calls.clear()
        calls[first] = call
        return call

    def _packed_check(self, check: LimitCheck) -> _Wire:
        """The check's packed form: kept while the limiter hands the same check object
        (a reloaded rule builds new ones, so nothing stale is sent)."""
        wires = self._wires
        wire = wires.get(check.key)
        if wire is None or wire.check is not check:
            wire = _Wire(check, self._cluster)
            if len(wires) >= MAX_CACHED_CHECKS:
                wires.clear()
            wires[check.key] = wire
        return wire

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
