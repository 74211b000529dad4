"""One access-log line per request, plain or JSON. Never a raw key, user id or query.

Besides what happened (rule, decision, status), a line carries every identity component a
rule could use, so ``gateway rules simulate`` can replay it through another table: the
keyed hashes (first 12 hex, as ``identity`` shows them) of the request's ``api_key``,
``user_ip`` and ``ip`` identities (and ``client_cert``, when the TLS port verified a client
certificate), the client address (an IPv6 client as its prefix), the
region, the method, the normalised path, and ``start_us``, when the request began (epoch
microseconds). The hashes are taken from the request's
``RequestIdentity`` when the line is formatted: the ones rule matching computed are
reused, the others come from the connection's memo (HMAC once per connection and key),
and none is computed with the log off.

In the plain format a value is written as it is when it reads back as itself (printable,
no space, not empty, not starting with ``"`` or ``{``; not ``-`` where ``-`` means none),
as every value of an ordinary request does; any other value (a client's ``X-Request-Id``
with spaces, an odd path or method) is written as its JSON string literal, so no value a
client chooses can add a field or a line, and ``gateway.replay.records`` reads it back
exactly. The JSON format quotes every string (ASCII only, control characters escaped).

Lines are formatted with one f-string each and written in batches: ``emit`` appends to a
buffer, and the buffer goes out as ONE record of the ``gateway.access`` logger (its message
is the lines joined by newlines) ``flush_seconds`` (50 ms) after its first line, as soon as
it holds ``max_batch`` lines, or on ``flush()`` (the app calls it when it stops): a logging
call per request was about a tenth of the time spent refusing a flood of requests, and
one per event-loop turn still about 5 % of a proxied request's (a few requests end per
turn; ``benchmarks/README.md``, "Compiled data plane"). Outside an event loop
(command-line tools) every line is written at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from json.encoder import encode_basestring_ascii
from typing import Final

from gateway.policy.model import IdentityKind
from gateway.ratelimit.identity import RequestIdentity

log = logging.getLogger("gateway.access")
# The clock, bound once: a module attribute is a dict lookup on every call.
_time: Final = time.time
_IP: Final = IdentityKind.IP
_API_KEY: Final = IdentityKind.API_KEY
_USER_IP: Final = IdentityKind.USER_IP
_CLIENT_CERT: Final = IdentityKind.CLIENT_CERT

MAX_BATCH: Final = 256
FLUSH_SECONDS: Final = 0.05  # the longest a line waits in the buffer
RECENT_LIMITED: Final = 200  # refusals the operator console lists, newest last


@dataclass(slots=True)
class AccessRecord:
    method: str
    path: str  # the normalised path, without the query string (queries may carry secrets)
    status: int
    region: str
    client: str
    rule: str | None = None
    decision: str | None = None
    identity: str | None = None  # "<kind>:<first 12 hex of the keyed hash>"
    upstream: str | None = None
    duration_ms: float = 0.0  # whole microseconds (3 decimals at most)
    upstream_ms: float | None = None
    request_id: str | None = None
    # When the request ended, UTC with milliseconds ("2026-11-23T13:04:38.037Z"); set by
    # ``AccessLogger.emit``: in a batch only the first line carries the logger's own time.
    time: str | None = None
    # Identity components for replays (see the module's docstring); None when the request
    # was answered before its identity was formed (a 400, /ok). Set by ``emit``.
    key: str | None = None  # the api_key identity's hash, 12 hex
    user: str | None = None  # the user_ip identity's hash (user id with client), 12 hex
    ip: str | None = None  # the ip identity's hash, 12 hex
    # When the request began, epoch microseconds: a replay takes requests in this order,
    # which is the order the gateway began deciding them in. An int: formatting one costs
    # a fraction of a float's.
    start_us: int | None = None
    # A verified identity's consumer (a known key's) and tier, by name: never the key or
    # the token. Names the operator wrote in keys.yaml or an identity provider's tier claim
    # (both kept to a plain alphabet where they are read).
    consumer: str | None = None
    tier: str | None = None
    # The client_cert identity's hash, 12 hex: only with a verified client certificate.
    cert: str | None = None
    # Where ``emit`` takes the hashes from (never written itself).
    identities: RequestIdentity | None = None
    # ``request_id`` is one the gateway made (32 hex digits, never a client's): the plain
    # line writes it without the check a client's needs (never written itself).
    own_request_id: bool = False

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        method: str,
        path: str,
        status: int,
        region: str,
        client: str,
        rule: str | None = None,
        decision: str | None = None,
        identity: str | None = None,
        upstream: str | None = None,
        duration_ms: float = 0.0,
        upstream_ms: float | None = None,
        request_id: str | None = None,
        time: str | None = None,
        key: str | None = None,
        user: str | None = None,
        ip: str | None = None,
        start_us: int | None = None,
        consumer: str | None = None,
        tier: str | None = None,
        cert: str | None = None,
        identities: RequestIdentity | None = None,
        own_request_id: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.region = region
        self.client = client
        self.rule = rule
        self.decision = decision
        self.identity = identity
        self.upstream = upstream
        self.duration_ms = duration_ms
        self.upstream_ms = upstream_ms
        self.request_id = request_id
        self.time = time
        self.key = key
        self.user = user
        self.ip = ip
        self.start_us = start_us
        self.consumer = consumer
        self.tier = tier
        self.cert = cert
        self.identities = identities
        self.own_request_id = own_request_id


_MILLIS: Final = tuple("%03d" % i for i in range(1000))  # noqa: UP031 (see seconds_text)


class _Clock:
    """The last times ``utc_now_ms`` formatted (attributes: compiled code reads a module
    global through a dict, an instance's attribute directly)."""

    def __init__(self) -> None:
        self.second = -1
        self.second_text = ""
        self.milli = -1
        self.milli_text = ""


_CLOCK: Final = _Clock()


def utc_now_ms(now: float | None = None) -> str:
    """The current time (or ``now``, epoch seconds) as ISO 8601 UTC with milliseconds: the
    seconds formatted once per second, the whole text once per millisecond (a flood ends
    dozens of requests in one)."""
    clock = _CLOCK
    milli = int((_time() if now is None else now) * 1000)
    if milli == clock.milli:
        return clock.milli_text
    whole, frac = divmod(milli, 1000)
    if whole != clock.second:
        clock.second = whole
        clock.second_text = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    clock.milli = milli
    text = clock.milli_text = f"{clock.second_text}.{_MILLIS[frac]}Z"
    return text


# The JSON string of a str, quotes included, exactly as json.dumps writes it (ASCII only:
# non-ASCII and control characters as \\u escapes). Implemented in C.
_q: Final = encode_basestring_ascii


# The JSON of the fields that repeat from request to request (method, path, status,
# region, client, rule, decision, upstream) as the two pieces of text around
# ``identity``, kept per combination: a line then costs the quoting of its few
# per-request fields only (about half of ``json_line``; benchmarks/README.md, "Data
# plane"). Bounded: a client scanning paths only empties it now and then.
_HeadKey = tuple[str, str, int, str, str, str | None, str | None, str | None]
_HEADS: Final[dict[_HeadKey, tuple[str, str]]] = {}
MAX_CACHED_HEADS: Final = 4096
# Only lines of paths this short are kept (a method is short; a path need not be): at most
# 4096 x a few hundred bytes per cache, whatever clients send.
MAX_KEPT_PATH: Final = 256


def _head(r: AccessRecord) -> tuple[str, str]:
    if len(r.path) > MAX_KEPT_PATH:  # a long path would be held twice (key and text)
        return _head_text(r)
    key = (r.method, r.path, r.status, r.region, r.client, r.rule, r.decision, r.upstream)
    found = _HEADS.get(key)
    if found is None:
        found = _head_text(r)
        if len(_HEADS) >= MAX_CACHED_HEADS:
            _HEADS.clear()
        _HEADS[key] = found
    return found


def _head_text(r: AccessRecord) -> tuple[str, str]:
    return (
        f'{{"method":{_q(r.method)},"path":{_q(r.path)},"status":{str(r.status)},'
        f'"region":{_q(r.region)},"client":{_q(r.client)},'
        f'"rule":{"null" if r.rule is None else _q(r.rule)},'
        f'"decision":{"null" if r.decision is None else _q(r.decision)},"identity":',
        f',"upstream":{"null" if r.upstream is None else _q(r.upstream)},"duration_ms":',
    )


def json_line(r: AccessRecord) -> str:
    """The record as one JSON object: the fields in declaration order (but
    ``identities``), as ``json.dumps(..., separators=(",", ":"))`` would write them."""
    before_identity, after_identity = _head(r)
    return (
        f"{before_identity}{'null' if r.identity is None else _q(r.identity)}"
        f"{after_identity}{repr(r.duration_ms)},"
        f'"upstream_ms":{"null" if r.upstream_ms is None else repr(r.upstream_ms)},'
        f'"request_id":{"null" if r.request_id is None else _q(r.request_id)},'
        f'"time":{"null" if r.time is None else _q(r.time)},'
        f'"key":{"null" if r.key is None else _q(r.key)},'
        f'"user":{"null" if r.user is None else _q(r.user)},'
        f'"ip":{"null" if r.ip is None else _q(r.ip)},'
        f'"start_us":{"null" if r.start_us is None else str(r.start_us)},'
        f'"consumer":{"null" if r.consumer is None else _q(r.consumer)},'
        f'"tier":{"null" if r.tier is None else _q(r.tier)},'
        f'"cert":{"null" if r.cert is None else _q(r.cert)}}}'
    )


# The plain line's start, up to ``id=``, per (client, method, path, status, region, rule,
# decision): what repeats from request to request, checked (``_bare``) and joined once;
# "" when one of them must be quoted (then ``_quoted_line`` writes the line). Bounded as
# ``_HEADS``.
_PlainKey = tuple[str, str, str, int, str, str | None, str | None]
_PLAIN_HEADS: Final[dict[_PlainKey, str]] = {}
# ``format(ms, ".1f")`` of durations under 100 ms as whole tenths, by tenth: the common
# case looked up instead of formatted (float formatting was about a fifth of a line).
_TENTHS: Final = tuple(f"{i // 10}.{i % 10}" for i in range(1000))


def tenths(ms: float) -> str:
    """``format(ms, ".1f")`` (the same text) for a duration of whole microseconds, as
    ``duration_ms`` and ``upstream_ms`` hold. Only a tie (a microsecond count ending in
    50) depends on the float's binary value, and is formatted as before."""
    if 0.0 < ms < 1e9:  # (not -0.0, which is written "-0.0")
        micros = int(ms * 1000.0 + 0.5)
        whole = micros // 100
        rest = micros - whole * 100
        if rest != 50:
            if rest > 50:
                whole += 1
            if whole < 1000:
                return _TENTHS[whole]
            return f"{whole // 10}.{whole % 10}"
    return format(ms, ".1f")


def _plain_head(r: AccessRecord) -> str:
    if len(r.path) > MAX_KEPT_PATH:  # a long path would be held twice (key and text)
        return _plain_head_text(r)
    key = (r.client, r.method, r.path, r.status, r.region, r.rule, r.decision)
    found = _PLAIN_HEADS.get(key)
    if found is None:
        found = _plain_head_text(r)
        if len(_PLAIN_HEADS) >= MAX_CACHED_HEADS:
            _PLAIN_HEADS.clear()
        _PLAIN_HEADS[key] = found
    return found


def _plain_head_text(r: AccessRecord) -> str:
    # The rule and decision are the gateway's own, always bare; the others are a
    # client's (method, path, address) or the configuration's (region).
    if _bare(r.method) and _bare(r.path) and _bare(r.client) and _bare(r.region):
        return (
            f'{r.client} "{r.method} {r.path}" {str(r.status)} region={r.region} '
            f"rule={r.rule or '-'} decision={r.decision or '-'} id="
        )
    return ""


def plain_line(r: AccessRecord) -> str:
    """The record as one line of text: ``client "METHOD path" status name=value ...``.

    A value is written as it is when it is printable, holds no space, is not empty, does
    not start with ``"`` or ``{`` (and, where ``-`` stands for "none", is not ``-``): every
    value of an ordinary request. Any other value, whoever chose it (a client's request id,
    path or method), is written as its JSON string literal, quotes included (ASCII only,
    control characters escaped): it cannot split the line, add a field or end the request
    part early, and ``gateway.replay.records`` reads it back exactly."""
    head = _plain_head(r)
    rid = r.request_id
    upstream = r.upstream
    # The common case goes on: the values a client or the configuration chooses are
    # bare. The others are the gateway's own and always bare: a rule id
    # (loader.ID_PATTERN), a decision, an identity ("<kind>:<hex>"), the time, the
    # hashes, the numbers.
    if (
        not head
        or (rid is not None and not r.own_request_id and (rid == "-" or not _bare(rid)))
        or (upstream is not None and not _bare_upstream(upstream))
    ):
        return _quoted_line(r)
    upstream_ms = "-" if r.upstream_ms is None else tenths(r.upstream_ms)
    # Optional parts built apart and the line once (each append copied the whole line).
    when = "" if r.time is None else f" time={r.time}"
    ids = (  # the identity components (see the module's docstring)
        ""
        if r.ip is None
        else f" key={r.key or '-'} user={r.user or '-'} ip={r.ip} start_us={str(r.start_us)}"
    )
    verified = (  # verified identities (only then)
        ""
        if r.consumer is None and r.tier is None
        else f" consumer={_optional(r.consumer)} tier={_optional(r.tier)}"
    )
    cert = "" if r.cert is None else f" cert={r.cert}"  # a verified client certificate's
    return (
        f"{head}{r.identity or '-'} upstream={upstream or '-'} dur_ms={tenths(r.duration_ms)} "
        f"upstream_ms={upstream_ms} rid={rid or '-'}{when}{ids}{verified}{cert}"
    )


# Upstream names (from the configuration: a handful) and whether each is bare, as
# ``_bare`` and not ``-`` (checked once, not on every line); bounded all the same.
_BARE_UPSTREAMS: Final[dict[str, bool]] = {}


def _bare_upstream(name: str) -> bool:
    found = _BARE_UPSTREAMS.get(name)
    if found is None:
        found = name != "-" and _bare(name)
        if len(_BARE_UPSTREAMS) >= MAX_CACHED_HEADS:
            _BARE_UPSTREAMS.clear()
        _BARE_UPSTREAMS[name] = found
    return found


def _bare(value: str) -> bool:
    """Whether the value reads back as itself written as it is: printable, no space, not
    empty, not starting with a quote (which marks a quoted value) or a brace (which marks
    a JSON line, where the client address starts the line). ``-`` is checked apart: it
    stands for "none" where a field may have none."""
    if value == "" or " " in value or not value.isprintable():
        return False
    first = value[0]
    return first != '"' and first != "{"


def _field(value: str) -> str:
    """The value as it is when it reads back as itself, else its JSON string literal."""
    return value if value != "-" and _bare(value) else _q(value)


def _optional(value: str | None) -> str:
    """``-`` for none (or empty, as the common case writes it), else ``_field``."""
    return "-" if not value else _field(value)


def _quoted_line(r: AccessRecord) -> str:
    """``plain_line`` for a record with a value that cannot be written as it is: every
    value through ``_field``, in the same order."""
    upstream_ms = "-" if r.upstream_ms is None else tenths(r.upstream_ms)
    rid = r.request_id
    line = (
        f'{_field(r.client)} "{_field(r.method)} {_field(r.path)}" {str(r.status)} '
        f"region={_field(r.region)} rule={_optional(r.rule)} "
        f"decision={_optional(r.decision)} id={_optional(r.identity)} "
        f"upstream={_optional(r.upstream)} dur_ms={tenths(r.duration_ms)} "
        f"upstream_ms={upstream_ms} rid={'-' if rid is None else _field(rid)}"
    )
    if r.time is not None:
        line = f"{line} time={_field(r.time)}"
    if r.ip is not None:
        line = (
            f"{line} key={_optional(r.key)} user={_optional(r.user)} ip={_field(r.ip)} "
            f"start_us={str(r.start_us)}"
        )
    if r.consumer is not None or r.tier is not None:
        line = f"{line} consumer={_optional(r.consumer)} tier={_optional(r.tier)}"
    if r.cert is not None:
        line = f"{line} cert={_field(r.cert)}"
    return line


MAX_REMEMBERED_ADDRESSES: Final = 4096


class AccessLogger:
    """Formats access records (``mode``: ``plain``, ``json`` or ``off``) and writes them
    through the ``gateway.access`` logger in batches."""

    def __init__(
        self, mode: str, max_batch: int = MAX_BATCH, flush_seconds: float = FLUSH_SECONDS
    ) -> None:
        self.mode = mode
        self.max_batch = max_batch
        self.flush_seconds = flush_seconds
        self._json = mode == "json"  # (the two formats called directly: native calls)
        self._lines: list[str] = []
        self._flush_scheduled = False
        # client address -> its ip identity's short hash, for one hasher
        self._ip_hashes: dict[str, str] = {}
        self._hasher: object = None
        # (epoch seconds, region, rule, identity as logged) of the latest refusals, for the
        # operator console; kept whatever the log mode (one append per refusal).
        # With the consumer and tier of a verified identity (names, never a key).
        self.recent_limited: deque[
            tuple[float, str, str | None, str | None, str | None, str | None]
        ] = deque(maxlen=RECENT_LIMITED)

    def emit(self, record: AccessRecord) -> None:
        """Format the record now; write it within ``flush_seconds`` at the latest."""
        now = _time()  # one clock read for the console, the line's time and start_us
        if record.decision == "limited":
            self.recent_limited.append(
                (now, record.region, record.rule, record.identity, record.consumer, record.tier)
            )
        if self.mode == "off":
            return
        lines = self._lines
        # Whether INFO is on, asked at the start of each batch only (a Python call on the
        # logger per line): a batch is written through ``log.info``, which asks again.
        if not lines and not log.isEnabledFor(logging.INFO):
            return
        if record.time is None:
            record.time = utc_now_ms(now)
        ids = record.identities
        if ids is not None:
            if ids.hasher is not self._hasher:
                self._hasher, self._ip_hashes = ids.hasher, {}
            # The api_key and user_ip hashes: the ones rule matching computed are kept by
            # the RequestIdentity, the others come from the connection's memo. No cache
            # keyed by raw API keys here: none is kept past its connection.
            key = None if ids.api_key is None else ids.key_for(_API_KEY)
            user = None if ids.user_id is None else ids.key_for(_USER_IP)
            # The ip hash per client address (not a secret: the line carries the address),
            # so a client sending many keys does not cost an HMAC per line.
            client = ids.client_ip
            ip = self._ip_hashes.get(client)
            if ip is None:
                if len(self._ip_hashes) >= MAX_REMEMBERED_ADDRESSES:
                    self._ip_hashes.clear()
                full = ids.key_for(_IP)
                ip = self._ip_hashes[client] = full[:12] if full else ""
            record.key = key and key[:12]
            record.user = user and user[:12]
            record.ip = ip or None
            if ids.client_cert is not None:  # (the rule matching computed it if it used it)
                cert = ids.key_for(_CLIENT_CERT)
                record.cert = cert and cert[:12]
            record.start_us = int(now * 1e6 - record.duration_ms * 1000)
        lines.append(json_line(record) if self._json else plain_line(record))
        if len(lines) >= self.max_batch:
            self.flush()
        elif not self._flush_scheduled:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop: a command-line tool
                self.flush()
                return
            loop.call_later(self.flush_seconds, self.flush)
            self._flush_scheduled = True

    def flush(self) -> None:
        """Write every buffered line now, as one log record."""
        # A flush still scheduled finds nothing to write; clearing the flag lets the next
        # emit schedule again, even on another loop if this one is gone.
        self._flush_scheduled = False
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        log.info("\n".join(lines))  # no args: a '%' in a line is never interpolated
