"""The one place a counter URL becomes a backend.

``None`` or ``memory://`` give the in-process backend. Redis URLs give the full stack
``DenyCacheBackend(ResilientBackend(CoalescingBackend(RedisBackend)))``. For a Redis
Cluster the middle of it is built once per master (``PerNodeBackend``,
``gateway/counters/cluster.py``), so a master that is down or hung opens only its own
breaker: keys on the other masters keep being counted in Redis. One server
(``redis://``, ``rediss://``, ``unix://``) and each master of a cluster are reached
over the lean ``RespClient`` (``gateway/counters/resp.py``); Sentinel over redis-py,
whose cluster client also keeps a cluster's slot map. Nothing here connects: both
connect on first use and the script is loaded on the first ``NOSCRIPT``, so the
factory may run before the event loop does.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qsl, unquote

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.maint_notifications import MaintNotificationsConfig

from gateway.counters.base import CounterBackend, CounterEvents, NoEvents
from gateway.counters.cluster import PerNodeBackend
from gateway.counters.cluster import _NodeBreakers as _NodeBreakers  # where tests look
from gateway.counters.coalesce import CoalescingBackend
from gateway.counters.deny_cache import DenyCacheBackend, monotonic_ms
from gateway.counters.memory import MemoryBackend
from gateway.counters.redis_backend import RedisBackend
from gateway.counters.resilient import ResilientBackend
from gateway.counters.resp import RespClient, tls_context

MAX_URL_LENGTH = 2048
MAX_CONNECTIONS = 32
# Bound for connecting (reads are bounded around each whole call, see _connection_kwargs).
SOCKET_TIMEOUT_SECONDS = 1.0
# Pipelines in flight at once per store (each on its own pooled connection). Two let a
# check that arrives just after one was sent leave before it returns (the Redis proxy row:
# ~8.7k -> ~9.9k req/s); the script is atomic per call, so order between them is moot.
MAX_IN_FLIGHT = 2

ACCEPTED_FORMS = (
    "memory://, redis://[[user]:password@]host[:port][/db], rediss://… (TLS), "
    "unix://[[user]:password@]/path/to/socket[?db=N], "
    "redis+cluster://[[user]:password@]host:port[,host:port…] (rediss+cluster:// for TLS), "
    "redis+sentinel://[[user]:password@]host:port[,host:port…]/service-name[/db]; "
    "TLS options for rediss:// and rediss+cluster://: ?ssl_ca_certs=/path/ca.pem (trust "
    "a private CA), ssl_cert_reqs=required|optional|none (default required), "
    "ssl_check_hostname=true|false (default true), ssl_certfile=/path and "
    "ssl_keyfile=/path (a client certificate)"
)
QUERY_KEYS = frozenset(
    {"db", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs", "ssl_check_hostname"}
)
SSL_FILE_KEYS = frozenset({"ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
SSL_CERT_REQS = frozenset({"none", "optional", "required"})
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
SCHEMES = frozenset(
    {"memory", "redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel"}
)


@dataclass(frozen=True)
class CounterUrl:
    """A parsed counter URL; ``display`` is safe to show (no credentials)."""

    scheme: str
    hosts: tuple[tuple[str, int], ...] = ()
    path: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    service: str = ""
    options: tuple[tuple[str, str], ...] = ()

    @property
    def tls(self) -> bool:
        return self.scheme.startswith("rediss")

    @property
    def display(self) -> str:
        if self.scheme == "memory":
            return "memory"
        if self.scheme == "unix":
            return f"unix://{self.path}" + (f"?db={self.db}" if self.db else "")
        hosts = ",".join(_host_port(h, p) for h, p in self.hosts)
        if self.scheme == "redis+sentinel":
            return f"{self.scheme}://{hosts}/{self.service}/{self.db}"
        if self.scheme.endswith("+cluster"):
            return f"{self.scheme}://{hosts}"
        return f"{self.scheme}://{hosts}/{self.db}"


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# Where the rest of a URL may be a password's tail, it is not shown: what to do instead.
_UNENCODED_CREDENTIALS: Final = (
    "a '?' or '#' in the URL's user or password must be percent-encoded (%3F, %23); "
    "the rest of the URL is not shown"
)


def _bad(message: str) -> ValueError:
    return ValueError(f"bad counter URL: {message}; accepted forms: {ACCEPTED_FORMS}")


def _parse_hosts(text: str, *, default_port: int | None) -> tuple[tuple[str, int], ...]:
    hosts: list[tuple[str, int]] = []
    for part in text.split(","):
        part = part.strip()
        if part.startswith("["):
            end = part.find("]")
            if end < 0:
                raise _bad("unclosed '[' in an IPv6 address")
            host, rest = part[1:end], part[end + 1 :]
            if rest and not rest.startswith(":"):
                raise _bad("expected ':port' after an IPv6 address")
            port_text = rest[1:] if rest else ""
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise _bad("a host is missing")
        if port_text:
            if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                raise _bad("a port must be a number from 1 to 65535")
            port = int(port_text)
        elif default_port is not None:
            port = default_port
        else:
            raise _bad("every host needs a port")
        hosts.append((host, port))
    return tuple(hosts)


def _parse_db(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise _bad("the database must be a small non-negative number")
    return int(text)


def _parse_ssl_option(key: str, value: str) -> str:
    """Check one ``ssl_*`` value now: redis-py would only see it on the first connect,
    and a bad one would then look like an outage (fallback) instead of a bad URL."""
    if key in SSL_FILE_KEYS:
        if not value:
            raise _bad(f"{key} needs a file path")
        return value
    lowered = value.lower()
    if key == "ssl_cert_reqs":
        if lowered not in SSL_CERT_REQS:
            raise _bad("ssl_cert_reqs must be required, optional or none")
        return lowered
    # ssl_check_hostname
    if lowered not in TRUE_WORDS | FALSE_WORDS:
        raise _bad("ssl_check_hostname must be true or false")
    return "true" if lowered in TRUE_WORDS else "false"


def parse_counter_url(url: str) -> CounterUrl:
    """Parse and validate a counter URL; ``ValueError`` says what forms are accepted."""
    if len(url) > MAX_URL_LENGTH:
        raise _bad(f"longer than {MAX_URL_LENGTH} characters")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in SCHEMES:
        raise _bad("unknown scheme")
    if scheme == "memory":
        if rest:
            raise _bad("memory:// takes nothing after the scheme")
        return CounterUrl("memory")
    rest, _, fragment = rest.partition("#")
    if fragment:
        if "@" in fragment:  # a '#' inside the password
            raise _bad(_UNENCODED_CREDENTIALS)
        raise _bad("a fragment is not allowed")
    rest, _, query = rest.partition("?")
    options: list[tuple[str, str]] = []
    db = 0
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in QUERY_KEYS:
            if not key.isidentifier():
                # Not an option's name: most likely the tail of a password holding a
                # '?', which must not be shown. Say what to do instead.
                raise _bad(_UNENCODED_CREDENTIALS)
            raise _bad(f"unknown option {key!r} (known: {', '.join(sorted(QUERY_KEYS))})")
        if key == "db":
            db = _parse_db(value)
        else:
            options.append((key, _parse_ssl_option(key, value)))
    if options and not scheme.startswith("rediss"):
        raise _bad("ssl_* options need a rediss:// URL")
    username: str | None = None
    password: str | None = None
    netloc, slash, path = rest.partition("/")
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    if scheme == "unix":
        if netloc:
            raise _bad("unix:// takes a path, e.g. unix:///run/redis.sock")
        if not path:
            raise _bad("unix:// needs the socket's path")
        return CounterUrl(
            scheme, path="/" + unquote(path), db=db, username=username, password=password
        )
    if not netloc:
        raise _bad("a host is missing")
    if scheme in ("redis", "rediss"):
        hosts = _parse_hosts(netloc, default_port=6379)
        if len(hosts) != 1:
            raise _bad(f"{scheme}:// takes one host; use redis+cluster:// for several")
        if path:
            db = _parse_db(path.strip("/"))
        return CounterUrl(
            scheme, hosts, db=db, username=username, password=password, options=tuple(options)
        )
    if scheme.endswith("+cluster"):
        if path.strip("/") or db:
            raise _bad("a cluster has only database 0")
        hosts = _parse_hosts(netloc, default_port=None)
        return CounterUrl(
            scheme, hosts, username=username, password=password, options=tuple(options)
        )
    # redis+sentinel://hosts/service[/db]
    hosts = _parse_hosts(netloc, default_port=26379)
    parts = [p for p in path.split("/") if p] if slash else []
    if not parts or len(parts) > 2:
        raise _bad("redis+sentinel:// needs /service-name[/db] after the hosts")
    if len(parts) == 2:
        db = _parse_db(parts[1])
    return CounterUrl(scheme, hosts, db=db, username=username, password=password, service=parts[0])


def _connection_kwargs(parsed: CounterUrl) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "username": parsed.username,
        "password": parsed.password,
        "socket_connect_timeout": SOCKET_TIMEOUT_SECONDS,
        # No per-read timeout: every call is bounded around its whole round trip (the
        # coalescer's batch timeout, or the resilience wrapper's), and redis-py would
        # otherwise arm a timer for each reply of a pipeline (~3 us per counter check).
        "socket_timeout": None,
        # One retry replaces a pooled connection that died with a restarted server;
        # anything longer is the breaker's business.
        "retry": Retry(NoBackoff(), 1),
    }
    if parsed.tls:
        kwargs["ssl"] = True
        for key, value in parsed.options:
            if key == "ssl_check_hostname":
                kwargs[key] = value == "true"
            elif key in SSL_FILE_KEYS:
                # Checked here, when the backend is built, rather than when the URL is
                # parsed (configuration checks may run where the files are not).
                if not os.path.isfile(value) or not os.access(value, os.R_OK):
                    raise _bad(f"{key}: no readable file at {value}")
                kwargs[key] = value
            else:
                kwargs[key] = value
    return kwargs


def store_client(parsed: CounterUrl) -> RespClient | Redis | RedisCluster:
    """The client the counter path uses: the lean ``RespClient`` for one server
    (``redis://``, ``rediss://``, ``unix://``), redis-py for Sentinel, and for a Cluster
    redis-py's client, which keeps the slot map (each master's calls go over a
    ``RespClient`` of its own: ``node_client``)."""
    if parsed.scheme not in ("redis", "rediss", "unix"):
        return redis_client(parsed)
    host, port = parsed.hosts[0] if parsed.hosts else ("", 0)
    return _resp_client(parsed, host, port, _tls(parsed))


def node_client(parsed: CounterUrl) -> Callable[[str, int], RespClient]:
    """Makes the lean connection to one master of the cluster ``parsed`` names, with
    the URL's credentials, TLS options and timeouts."""
    tls = _tls(parsed)

    def connect(host: str, port: int) -> RespClient:
        return _resp_client(parsed, host, port, tls)

    return connect


def _tls(parsed: CounterUrl) -> ssl.SSLContext | None:
    if not parsed.tls:
        return None
    tls_kwargs = _connection_kwargs(parsed)  # checks the files, as for redis-py
    return tls_context(
        ca_certs=tls_kwargs.get("ssl_ca_certs"),
        certfile=tls_kwargs.get("ssl_certfile"),
        keyfile=tls_kwargs.get("ssl_keyfile"),
        cert_reqs=tls_kwargs.get("ssl_cert_reqs", "required"),
        check_hostname=tls_kwargs.get("ssl_check_hostname", True),
    )


def _resp_client(
    parsed: CounterUrl, host: str, port: int, tls: ssl.SSLContext | None
) -> RespClient:
    return RespClient(
        host=host,
        port=port,
        path=parsed.path if parsed.scheme == "unix" else "",
        tls=tls,
        username=parsed.username,
        password=parsed.password,
        db=parsed.db,
        connect_timeout=SOCKET_TIMEOUT_SECONDS,
    )


def redis_client(parsed: CounterUrl) -> Redis | RedisCluster:
    """A redis-py asyncio client for a parsed Redis URL (connects lazily)."""
    kwargs = _connection_kwargs(parsed)
    # Maintenance notifications are a managed-service handshake: one more command on
    # every new connection that a plain server answers with an error.
    no_notifications = MaintNotificationsConfig(enabled=False)
    if parsed.scheme.endswith("+cluster"):
        # No retry at the cluster level: there redis-py answers a connection error in
        # a pipeline by closing every connection to every node (and sleeping 0.25 s)
        # before the retry, which would break the round trips in flight to the healthy
        # masters. A failed call still marks the slot map for a refresh, and the
        # failed node's free connections are dropped, so the next call starts clean.
        kwargs["retry"] = Retry(NoBackoff(), 0)
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in parsed.hosts],
            max_connections=MAX_CONNECTIONS,
            maint_notifications_config=no_notifications,
            **kwargs,
        )
    if parsed.scheme == "redis+sentinel":
        sentinel_kwargs = {
            "socket_connect_timeout": SOCKET_TIMEOUT_SECONDS,
            "socket_timeout": SOCKET_TIMEOUT_SECONDS,
        }
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(parsed.hosts), sentinel_kwargs=sentinel_kwargs, **kwargs
        )
        master: Redis = sentinel.master_for(parsed.service, db=parsed.db)
        return master
    if parsed.scheme == "unix":
        kwargs.pop("ssl", None)
        pool = BlockingConnectionPool.from_url(
            f"unix://{parsed.path}",
            db=parsed.db,
            max_connections=MAX_CONNECTIONS,
            timeout=SOCKET_TIMEOUT_SECONDS,
            maint_notifications_config=no_notifications,
            **kwargs,
        )
        return Redis.from_pool(pool)
    host, port = parsed.hosts[0]
    pool = BlockingConnectionPool(
        host=host,
        port=port,
        db=parsed.db,
        max_connections=MAX_CONNECTIONS,
        timeout=SOCKET_TIMEOUT_SECONDS,
        connection_class=_ssl_connection_class() if parsed.tls else _plain_connection_class(),
        maint_notifications_config=no_notifications,
        **{k: v for k, v in kwargs.items() if k != "ssl"},
    )
    return Redis.from_pool(pool)


def _plain_connection_class() -> type[Any]:
    from redis.asyncio.connection import Connection

    return _with_hiredis_packing(Connection)


def _ssl_connection_class() -> type[Any]:
    from redis.asyncio.connection import SSLConnection

    return _with_hiredis_packing(SSLConnection)


def _with_hiredis_packing(base: type[Any]) -> type[Any]:
    """``base`` with commands packed by hiredis (C) instead of redis-py's asyncio
    connection's Python packer: packing an EVALSHA was ~40% of a counter check's CPU
    (benchmarks/README.md, "Data plane", the Redis rows)."""
    try:
        from hiredis import pack_command
    except ImportError:  # pragma: no cover - hiredis is a dependency (redis[hiredis])
        return base

    def split(args: tuple[Any, ...]) -> tuple[Any, ...]:
        # redis-py sends multi-word command names ("SCRIPT LOAD") as separate words.
        first = args[0]
        if isinstance(first, str) and " " in first:
            return (*first.split(), *args[1:])
        return args

    class HiredisPacking(base):  # type: ignore[misc]
        def pack_command(self, *args: Any) -> list[bytes]:
            return [pack_command(split(args))]

        def pack_commands(self, commands: Any) -> list[bytes]:
            return [b"".join([pack_command(split(tuple(c))) for c in commands])]

    HiredisPacking.__name__ = base.__name__
    return HiredisPacking


def _memory(clock: Callable[[], int] | None, max_keys: int, label: str) -> MemoryBackend:
    if clock is None:
        return MemoryBackend(max_keys=max_keys, label=label)
    return MemoryBackend(clock=clock, max_keys=max_keys, label=label)


def open_counter_backend(
    url: str | None,
    *,
    region: str,
    timeout_seconds: float = 0.05,
    events: CounterEvents | None = None,
    deny_cache: bool = True,
    clock: Callable[[], int] | None = None,
    breaker_failures: int = 5,
    breaker_reset_seconds: float = 1.0,
    coalesce: bool = True,
    memory_max_keys: int = 1_000_000,
) -> CounterBackend:
    """The counter backend for ``url`` (``None`` means in-process memory).

    ``clock`` (ms) drives the in-process counters, the fallback and the deny cache
    (tests); the Redis script always uses the store's time. ``region`` only labels
    the backend's name: the keys carry the region already. ``memory_max_keys`` caps
    the in-process counters: the memory backend's, or the fallback's while the store
    is unavailable (the ``memory_max_keys`` setting; one cap per region).
    """
    if memory_max_keys < 1:
        raise ValueError("memory_max_keys must be >= 1")
    if url is None or url == "":
        return _memory(clock, memory_max_keys, "memory")
    parsed = parse_counter_url(url)
    if parsed.scheme == "memory":
        return _memory(clock, memory_max_keys, "memory")
    events = events or NoEvents()
    name = f"{parsed.display} (region {region})"
    fallback = _memory(clock, memory_max_keys, "fallback")

    def build(store: RedisBackend, store_events: CounterEvents) -> ResilientBackend:
        inner: CounterBackend = (
            CoalescingBackend(
                store,
                max_in_flight=MAX_IN_FLIGHT,
                batch_timeout_seconds=max(1.0, 4 * timeout_seconds),
                # The store timeout runs on the wire; the wait for a turn is bounded apart.
                call_timeout_seconds=timeout_seconds,
                queue_timeout_seconds=max(1.0, 20 * timeout_seconds),
            )
            if coalesce
            else store
        )
        return ResilientBackend(
            inner,
            timeout_seconds=timeout_seconds,
            failure_threshold=breaker_failures,
            reset_seconds=breaker_reset_seconds,
            fallback=fallback,
            events=store_events,
        )

    client = store_client(parsed)
    resilient: CounterBackend
    if isinstance(client, RedisCluster):
        resilient = PerNodeBackend(
            client, build, name=name, events=events, node_client=node_client(parsed)
        )
    else:
        resilient = build(RedisBackend(client, name=name), events)
    if not deny_cache:
        return resilient
    return DenyCacheBackend(resilient, events=events, clock_ms=clock or monotonic_ms)
