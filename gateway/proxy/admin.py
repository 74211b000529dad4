"""The admin application (its own port): Prometheus metrics, a liveness probe (``/ok``),
a readiness probe (``/ready``, gateway/proxy/readiness.py), the operator's ``/info``
(counter store addresses, rule files, upstreams, the last reload error), which the public
port does not show, and the operator console (``/console``).

Host check (a defence against DNS rebinding, hardening issue finding 8). A page in the
operator's browser can point its own name at 127.0.0.1 (or at the admin port's private
address) and then read, from its own origin, whatever the admin port answers. The
browser sends that page's name as ``Host``, and no page can make it send an address, so:

* Without ``admin_token``: everything but ``/metrics``, ``/ok`` and ``/ready`` (scrapers
  and probes reach those by any name) answers only a ``Host`` that names this port: ``localhost``
  and ``*.localhost`` (RFC 6761 reserves them for loopback, browsers resolve them
  without DNS, and nobody can register one), a loopback address (127.0.0.0/8, ``[::1]``,
  ``[::ffff:127.x.y.z]``), ``admin_host`` itself, the address the connection arrived at,
  or a name or address in ``admin_allowed_hosts`` (``.example.net`` allows example.net and
  every name under it). Any other well-formed ``Host`` gets ``421 Misdirected Request``;
  a missing, repeated or malformed one ``400`` (RFC 9112 3.2), both with ``{"detail"}``.
* With ``admin_token``: the console keeps its token behaviour and no Host check (a
  rebinding page knows no token, and the session cookie is scoped to the admin port's
  own name and SameSite=Strict, so such a page never holds it); ``/info``, which the
  token never guarded, answers an allowed ``Host`` as above, or any ``Host`` with
  ``Authorization: Bearer <admin_token>``.

``Host`` is read as RFC 9110 says: one field line, SP and HTAB trimmed, ASCII
case-insensitive, the port (if any) ignored, an IPv6 address in brackets, one trailing
dot of a name ignored.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gateway.proxy.console import ConsoleSource, add_console
from gateway.proxy.readiness import Readiness

log = logging.getLogger(__name__)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Host = str | Address  # a name (lower case, no trailing dot) or an address

OPEN_PATHS = frozenset({"/metrics", "/ok", "/ready"})  # scrapers and probes, any Host
# RFC 3986 reg-name: unreserved, sub-delims and percent-encoded octets.
_REG_NAME = re.compile(r"(?:[a-z0-9\-._~!$&'()*+,;=]|%[0-9a-f]{2})+")
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?")
_DIGITS = frozenset("0123456789")


def _unmapped(address: Address) -> Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def parse_host(value: str) -> Host | None:
    """The host a ``Host`` field value names, or None when the value is not a valid
    ``uri-host [ ":" port ]`` (RFC 9110 7.2, RFC 3986 3.2.2)."""
    value = value.strip(" \t")
    if not value.isascii():
        return None
    value = value.lower()
    if value.startswith("["):
        inside, bracket, port = value[1:].partition("]")
        if not bracket or not _port_ok(port):
            return None
        try:
            return _unmapped(ipaddress.IPv6Address(inside))
        except ValueError:
            return None  # IPvFuture, or not an address
    name, colon, port = value.partition(":")
    if colon and not _port_ok(colon + port):
        return None
    if name.endswith(".") and len(name) > 1:
        name = name[:-1]
    if not name or not _REG_NAME.fullmatch(name):
        return None
    try:
        return ipaddress.IPv4Address(name)
    except ValueError:
        return name


def _port_ok(rest: str) -> bool:
    return rest == "" or (rest[0] == ":" and set(rest[1:]) <= _DIGITS)


def is_loopback_host(host: Host) -> bool:
    """``localhost``, a name under ``.localhost``, or a loopback address."""
    if isinstance(host, str):
        labels = host.split(".")
        return labels[-1] == "localhost" and all(_LABEL.fullmatch(x) for x in labels[:-1])
    return _unmapped(host).is_loopback


def _config_host(entry: str) -> Host | None:
    """An ``admin_host`` or ``admin_allowed_hosts`` entry: an address (IPv6 bare or in
    brackets) or a name, a port ignored."""
    entry = entry.strip(" \t")
    try:
        return _unmapped(ipaddress.ip_address(entry))
    except ValueError:
        return parse_host(entry)


@dataclass(frozen=True)
class HostPolicy:
    """Which ``Host`` values name this admin port (see the module docstring)."""

    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.net": example.net and every name under it
    addresses: frozenset[Address]

    @classmethod
    def build(cls, admin_host: str, allowed: Iterable[str]) -> HostPolicy:
        names: set[str] = set()
        suffixes: list[str] = []
        addresses: set[Address] = set()
        entries = [("admin_host", admin_host)] + [("admin_allowed_hosts", a) for a in allowed]
        for setting, entry in entries:
            suffix = entry.strip(" \t").startswith(".")
            host = _config_host(entry.strip(" \t")[1:] if suffix else entry)
            if "*" in entry:
                log.warning(
                    "%s: %r ignored: no wildcards (a leading dot allows a domain and the names "
                    "under it; with admin_token, any Host may sign in)", setting, entry,
                )  # fmt: skip
            elif host is None or (suffix and not isinstance(host, str)):
                log.warning("%s: %r is not a host name or address; ignored", setting, entry)
            elif suffix:
                suffixes.append("." + str(host))
                names.add(str(host))
            elif isinstance(host, str):
                names.add(host)
            else:
                addresses.add(host)
        return cls(frozenset(names), tuple(suffixes), frozenset(addresses))

    def allows(self, host: Host, local: Address | None = None) -> bool:
        if is_loopback_host(host):
            return True
        if isinstance(host, str):
            return host in self.names or host.endswith(self.suffixes)
        return host in self.addresses or host == local


def _local_address(request: web.Request) -> Address | None:
    """The address the connection arrived at (with ``admin_host`` 0.0.0.0 or ::)."""
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    if not isinstance(sockname, tuple) or not sockname or not isinstance(sockname[0], str):
        return None
    try:
        return _unmapped(ipaddress.ip_address(sockname[0].partition("%")[0]))
    except ValueError:
        return None


def _refusal(status: int, detail: str) -> web.Response:
    response = web.json_response({"detail": detail}, status=status)
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _host_guard(
    policy: HostPolicy, admin_host: str, token: str | None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware that applies the Host check (outermost on the admin app)."""
    fix = (
        "add the name to admin_allowed_hosts (GATEWAY_ADMIN_ALLOWED_HOSTS, comma-separated) "
        + ("or send Authorization: Bearer <admin_token>" if token is not None
           else "or configure admin_token (GATEWAY_ADMIN_TOKEN)")
    )  # fmt: skip
    named = (
        f"localhost, a loopback address, admin_host ({admin_host}), the address the request "
        "reached, or a name in admin_allowed_hosts"
    )

    @web.middleware
    async def guard(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        canonical = "" if resource is None else resource.canonical
        if canonical in OPEN_PATHS:
            return await handler(request)
        if token is not None:
            if canonical.startswith("/console"):
                return await handler(request)  # the console's own token check
            bearer = request.headers.get("Authorization", "")
            if bearer.startswith("Bearer ") and hmac.compare_digest(
                bearer[7:].encode(), token.encode()
            ):
                return await handler(request)
        values = request.headers.getall("Host", [])
        host = parse_host(values[0]) if len(values) == 1 else None
        if host is None:
            return _refusal(
                400, "send one Host header: a host name or address, a port optional (RFC 9110 7.2)"
            )
        if not policy.allows(host, _local_address(request)):
            return _refusal(
                421,
                "this admin port answers everything but /metrics, /ok and /ready only to a "
                f"Host header naming its own address ({named}), a defence against DNS "
                f"rebinding; to reach it by another name, {fix}",
            )
        return await handler(request)

    return guard


def create_admin_app(
    registry: CollectorRegistry,
    info: Callable[[], Awaitable[dict[str, object]]] | None = None,
    console: ConsoleSource | None = None,
    *,
    admin_host: str = "127.0.0.1",
    admin_token: str | None = None,
    allowed_hosts: Iterable[str] = (),
    readiness: Callable[[], tuple[int, bytes]] | None = None,
) -> web.Application:
    """``registry``: this process's metrics, or (``--workers``) every worker's.

    The Host check reads ``admin_host``, ``admin_token`` and ``admin_allowed_hosts`` from
    ``console`` when there is one, else from the keyword arguments.

    ``readiness``: ``/ready``'s answer (a gateway process passes the one its public port
    gives). Without it but with ``console`` (the supervisor of ``--workers``, which has no
    request path of its own), ``/ready`` is made from what the console sees: the rule
    table and each region's counter store, checked every second while the app runs.
    With neither, there is no ``/ready``."""
    if console is not None:
        admin_host, admin_token = console.admin_host, console.admin_token
        allowed_hosts = console.admin_allowed_hosts
    policy = HostPolicy.build(admin_host, allowed_hosts)

    async def metrics_handler(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        response = web.Response(body=body)
        response.headers["Content-Type"] = CONTENT_TYPE_LATEST
        return response

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def info_handler(request: web.Request) -> web.Response:
        assert info is not None
        return web.json_response(await info())

    cleanup: list[Callable[[web.Application], AsyncIterator[None]]] = []
    if readiness is None and console is not None:
        checks = _console_readiness(console)
        readiness = checks.answer

        async def run_checks(app: web.Application) -> AsyncIterator[None]:
            checks.start()
            yield
            await checks.stop()

        cleanup.append(run_checks)
    answer_ready = readiness

    async def ready(request: web.Request) -> web.Response:
        assert answer_ready is not None
        status, body = answer_ready()
        response = web.Response(body=body, status=status, content_type="application/json")
        response.headers["Cache-Control"] = "no-store"
        return response

    app = web.Application(middlewares=[_host_guard(policy, admin_host, admin_token)])
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/ok", ok)
    if answer_ready is not None:
        app.router.add_get("/ready", ready)
    app.cleanup_ctx.extend(cleanup)
    if info is not None:
        app.router.add_get("/info", info_handler)
    if console is not None:
        add_console(app, console)
    return app


def _console_readiness(console: ConsoleSource) -> Readiness:
    """Readiness from the console's view: the rule table (and its last reload) and the
    counter stores' health as the console's region list reports it."""

    async def stores() -> dict[str, bool]:
        return {str(r["name"]): r.get("healthy") is True for r in await console.regions()}

    return Readiness(
        rules=console.table, last_reload_error=console.last_reload_error, stores=stores
    )
