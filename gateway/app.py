"""The one place that wires everything together and runs it."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import gc
import json
import logging
import math
import os
import signal
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

from gateway import __version__, logs, native
from gateway.counters.base import CounterBackend
from gateway.counters.factory import parse_counter_url
from gateway.counters.memory import MemoryBackend
from gateway.explain import Reading, ReadRequest, Refused, identity_notes
from gateway.identity.config import parse_identity_config
from gateway.identity.jwt import JwtVerifier
from gateway.identity.keys import KeySource
from gateway.identity.verified import VerifiedIdentities
from gateway.metrics import (
    SYNC_INTERVAL_SECONDS,
    Metrics,
    SharedMetricsWriter,
    write_recent,
)
from gateway.policy.model import RuleTable
from gateway.proxy.access_log import AccessLogger
from gateway.proxy.admin import create_admin_app
from gateway.proxy.console import ConsoleSource, Recent
from gateway.proxy.handler import Gateway
from gateway.proxy.plane import DataPlane, PlaneLimits
from gateway.proxy.readiness import (
    DatabaseCheck,
    Readiness,
    ServiceCheck,
    backend_health,
    database_probe,
    service_probe,
)
from gateway.proxy.reload import RuleSource
from gateway.proxy.request import Incoming
from gateway.proxy.routing import RegionMap, Router
from gateway.proxy.tls import TlsListener, TlsReloader
from gateway.proxy.tunnel import TunnelLimits
from gateway.proxy.upstream_pool import Upstream, UpstreamPool
from gateway.ratelimit.identity import ClientAddressPolicy, IdentityHasher
from gateway.ratelimit.limiter import Limiter
from gateway.secrets import identity_secret
from gateway.settings import Settings, SettingsError, default_exchanges_per_client
from gateway.tls_setup import AdminTls, admin_tls, check_tls, tls_listener
from gateway.urls import display_url

if TYPE_CHECKING:
    from gateway.upstreams.control_plane.config import ControlPlaneConfig
    from gateway.upstreams.http_api.parse_budget import ParseBudget
    from gateway.upstreams.postgres.breaker import DatabaseBreaker
    from gateway.upstreams.store.config import StoreConfig

log = logging.getLogger("gateway")

STORE_PREFIXES = ("/store",)
# Container allocations (net) between young collections; CPython's default is 700.
GC_YOUNG_THRESHOLD = 10_000


def tune_collector() -> None:
    """The cyclic collector as a started gateway runs it (and the instruction benchmark,
    ``benchmarks/dataplane_instructions.py``, measures it)."""
    # What start-up built lives as long as the process: out of the collector's reach,
    # full collections stay short (they otherwise showed in the p99).
    gc.freeze()
    # And fewer collections: the per-identity caches (checks, EVALSHA bytes, deny cache)
    # are long-lived containers each full collection walks again; at the default 700
    # allocations per young collection those came every few seconds under load and set
    # the Redis row's p99 (8.0 -> 3.4 ms; benchmarks/README.md, "Collector").
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


CONTROL_PLANE_PREFIXES = (
    "/v1/integrations",
    "/v2/deployments",
    "/v2/listeners",
    "/v2/auth",
    "/api-host",
)


def configure_logging(settings: Settings) -> None:
    logs.configure_logging(settings.log_level, settings.log_format, settings.access_log_file)


def open_backend(
    settings: Settings, region: str, url: str | None, metrics: Metrics
) -> CounterBackend:
    """The counter backend for one region (memory when no URL is configured)."""
    if url is None or url.startswith("memory:"):
        return MemoryBackend(max_keys=settings.memory_max_keys)
    from gateway.counters.factory import open_counter_backend

    return open_counter_backend(
        url,
        region=region,
        timeout_seconds=settings.redis_timeout_ms / 1000,
        events=metrics.counter_events(region),
        deny_cache=settings.deny_cache,
        memory_max_keys=settings.memory_max_keys,
    )


@dataclass
class Upstreams:
    """Where the proxy sends things: built-in upstream URLs and the configured ones."""

    builtin: dict[str, str] = field(default_factory=dict)  # "store"/"control-plane" -> URL

    def router(self, settings: Settings) -> Router:
        routes: list[tuple[str, Upstream]] = []
        if "store" in self.builtin:
            store = Upstream("store", self.builtin["store"])
            routes += [(p, store) for p in STORE_PREFIXES]
        if "control-plane" in self.builtin:
            cp = Upstream("control-plane", self.builtin["control-plane"])
            routes += [(p, cp) for p in CONTROL_PLANE_PREFIXES]
        for prefix, url in settings.routes:
            upgrade = prefix in settings.upgrade_routes
            routes.append((prefix, Upstream(f"route:{prefix}", url.rstrip("/"), upgrade=upgrade)))
        default = None
        if settings.upstream:
            # The upstream the gateway fronts as a sidecar takes upgrades (WebSocket ...)
            # unless upstream_upgrade is off; the built-in ones never, extra routes when
            # they say upgrade: true.
            default = Upstream(
                "default", settings.upstream.rstrip("/"), upgrade=settings.upstream_upgrade
            )
        return Router(routes, default)


def new_gateway(
    settings: Settings,
    rules: RuleSource,
    backends: dict[str, CounterBackend],
    hasher: IdentityHasher,
    router: Router,
    metrics: Metrics,
) -> Gateway:
    """The request path's decisions as ``settings`` configure them: what ``Proxy.start``
    serves, and what ``gateway rules explain`` reads a described request with
    (``request_reader``)."""
    regions = settings.region_table()
    hosts = {host: r.name for r in regions for host in r.hosts}
    return Gateway(
        rules=rules,
        # Redis Cluster cannot count keys of several hash tags in one script call: there
        # a rule and its ceilings are counted in separate calls.
        limiter=Limiter(
            backends,
            separate_calls=frozenset(
                r.name for r in regions if r.counter_url and "+cluster://" in r.counter_url
            ),
        ),
        backends=backends,
        hasher=hasher,
        addresses=ClientAddressPolicy.parse(settings.trusted_proxies, settings.ipv6_prefix),
        regions=RegionMap(regions[0].name, hosts),
        router=router,
        metrics=metrics,
        access_log=AccessLogger(settings.access_log),
        max_header_bytes=settings.max_header_bytes,
        max_headers=settings.max_headers,
        keep_method_override=settings.keep_method_override,
        rate_limit_headers=settings.rate_limit_headers,
    )


def request_reader(
    settings: Settings,
    table: RuleTable,
    hasher: IdentityHasher,
    verified: VerifiedIdentities | None,
) -> ReadRequest:
    """How the data plane reads a request, for ``gateway rules explain`` and the console's
    explain form: ``Gateway.begin`` (every check and identity up to the choice of a rule)
    on a gateway ``new_gateway`` builds from ``settings``, with ``verified`` as
    ``Proxy.start`` loads them (the console: the running gateway's own). It counts in
    throwaway in-process counters, forwards nothing, starts no task and opens no file:
    its access log is off (``begin`` writes no line anyway; the operator's log file is
    opened by ``configure_logging`` alone, which explain never calls)."""
    settings = dataclasses.replace(settings, access_log="off")
    metrics = Metrics()
    regions = [r.name for r in settings.region_table()]
    backends: dict[str, CounterBackend] = {
        name: MemoryBackend(max_keys=settings.memory_max_keys) for name in regions
    }
    rules = RuleSource((), regions, metrics, table)
    gateway = new_gateway(settings, rules, backends, hasher, Router([], None), metrics)
    gateway.readiness = lambda: (200, b'{"ready": true}')  # (served: answered by the gateway)
    if verified is not None:
        gateway.use_identities(verified)
    key_header = b"x-api-key" if verified is None else verified.key_header

    def read(method: str, target: bytes, headers: list[tuple[bytes, bytes]], peer: str) -> Reading:
        req = Incoming()
        req.method, req.target, req.headers = method, target, headers
        failed = metrics.token_failures.children
        before = {labels: child.value for labels, child in failed.items()}
        answer = gateway.begin(req, gateway.peer(peer))
        if answer is not None:
            if answer.status >= 400:
                raise Refused(answer.status, json.loads(answer.body)["detail"])
            return Reading(req.method, req.path, None, own=answer.status)
        assert req.record is not None and req.record.identities is not None
        names = {name.lower() for name, _ in headers} - req.connection_tokens
        # (the reason the data plane counted a token failure under, for this request)
        failures = [r for (r,), c in failed.items() if c.value > before.get((r,), 0.0)]
        token = (
            verified is not None
            and verified.tokens is not None
            and bool(req.token_header is not None and verified.token_header in names)
        )
        refusal = req.refusal
        notes = identity_notes(
            verified,
            key_sent=key_header in names,
            key_counted=req.api_key is not None,
            consumer=req.consumer,
            consumer_tier=req.tier if req.consumer is not None else None,
            user_dropped=req.drop_user_header and b"x-user-id" in names,
            token_user=req.user_id if token and not failures else None,
            token_tier=req.tier if req.consumer is None else None,
            token_failure=failures[0] if token and failures else None,
            refusal=refusal,
        )
        return Reading(
            req.rule_method or req.method,
            req.path,
            req.record.identities,
            req.tier,
            notes,
            None if refusal is None else (refusal.status, refusal.detail),
            key_header=key_header.decode("latin-1"),
        )

    return read


class Proxy:
    """The proxy port and what it owns: counter backends, the upstream pool, the rule
    watcher, the readiness checks. ``start`` opens them and listens; ``stop`` drains and
    closes them.

    ``databases``: the built-in services' PostgreSQL, for ``/ready`` (none on SQLite, or
    without the built-in upstreams); ``services``: the built-in services another process
    runs (a ``--workers`` worker's), not ready until each has answered."""

    def __init__(
        self,
        settings: Settings,
        upstreams: Upstreams,
        metrics: Metrics,
        rules: RuleSource,
        secret: bytes,
        databases: Sequence[DatabaseCheck] = (),
        services: Sequence[ServiceCheck] = (),
    ) -> None:
        self.settings = settings
        self.upstreams = upstreams
        self.metrics = metrics
        self.rules = rules
        self.secret = secret
        self.databases = tuple(databases)
        self.services = tuple(services)
        self.gateway: Gateway | None = None
        self.readiness: Readiness | None = None
        self.plane: DataPlane | None = None
        self.listening = False
        self.tls: TlsListener | None = None  # HTTPS on the proxy port (tls_cert/tls_key)
        self._tls_watch: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._identity_tasks: list[asyncio.Task[None]] = []
        self._verifier: JwtVerifier | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> list[str]:
        settings = self.settings
        # First: certificate files that cannot be used (SettingsError) stop the start
        # before anything is opened.
        self.tls = tls_listener(settings, self.metrics)
        regions = settings.region_table()
        backends = {
            r.name: open_backend(settings, r.name, r.counter_url, self.metrics) for r in regions
        }
        for backend in backends.values():
            start = getattr(backend, "start", None)
            if start is not None:
                await start()
        self.gateway = new_gateway(
            settings,
            self.rules,
            backends,
            IdentityHasher(self.secret),
            self.upstreams.router(settings),
            self.metrics,
        )
        verified = await self._identities()
        if verified is not None:
            self.gateway.use_identities(verified)
        # ``/ready`` is answered from the first request the port accepts: set before it
        # listens, checked in the background from now on.
        rules = self.rules
        self.readiness = Readiness(
            rules=lambda: rules.table,
            last_reload_error=lambda: rules.last_error,
            stores=backend_health(backends),
            databases=self.databases,
            services=self.services,
        )
        self.gateway.readiness = self.readiness.answer
        self.readiness.start()
        max_connections = connection_cap(settings.max_connections, settings.upstream_pool_size)
        limits = PlaneLimits(
            max_body_bytes=settings.max_body_bytes,
            max_head_bytes=max(64 * 1024, 8 * settings.max_header_bytes),
            header_timeout=settings.header_timeout,
            client_idle_timeout=settings.client_idle_timeout,
            body_read_timeout=settings.body_read_timeout,
            upstream_timeout=settings.upstream_timeout,
            upstream_read_timeout=settings.upstream_read_timeout,
            max_connections=max_connections,
            max_uploads_per_client=settings.max_uploads_per_client,
            max_uploads=max(1, settings.upstream_pool_size // 2),
            max_downloads_per_client=settings.max_downloads_per_client,
            max_exchanges_per_client=settings.max_exchanges_per_client
            or default_exchanges_per_client(settings),
            exchanges_contended=max(1, settings.upstream_pool_size // 2),
            tunnels=TunnelLimits(
                max_tunnels=settings.max_tunnels,
                max_tunnels_per_client=settings.max_tunnels_per_client,
                idle_timeout=settings.tunnel_idle_timeout,
                max_seconds=settings.tunnel_max_seconds,
                max_bytes=settings.tunnel_max_bytes,
            ),
            max_client_connections=settings.max_client_connections or max(1, max_connections // 8),
        )
        pool = UpstreamPool(settings.upstream_pool_size, settings.upstream_connect_timeout)
        self.plane = DataPlane(self.gateway, pool, limits)
        if settings.watch_rules:
            self._watcher = asyncio.create_task(self.rules.watch(settings.watch_interval))
        if self.tls is not None:
            log.info("%s", self.tls.describe())
            self._tls_watch = asyncio.create_task(self.tls.watch())
        addresses = await self.plane.start(host, port, reuse_port, tls=self.tls)
        self.listening = True
        return addresses

    async def info(self) -> dict[str, object]:
        """The operator's view (the admin port's ``/info``)."""
        assert self.gateway is not None
        info = await self.gateway.info(full=True)
        if self.gateway.verified is not None:
            info["identity"] = self.gateway.verified.status()
        if self.tls is not None:
            info["tls"] = self.tls.info()
        return info

    async def _identities(self) -> VerifiedIdentities | None:
        """The config file's ``identity:`` section at work: the key file watched, the
        JWKS fetched and refreshed off the request path. None: identities as claimed."""
        settings = self.settings
        if not settings.identity:
            return None
        base = Path(settings.config_file).parent if settings.config_file else Path.cwd()
        config = parse_identity_config(settings.identity, base)
        keys = None
        if config.api_key.keys is not None:
            keys = KeySource(config.api_key.keys)
            log.info(
                "known API keys: %d in %s, counted per consumer; unknown keys are %s",
                len(keys.ring), config.api_key.keys,
                "refused (401)" if config.api_key.unknown == "reject" else "counted as none",
            )  # fmt: skip
            if settings.watch_rules:
                self._identity_tasks.append(
                    asyncio.create_task(keys.watch(settings.watch_interval))
                )
        verifier = None
        jwt = config.user.jwt
        if jwt is not None:
            verifier = self._verifier = JwtVerifier(jwt)
            if not await verifier.start():
                log.warning(
                    "JWKS %s not fetched yet (%s): tokens fail as no_keys until it is",
                    verifier.source, verifier.last_error,
                )  # fmt: skip
            self._identity_tasks.append(asyncio.create_task(verifier.run()))
            log.info(
                "users from JWTs in %s verified against %s (issuer %s); x-user-id only "
                "from trusted proxies; invalid tokens are %s",
                jwt.header, verifier.source, jwt.issuer,
                "refused (401)" if config.user.invalid == "reject" else "counted as none",
            )  # fmt: skip
        elif config.user.header_from == "trusted":
            log.info("x-user-id is believed only from trusted proxies")
        return VerifiedIdentities(config, keys, verifier)

    @property
    def port(self) -> int:
        assert self.plane is not None
        return self.plane.ports[0]

    def drain(self) -> None:
        """A graceful stop begins: ``/ready`` answers 503 from now on (the listener is
        still open; ``stop`` closes it). Said in the log only once it listened: a start
        that failed (its port taken) is no graceful stop."""
        if self.readiness is not None:
            self.readiness.drain(quiet=not self.listening)

    async def stop(self, grace: float) -> None:
        # Not ready first, before the listener closes and while requests finish.
        self.drain()
        if self.plane is not None:
            await self.plane.stop(grace)
        if self.readiness is not None:
            await self.readiness.stop()
        if self._watcher is not None:
            self._watcher.cancel()
            with suppress(asyncio.CancelledError):
                await self._watcher
        if self._tls_watch is not None:
            self._tls_watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._tls_watch
        if self.tls is not None:
            await self.tls.close()
        for task in self._identity_tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        if self._verifier is not None:
            await self._verifier.close()
        if self.gateway is not None:
            self.gateway.access_log.flush()
            for backend in self.gateway.backends.values():
                await backend.close()


def connection_cap(wanted: int, upstream_pool: int) -> int:
    """``max_connections``, kept below the open-file limit (less the upstream pool and
    some room for files, Redis and the admin port): running out of descriptors would
    fail every connection, legitimate ones included."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - non-POSIX
        return wanted
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(64, soft - upstream_pool - 128)
    if room < wanted:
        log.info(
            "max_connections %d is above what %d open files allow: using %d "
            "(raise the limit with ulimit -n to accept more)",
            wanted,
            soft,
            room,
        )
    return min(wanted, room)


def prepare_rules(settings: Settings, metrics: Metrics) -> RuleSource:
    names = [r.name for r in settings.region_table()]
    return RuleSource.load(settings.rules, names, metrics)


# --- running -------------------------------------------------------------------------------


@dataclass
class Embedded:
    """The built-in upstreams' applications and their listening sockets; ``databases``:
    the PostgreSQL URL of each one that keeps its data there (by app name)."""

    apps: dict[str, web.Application]
    sockets: dict[str, socket.socket]
    notes: list[str]
    databases: dict[str, str] = field(default_factory=dict)
    budget: ParseBudget | None = None  # the body parse budget both apps share

    def register_metrics(self, registry: CollectorRegistry) -> None:
        """The built-in apps' metrics on ``registry``: the admin port's ``/metrics`` of
        the process that runs them (the gateway's, or the supervisor's with --workers)."""
        if self.budget is not None:
            from gateway.upstreams.http_api.parse_metrics import ParseBudgetCollector

            registry.register(cast(Collector, ParseBudgetCollector(self.budget)))

    def urls(self) -> dict[str, str]:
        return {
            name: f"http://127.0.0.1:{sock.getsockname()[1]}" for name, sock in self.sockets.items()
        }


def _embedded_configs(settings: Settings) -> tuple[StoreConfig, ControlPlaneConfig]:
    """The Store's and control plane's configurations (``ValueError`` names a bad key)."""
    from gateway.upstreams.control_plane.config import ControlPlaneConfig
    from gateway.upstreams.store.config import StoreConfig

    data_dir = Path(settings.data_dir)
    store_config = StoreConfig.from_mapping(settings.store, data_dir)
    cp_config = ControlPlaneConfig.from_mapping(settings.control_plane, data_dir, os.environ)
    if settings.database_url is not None:
        store_config = dataclasses.replace(store_config, database_url=settings.database_url)
        cp_config = dataclasses.replace(cp_config, database_url=settings.database_url)
    # The gateway's trusted proxies' X-Forwarded-For hops, which it passes on before its
    # own peer, are believed as it believes them, and IPv6 clients grouped as it groups
    # them: the client the built-in APIs count their parse budget by is the one the
    # gateway resolved (http_api/body_budget.py).
    store_config = dataclasses.replace(
        store_config,
        trusted_proxies=(*store_config.trusted_proxies, *settings.trusted_proxies),
        client_ipv6_prefix=settings.ipv6_prefix,
    )
    return store_config, cp_config


def _database_urls(store: StoreConfig, control_plane: ControlPlaneConfig) -> dict[str, str]:
    urls = {"store": store.database_url, "control-plane": control_plane.database_url}
    return {name: url for name, url in urls.items() if url is not None}


def build_embedded(settings: Settings) -> Embedded:
    """Create the Store and control-plane apps and bind their loopback sockets."""
    from gateway.upstreams.control_plane.app import create_control_plane_app
    from gateway.upstreams.control_plane.config import bootstrap_credentials
    from gateway.upstreams.http_api.parse_budget import ParseBudget
    from gateway.upstreams.store.app import create_store_app

    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    try:
        store_config, cp_config = _embedded_configs(settings)
        cp_config, message = bootstrap_credentials(cp_config)
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    if message:
        notes.append(message)
    # One parse budget for both: they share one event loop (and with it the proxy port).
    budget = ParseBudget(store_config.parse_share())
    apps = {
        "store": create_store_app(store_config, parse_budget=budget),
        "control-plane": create_control_plane_app(
            cp_config,
            parse_budget=budget,
            trusted_proxies=store_config.trusted_proxies,
            ipv6_prefix=store_config.client_ipv6_prefix,
        ),
    }
    # The gateway's own ports are bound after these: an ephemeral port the kernel hands
    # out here must not be one of them, or the gateway fails to start with "address
    # already in use" on a port the operator chose and nothing else holds.
    reserved = {settings.port, settings.admin_port}
    sockets = {name: loopback_listener(reserved) for name in apps}
    return Embedded(apps, sockets, notes, _database_urls(store_config, cp_config), budget)


def loopback_listener(avoid: Container[int]) -> socket.socket:
    """A listening, non-blocking socket on 127.0.0.1 at a kernel-chosen port not in
    ``avoid``. A refused port stays held until the choice is made, so the kernel cannot
    hand it out again meanwhile."""
    refused: list[socket.socket] = []
    try:
        for _ in range(64):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", 0))
            if sock.getsockname()[1] in avoid:
                refused.append(sock)
                continue
            sock.listen(512)
            sock.setblocking(False)
            return sock
        raise OSError("no free loopback port for a built-in upstream")
    finally:
        for sock in refused:
            sock.close()


def _closed(breaker: DatabaseBreaker) -> Callable[[], bool]:
    return lambda: breaker.healthy


def database_checks(
    settings: Settings, embedded: Embedded | None, builtin: Sequence[str]
) -> list[DatabaseCheck]:
    """What ``/ready`` checks of the built-in services' PostgreSQL (SQLite: nothing).

    In the process that runs them (``embedded``), each service's own breaker and a probe
    of its URL; in a ``--workers`` worker, which reaches them over loopback (``builtin``:
    their names), a probe of the URL each uses, read from the same settings."""
    checks: list[DatabaseCheck] = []
    if embedded is not None:
        from gateway.upstreams.postgres.breaker import database_breaker

        for name, app in embedded.apps.items():
            breaker = database_breaker(app)
            url = embedded.databases.get(name)
            if breaker is None or url is None:
                continue
            checks.append(DatabaseCheck(name, database_probe(url), _closed(breaker)))
        return checks
    if not builtin:
        return checks
    try:
        urls = _database_urls(*_embedded_configs(settings))
    except ValueError:  # checked when the supervisor built them: not reached
        return checks
    return [DatabaseCheck(name, database_probe(urls[name])) for name in builtin if name in urls]


class Service:
    """Runs apps on their sites and stops them in order (proxy first, upstreams last)."""

    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.runners: list[web.AppRunner] = []
        self.proxies: list[Proxy] = []

    async def start_proxy(self, proxy: Proxy, host: str, port: int, reuse_port: bool) -> list[str]:
        """Serve the proxy port; proxies stop before every app (upstreams last)."""
        self.proxies.append(proxy)
        return await proxy.start(host, port, reuse_port)

    async def start_socket(
        self,
        app: web.Application,
        sockets: Sequence[socket.socket],
        ssl_context: ssl.SSLContext | None = None,
    ) -> list[str]:
        """Serve ``app`` on sockets already listening (stopped after the proxies, in
        start order); the addresses served, as URLs."""
        # The built-in upstreams' runner answers aiohttp's parser errors as their
        # documented JSON, never echoing request bytes; any other app gets aiohttp's own.
        from gateway.upstreams.http_api.serving import runner_for

        runner = runner_for(app, access_log=None, shutdown_timeout=self.shutdown_timeout)
        await runner.setup()
        self.runners.append(runner)
        for sock in sockets:
            await web.SockSite(
                runner, sock, shutdown_timeout=self.shutdown_timeout, ssl_context=ssl_context
            ).start()
        scheme = "http" if ssl_context is None else "https"
        return [_address(sock.getsockname(), scheme) for sock in sockets]

    def hurry(self) -> None:
        """Stop waiting for requests in flight on the proxy ports (a second signal)."""
        for proxy in self.proxies:
            if proxy.plane is not None:
                proxy.plane.hurry()

    async def stop(self) -> None:
        for proxy in self.proxies:
            await proxy.stop(self.shutdown_timeout)
        self.proxies.clear()
        for runner in self.runners:
            await runner.cleanup()
        self.runners.clear()


def _address(addr: Any, scheme: str = "http") -> str:
    if isinstance(addr, tuple):
        host, port = addr[0], addr[1]
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
    return str(addr)


def wait_for_stop(
    loop: asyncio.AbstractEventLoop,
    on_hup: Callable[[], None] | None,
    hurry: asyncio.Event | None = None,
) -> asyncio.Event:
    """The event SIGTERM or SIGINT sets (a graceful stop). ``hurry``: set by a second one,
    which ends the stop's wait for requests in flight (an operator's second Ctrl-C)."""
    stop = asyncio.Event()

    def signalled() -> None:
        if stop.is_set() and hurry is not None and not hurry.is_set():
            log.warning("second signal: stopping now, without waiting for requests in flight")
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled)
    if on_hup is not None:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    loop.add_signal_handler(signal.SIGUSR1, logs.reopen_access_log)
    return stop


# After a second signal, how long the stop may still take: the proxy ports close their
# connections at once (logging them), the built-in upstreams are cut off after this.
HURRIED_STOP_SECONDS = 1.0
# Named in the error when the admin port cannot be bound.
ADMIN_PORT_WHAT = "the admin port: --admin-host and --admin-port choose it, port 0 a free one"


async def unless_hurried(
    service: Service, hurry: asyncio.Event, cut_after: float = HURRIED_STOP_SECONDS
) -> None:
    """``service.stop()`` (a graceful stop), unless ``hurry`` is set first: then the proxy
    ports stop waiting for requests in flight (``Service.hurry``), and whatever is still
    waited for ``cut_after`` seconds later (a built-in upstream's long poll) is cut off."""
    task = asyncio.ensure_future(service.stop())
    waiter = asyncio.ensure_future(hurry.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            service.hurry()
            await asyncio.wait({task}, timeout=cut_after)
    finally:
        waiter.cancel()
    if not task.done():
        task.cancel()
    with suppress(asyncio.CancelledError):
        await task


def log_startup(settings: Settings, rules: RuleSource, router: Router, worker: str = "") -> None:
    table = rules.table
    log.info("ratelimit-gateway %s%s; %s", __version__, worker, native.describe())
    log.info(
        "rules: %s from %s (table %s)%s",
        table.size_text,
        ", ".join(table.sources),
        table.digest[:12],
        "; watching for changes, SIGHUP reloads" if settings.watch_rules else "; SIGHUP reloads",
    )
    for region in settings.region_table():
        url = region.counter_url
        backend = "in-process memory" if url is None else _counter_shown(url)
        hosts = f" (Host: {', '.join(region.hosts)})" if region.hosts else ""
        default = " [default]" if region.name == settings.region_table()[0].name else ""
        log.info("region %s%s%s: counters in %s", region.name, default, hosts, backend)
    for prefix, name, url in router.describe():
        log.info("route %s -> %s at %s", prefix, name, url)
    if router.default is None:
        log.info("no default upstream: other paths answer 404 (give --upstream URL to proxy them)")
    if settings.trusted_proxies:
        log.info("trusting X-Forwarded-For from %s", ", ".join(settings.trusted_proxies))


def _reload(rules: RuleSource, certificates: Sequence[TlsReloader] = ()) -> None:
    rules.request_reload("SIGHUP")  # parsed in a worker thread, not on the event loop
    for certificate in certificates:  # read in a worker thread too
        certificate.request_reload("SIGHUP")


def _counter_shown(url: str) -> str:
    """A counter URL as its own parser reads it (hosts, database, socket; never the
    credentials), or as ``display_url`` shows it when that parser refuses it."""
    try:
        return parse_counter_url(url).display
    except ValueError:
        return display_url(url)


class ConsoleIdentities:
    """The config's verified identities for a console whose process serves no request
    (the supervisor of ``--workers``; a gateway process's console reads with its data
    plane's own): loaded at the first explained request, the key file read again when it
    changed on disk, a JWKS URL fetched then and again once ``jwks_refresh_seconds`` old
    (its HTTP session closed after each fetch). Nothing runs between requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._verified: VerifiedIdentities | None = None
        self._fetched_at = -math.inf
        self._lock = asyncio.Lock()

    async def current(self) -> VerifiedIdentities | None:
        """``ValueError`` or ``OSError``: the identity files cannot be used."""
        settings = self.settings
        if not settings.identity:
            return None
        async with self._lock:
            verified = self._verified
            if verified is None:
                base = Path(settings.config_file).parent if settings.config_file else Path.cwd()
                config = parse_identity_config(settings.identity, base)
                keys = None if config.api_key.keys is None else KeySource(config.api_key.keys)
                tokens = None if config.user.jwt is None else JwtVerifier(config.user.jwt)
                verified = self._verified = VerifiedIdentities(config, keys, tokens)
            elif verified.keys is not None and verified.keys.changed_on_disk():
                verified.keys.reload("changed, read for the console")
            tokens = verified.tokens
            if tokens is not None and tokens.config.jwks_url is not None:
                now = time.monotonic()
                age = now - self._fetched_at
                if tokens.keys is None or age >= tokens.config.jwks_refresh_seconds:
                    self._fetched_at = now
                    try:
                        await tokens.refresh()  # (never raises: a failure keeps the keys)
                    finally:
                        await tokens.close()
            return verified


def console_source(
    settings: Settings,
    rules: RuleSource,
    regions: Callable[[], Awaitable[list[dict[str, object]]]],
    registry: CollectorRegistry,
    recent: Callable[[], list[Recent]],
    secret: bytes,
    gateway: Gateway | None = None,
) -> ConsoleSource:
    """What the operator console reads, in a gateway process or a supervisor.

    ``gateway``: the process's data plane, whose settings and verified identities the
    explain form reads a described request with (``request_reader``); without one (a
    supervisor of workers), the config's identities are loaded for the form alone
    (``ConsoleIdentities``)."""
    hasher = IdentityHasher(secret)
    loaded = ConsoleIdentities(settings)  # (used without a gateway only)

    async def reader(table: RuleTable) -> ReadRequest:
        # Built for each explained request (the form is rare): the table it is explained
        # with, throwaway counters and caches, nothing kept or started.
        verified = await loaded.current() if gateway is None else gateway.verified
        return request_reader(settings, table, hasher, verified)

    return ConsoleSource(
        table=lambda: rules.table,
        last_reload_error=lambda: rules.last_error,
        regions=regions,
        registry=registry,
        recent=recent,
        hasher=hasher,
        secret_source="this gateway's identity secret",  # noqa: S106 - a description
        reader=reader,
        data_dir=Path(settings.data_dir),
        admin_host=settings.admin_host,
        admin_token=settings.admin_token,
        admin_allowed_hosts=settings.admin_allowed_hosts,
    )


async def _share_metrics(writer: SharedMetricsWriter, sync: Callable[[], None]) -> None:
    """``--workers``: this worker's metrics into the shared directory, every second."""
    while True:
        await asyncio.sleep(SYNC_INTERVAL_SECONDS)
        try:
            sync()
        except OSError as exc:  # a full disk must not stop the worker
            log.warning("cannot write shared metrics: %s", exc)


def _with_store_index(
    info: Callable[[], Awaitable[dict[str, object]]], embedded: Embedded | None
) -> Callable[[], Awaitable[dict[str, object]]]:
    """``info`` plus ``store_index`` (model, fields, re-index progress; never the API key)
    when the built-in Store has an embedding index (issue 12)."""
    from gateway.upstreams.store.app import SEMANTIC_KEY

    semantic = None if embedded is None else embedded.apps["store"].get(SEMANTIC_KEY)
    if semantic is None:
        return info

    async def with_index() -> dict[str, object]:
        answer = await info()
        answer["store_index"] = semantic.describe()
        return answer

    return with_index


def with_admin_tls(
    info: Callable[[], Awaitable[dict[str, object]]], admin: TlsReloader
) -> Callable[[], Awaitable[dict[str, object]]]:
    """``info`` plus ``admin_tls``: the admin port's own certificate (no key material)."""

    async def with_tls() -> dict[str, object]:
        answer = await info()
        answer["admin_tls"] = admin.info()
        return answer

    return with_tls


async def serve(
    settings: Settings,
    worker_index: int | None = None,
    embedded: Embedded | None = None,
    builtin_urls: dict[str, str] | None = None,
    metrics_dir: str | None = None,
) -> None:
    """Run the gateway until SIGTERM/SIGINT, then stop gracefully.

    ``metrics_dir`` (a worker of ``--workers``): no admin port of its own; the worker's
    metrics and recent refusals go to that directory, which the supervisor's admin port
    serves for every worker."""
    metrics = Metrics()
    rules = prepare_rules(settings, metrics)
    # With --workers the supervisor logs each reload once; its workers, the same, quietly.
    rules.announce = worker_index is None
    secret = identity_secret(settings.identity_secret, Path(settings.data_dir))
    service = Service(settings.shutdown_timeout)
    loop = asyncio.get_running_loop()
    certificates: list[TlsReloader] = []  # SIGHUP reloads these too, once started
    hurry = asyncio.Event()
    # A worker of --workers takes no second signal as a hurry: a signal to the process
    # group (a terminal's Ctrl-C, systemd's default KillMode, an init that forwards to the
    # group) reaches it twice, directly and as the supervisor's SIGTERM. The supervisor
    # takes the operator's second signal and kills the workers itself.
    stop = wait_for_stop(
        loop, lambda: _reload(rules, certificates), hurry if worker_index is None else None
    )
    upstreams = Upstreams(dict(builtin_urls or {}))
    admin_port = settings.admin_port
    admin_sockets: list[socket.socket] = []
    sharing: asyncio.Task[None] | None = None
    admin_https: AdminTls | None = None
    admin_watch: asyncio.Task[None] | None = None
    try:
        if embedded is not None:
            for name, app in embedded.apps.items():
                await service.start_socket(app, [embedded.sockets[name]])
            upstreams.builtin.update(embedded.urls())
            embedded.register_metrics(metrics.registry)
            for note in embedded.notes:
                log.warning("%s", note)
        databases = database_checks(settings, embedded, list(builtin_urls or ()))
        # A worker's built-in upstreams run in the supervisor, which starts them after it
        # forked the workers: not ready until each answers.
        services = [ServiceCheck(n, service_probe(u)) for n, u in (builtin_urls or {}).items()]
        proxy = Proxy(settings, upstreams, metrics, rules, secret, databases, services)
        worker = "" if worker_index is None else f" (worker {worker_index})"
        log_startup(settings, rules, upstreams.router(settings), worker)
        for name, url in upstreams.builtin.items():
            log.info("built-in %s listening on %s", name, url)
        # Bound, and its certificate files read, before the data plane listens (see
        # bind_listeners); served once built.
        if metrics_dir is None:
            admin_sockets = bind_listeners(settings.admin_host, admin_port, ADMIN_PORT_WHAT)
            admin_https = admin_tls(settings, metrics)  # SettingsError: files unusable
        # The proxy is stopped first so in-flight requests can still reach the upstreams.
        for address in await service.start_proxy(
            proxy, settings.host, settings.port, reuse_port=worker_index is not None
        ):
            log.info("gateway listening on %s", address)
        if proxy.tls is not None:
            certificates.append(proxy.tls)
        tune_collector()
        gateway = proxy.gateway
        assert gateway is not None
        recent = gateway.access_log.recent_limited
        if metrics_dir is None:

            async def regions() -> list[dict[str, object]]:
                found = (await proxy.info())["regions"]
                assert isinstance(found, list)
                return found

            console = console_source(
                settings, rules, regions, metrics.registry, lambda: list(reversed(recent)),
                secret, gateway,
            )  # fmt: skip
            # Hook (issue 12): the admin /info also shows the Store's embedding index.
            info = _with_store_index(proxy.info, embedded)
            if admin_https is not None:
                log.info("%s", admin_https.describe())
                certificates.append(admin_https)
                admin_watch = asyncio.create_task(admin_https.watch())
                info = with_admin_tls(info, admin_https)
            assert proxy.readiness is not None
            admin = create_admin_app(
                metrics.registry, info, console, readiness=proxy.readiness.answer
            )
            served, admin_sockets = admin_sockets, []  # the runner closes them from here
            for address in await service.start_socket(
                admin, served, ssl_context=None if admin_https is None else admin_https.context
            ):
                log.info("metrics on %s/metrics, console on %s/console", address, address)
        else:
            pid = os.getpid()
            writer = SharedMetricsWriter(metrics, metrics_dir, pid)

            def sync() -> None:
                writer.write()
                write_recent(metrics_dir, pid, list(recent))

            sharing = asyncio.create_task(_share_metrics(writer, sync))
        await stop.wait()
        # Not ready first (both ports' /ready answer 503), then the listener closes.
        proxy.drain()
        log.info("stopping: no new connections, /ready answers 503; waiting up to %.0fs for "
                 "requests in flight", settings.shutdown_timeout)  # fmt: skip
    finally:
        for sock in admin_sockets:  # bound, never served: the start failed in between
            sock.close()
        await unless_hurried(service, hurry)
        if admin_watch is not None:
            admin_watch.cancel()
            with suppress(asyncio.CancelledError):
                await admin_watch
        if admin_https is not None:
            await admin_https.close()
        if sharing is not None:
            sharing.cancel()
            with suppress(asyncio.CancelledError):
                await sharing
            with suppress(OSError):
                sync()  # the last requests' counts, after they finished
                writer.close()
        log.info("stopped")


def check_start(settings: Settings) -> int | None:
    """What ``gateway serve`` checks before it starts either way (``gateway.launch``): the
    exit status when it cannot start, else None. Configures logging."""
    configure_logging(settings)
    shared = all(
        r.counter_url and not r.counter_url.startswith("memory:") for r in settings.region_table()
    )
    if shared and not settings.identity_secret:
        log.warning(
            "counters are shared in Redis but no identity_secret is configured: this instance "
            "uses the one generated in %s/identity-secret. Every instance sharing the counters "
            "must use the same secret (set GATEWAY_IDENTITY_SECRET), or one API key is "
            "counted separately on each instance.",
            settings.data_dir,
        )
    if settings.workers > 1 and not shared:
        log.error(
            "--workers %d needs shared counters: in-process counters would let each worker "
            "admit the full limit. Configure Redis with --redis-url redis://HOST:6379 "
            "(or a 'regions' section with a redis_url per region), or use --workers 1.",
            settings.workers,
        )
        return 2
    return None


def run_one(settings: Settings) -> int:
    """``gateway serve`` as one process: the proxy, the admin port and the built-in
    services in this event loop."""
    embedded = build_embedded(settings) if settings.embedded_enabled else None
    _run_loop(serve(settings, embedded=embedded))
    return 0


def prepare_workers(settings: Settings) -> Embedded | None:
    """Before ``--workers`` processes are forked (``gateway.workers.supervise``): check
    once what can fail at start-up, so a bad rule file or a busy port is one clear
    message, not N crashing workers; the built-in services the supervisor runs."""
    prepare_rules(settings, Metrics())
    check_tls(settings)
    identity_secret(settings.identity_secret, Path(settings.data_dir))
    check_port_free(settings.host, settings.port)
    return build_embedded(settings) if settings.embedded_enabled else None


def bind_listeners(host: str, port: int, what: str, backlog: int = 128) -> list[socket.socket]:
    """Listening, non-blocking sockets on every address ``host`` names (as asyncio's
    ``create_server`` binds them: ``""`` is every interface, an address family this
    machine lacks is skipped), bound now. The admin port is bound this way before the data
    plane listens: a start that cannot have both fails before it answered anything, never
    after a client or a readiness probe was already served. ``what`` names the port in
    the error (``OSError`` with the address and what to do)."""
    shown = f"[{host}]" if ":" in host else host
    sockets: list[socket.socket] = []
    try:
        try:
            infos = socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )
            unusable: OSError | None = None
            for family, kind, proto, _, address in dict.fromkeys(infos):
                try:
                    sock = socket.socket(family, kind, proto)
                except OSError as exc:  # (as asyncio: e.g. IPv6 disabled, and ::1 named)
                    unusable = exc
                    continue
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # as asyncio: one socket per family
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                if port == 0 and len(sockets) > 1:  # port 0: one free port for all
                    address = (address[0], sockets[0].getsockname()[1], *address[2:])
                try:
                    sock.bind(address)
                except OSError as exc:
                    if exc.errno != errno.EADDRNOTAVAIL:
                        raise
                    unusable = exc  # (an address this machine does not have: IPv6 off)
                    sockets.pop().close()
                    continue
                sock.listen(backlog)
                sock.setblocking(False)
            if not sockets:
                raise unusable or OSError(errno.EADDRNOTAVAIL, "no address to listen on")
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise OSError(exc.errno, f"cannot listen on {shown}:{port} ({what}): {reason}") from exc
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def check_port_free(host: str, port: int) -> None:
    """Raise ``OSError`` (with the address) when nothing could listen on host:port."""
    for sock in bind_listeners(host, port, "the port: --host and --port choose it"):
        sock.close()


def _run_loop(main: Any) -> None:
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - platforms without uvloop
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def serve_worker(
    settings: Settings, index: int, builtin_urls: Sequence[tuple[str, str]], metrics_dir: str
) -> None:
    urls = dict(builtin_urls)
    _run_loop(serve(settings, worker_index=index, builtin_urls=urls, metrics_dir=metrics_dir))
