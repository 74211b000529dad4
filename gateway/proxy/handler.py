"""The gateway's request path: refuse what is malformed, decide, answer or forward."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
import uuid
from dataclasses import dataclass

from aiohttp import web

from gateway import __version__
from gateway.counters.base import CounterBackend, CounterUnavailableError
from gateway.metrics import Metrics
from gateway.policy.matcher import select
from gateway.policy.paths import PathError, normalise_path, split_target
from gateway.proxy.access_log import AccessLogger, AccessRecord
from gateway.proxy.forward import Forwarder, StreamAbortedError, forwarded_for_chain
from gateway.proxy.headers import connection_tokens
from gateway.proxy.reload import RuleSource
from gateway.proxy.responses import json_error, json_response
from gateway.proxy.routing import RegionMap, Router
from gateway.ratelimit.decision import Decision, Outcome
from gateway.ratelimit.identity import (
    ClientAddressPolicy,
    IdentityHasher,
    RequestIdentity,
    valid_identity_header,
)
from gateway.ratelimit.limiter import Limiter

log = logging.getLogger("gateway.proxy")

REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
HEALTH_PATH = "/ok"
INFO_PATH = "/info"


@dataclass
class Gateway:
    """Everything the request path needs, built once by ``gateway.app``."""

    rules: RuleSource
    limiter: Limiter
    backends: dict[str, CounterBackend]
    hasher: IdentityHasher
    addresses: ClientAddressPolicy
    regions: RegionMap
    router: Router
    forwarder: Forwarder
    metrics: Metrics
    access_log: AccessLogger
    max_header_bytes: int = 8190
    max_headers: int = 100

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        self.metrics.inflight.inc()
        record = AccessRecord(
            method=request.method,
            path="-",
            status=0,
            region=self.regions.default,
            client=request.remote or "-",
            request_id=_request_id(request),
        )
        try:
            response = await self._handle(request, record, started)
            if not response.prepared and record.request_id:
                # The gateway's own answers (429, 4xx, /info) carry the id too, so a
                # client can quote it and it can be found in the access log.
                response.headers.setdefault("X-Request-Id", record.request_id)
        except asyncio.CancelledError:
            record.status = record.status or 499  # the client went away
            raise
        finally:
            self.metrics.inflight.dec()
            record.duration_ms = (time.perf_counter() - started) * 1000
            if record.status:
                status_class = f"{record.status // 100}xx"
                self.metrics.child(self.metrics.responses, record.region, status_class).inc()
            self.access_log.emit(record)
        return response

    async def _handle(
        self, request: web.Request, record: AccessRecord, started: float
    ) -> web.StreamResponse:
        method = request.method
        too_big = self._headers_too_large(request)
        if too_big:
            return _done(record, json_error(431, too_big))
        if method in REFUSED_METHODS:
            return _done(record, json_error(405, f"{method} is not accepted by this gateway"))
        raw_path, query = split_target(request.raw_path)
        # Only the raw target is looked at: parsing it (or Host) as a URL can fail.
        if not raw_path.startswith("/") and "://" in raw_path:
            return _done(record, json_error(400, "absolute-form request targets are refused"))
        try:
            path = normalise_path(raw_path)
        except PathError as exc:
            record.path = raw_path[:200]
            return _done(record, json_error(400, str(exc)))
        record.path = path
        if path == HEALTH_PATH and method in ("GET", "HEAD"):
            return _done(record, json_response({"ok": True}))

        region = self.regions.region_for(request.host if "Host" in request.headers else None)
        record.region = region
        peer = request.remote
        client_ip = self.addresses.client_address(peer, forwarded_for_chain(request) or None)
        record.client = client_ip
        try:
            api_key, user_id = identity_headers(request)
        except ValueError as exc:
            return _done(record, json_error(400, str(exc)))
        identity = RequestIdentity(self.hasher, client_ip, api_key, user_id)
        selection = select(self.rules.table, region, method, path, identity.key_for)
        try:
            decision = await self.limiter.decide(region, selection)
        except CounterUnavailableError:
            rule_id = selection.rule.id if selection.rule else "-"
            record.rule, record.decision = rule_id, "unavailable"
            self._count(region, rule_id, selection.rule.identity.value if selection.rule else "-",
                        "unavailable")  # fmt: skip
            detail = (
                f"rate-limit counters for region {region!r} are unavailable and rule "
                f"{rule_id!r} fails closed; retry shortly"
            )
            return _done(record, json_error(503, detail, [("Retry-After", "1")]))
        self._observe(region, decision, record)
        headers = decision.header_fields()
        if decision.outcome is Outcome.LIMITED:
            detail = (
                f"rate limit exceeded for rule {decision.rule_id!r}; "
                f"retry in {decision.retry_after} seconds"
            )
            headers.append(("Retry-After", str(decision.retry_after)))
            self.metrics.child(self.metrics.overhead, region).observe(time.perf_counter() - started)
            return _done(record, json_error(429, detail, headers))

        if path == INFO_PATH and method in ("GET", "HEAD"):
            response = json_response(await self.info())
            for name, value in headers:
                response.headers[name] = value
            return _done(record, response)

        upstream = self.router.route(path)
        if upstream is None:
            return _done(record, json_error(404, f"no upstream serves {path}", headers))
        record.upstream = upstream.name
        if record.request_id:  # the streamed response is prepared before handle() sees it
            headers.append(("X-Request-Id", record.request_id))
        self.metrics.child(self.metrics.overhead, region).observe(time.perf_counter() - started)
        trusted_peer = self.addresses.peer_trusted(peer)
        try:
            forwarded, latency = await self.forwarder.forward(
                request, upstream, path, query, headers, trusted_peer, record.request_id
            )
        except StreamAbortedError as exc:
            # The response had started; aiohttp treats a cancelled handler as a dropped
            # connection and stays quiet, which is what both cases are.
            record.status = exc.status
            raise asyncio.CancelledError from exc
        record.upstream_ms = latency * 1000
        return _done(record, forwarded)

    def _headers_too_large(self, request: web.Request) -> str | None:
        headers = request.raw_headers
        if len(headers) > self.max_headers:
            return f"too many request headers (at most {self.max_headers})"
        limit = self.max_header_bytes
        for name, value in headers:
            if len(name) + len(value) > limit:
                shown = name[:64].decode(errors="replace")
                return f"request header {shown!r} is over {limit} bytes"
        return None

    def _observe(self, region: str, decision: Decision, record: AccessRecord) -> None:
        rule = decision.rule_id or "-"
        kind = decision.identity_kind or "-"
        label = decision.outcome.value
        if decision.source == "fallback" and decision.outcome is Outcome.ALLOWED:
            label = "fallback"
        self._count(region, rule, kind, label)
        for shadow_rule, shadow_kind in decision.shadow_exceeded:
            self._count(region, shadow_rule, shadow_kind, "shadow_limited")
            log.info("shadow rule %s would have limited this request", shadow_rule)
        if decision.near_limit:
            self.metrics.child(self.metrics.near_limit, region, rule).inc()
        record.rule = decision.rule_id
        record.decision = label
        if decision.identity_hash:
            record.identity = f"{kind}:{decision.identity_hash[:12]}"

    def _count(self, region: str, rule: str, kind: str, decision: str) -> None:
        self.metrics.child(self.metrics.requests, region, rule, kind, decision).inc()

    async def info(self) -> dict[str, object]:
        table = self.rules.table
        regions = []
        for name, backend in self.backends.items():
            try:
                healthy = await asyncio.wait_for(backend.healthy(), 1.0)
            except (TimeoutError, OSError):
                healthy = False
            regions.append({"name": name, "counter_backend": backend.name, "healthy": healthy})
        return {
            "version": __version__,
            "default_region": self.regions.default,
            "regions": regions,
            "rules": {
                "hash": table.digest,
                "loaded_at": dt.datetime.fromtimestamp(table.loaded_at, dt.UTC).isoformat(),
                "files": list(table.sources),
                "count": len(table.rules),
                "last_reload_error": self.rules.last_error,
            },
            "upstreams": [{"prefix": p, "upstream": u} for p, u in self.router.describe()],
        }


def _done(record: AccessRecord, response: web.StreamResponse) -> web.StreamResponse:
    record.status = response.status
    return response


IDENTITY_HEADERS = ("x-api-key", "x-user-id")


def identity_headers(request: web.Request) -> tuple[str | None, str | None]:
    """The API key and user id that form identities, exactly as the upstream will see them.

    A header named in ``Connection`` is hop-by-hop and never reaches the upstream, so it
    forms no identity either; a repeated identity header is refused (``ValueError``)
    because upstreams disagree about which copy counts.
    """
    dropped = connection_tokens(request.headers)
    values: list[str | None] = []
    for name in IDENTITY_HEADERS:
        found = request.headers.getall(name, ())
        if len(found) > 1:
            raise ValueError(f"send one {name} header, not {len(found)}")
        value = found[0] if found and name not in dropped else None
        values.append(valid_identity_header(value))
    return values[0], values[1]


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id")
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return uuid.uuid4().hex
