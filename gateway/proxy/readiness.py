"""Readiness: whether this instance can do its job now (``GET /ready``).

``/ok`` is liveness: the process answers. ``/ready`` answers ``200`` only when

* a rule table is loaded;
* each region's counter store answers ``PING`` — or every enforced rule and ceiling of the
  current table fails open in that region (its requests are then counted by this process
  alone: ready, but listed under ``degraded``);
* the built-in Store's and control plane's PostgreSQL answers, when they are served from
  this instance (their breaker is closed, and a fresh connection runs ``SELECT 1``); and
  in a ``--workers`` worker, which reaches them over loopback in the supervisor, each of
  them has answered once (the supervisor starts them, migrations included, after the
  workers: until then their requests would wait);
* the instance is not draining (a graceful stop has begun);

and otherwise ``503``. The body names what is not ready::

    {"ready": false,
     "not_ready": [{"check": "counter_store", "region": "eu", "detail": "..."}],
     "degraded": [{"check": "rules", "detail": "..."}]}

The public port answers it too (anyone can read it), so a body never carries an address, a
URL, a password or an error message: only check names, region and service names, rule ids
(which ``RateLimit-Policy`` shows anyway) and exception class names.

``answer()`` is synchronous and does no I/O: the data plane calls it on the request path.
The checks that need the network (a counter store's ``PING``, the database's ``SELECT 1``)
run in background tasks and leave their latest result here; the rest (the table, the
breakers, draining) is read as ``answer()`` runs, so a reload or a graceful stop shows at
once. The answer is cached until one of those inputs changes: a probe hammering ``/ready``
costs one dictionary look-up, not a JSON encoding.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

from gateway.policy.model import Rule, RuleTable
from gateway.ratelimit.ports import CounterBackend

log = logging.getLogger("gateway.readiness")

# Seconds between two rounds of the counter stores' PING (and between two database probes
# while one fails: a recovery shows within about this long).
CHECK_INTERVAL_SECONDS: Final = 1.0
# Seconds between two database probes while it answers. Each probe is one fresh
# connection (the pools are the services' own, not to be borrowed by a health check):
# a connection a second per process would load a database shared by many gateways for
# nothing, and an outage that starts between two probes is usually seen sooner by the
# service's own breaker (read at every answer).
DATABASE_INTERVAL_SECONDS: Final = 5.0
# Bound on one counter store PING, and on one database probe (connect + SELECT 1).
STORE_PROBE_TIMEOUT_SECONDS: Final = 2.0
DATABASE_PROBE_TIMEOUT_SECONDS: Final = 4.0
STARTING: Final = "(starting)"  # ends the detail of a check not done yet
# Fail-closed rule ids named in a counter store's detail (the rest are counted).
NAMED_RULES: Final = 5

Finding = dict[str, str]
StoreProbe = Callable[[], Awaitable[Mapping[str, bool]]]
StartupProbe = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class DatabaseCheck:
    """A built-in service's PostgreSQL, as readiness checks it.

    ``probe`` raises when the database does not answer (one connection and ``SELECT 1``);
    ``breaker_ok`` is the service's own circuit breaker (``True``: closed, serving), read
    at every answer; either may be absent (a ``--workers`` worker has no breaker of its
    own: the services run in the supervisor)."""

    service: str  # "store" or "control-plane", as the built-in upstreams are named
    probe: Callable[[], Awaitable[None]] | None = None
    breaker_ok: Callable[[], bool] | None = None


@dataclass(frozen=True)
class ServiceCheck:
    """A built-in service this process reaches over loopback: not ready until ``probe``
    (an HTTP request to it, ``service_probe``) has succeeded once."""

    service: str  # "store" or "control-plane"
    probe: Callable[[], Awaitable[None]]


def service_probe(url: str, timeout: float = STORE_PROBE_TIMEOUT_SECONDS) -> StartupProbe:
    """One ``HEAD /`` to the service at ``url`` (``http://127.0.0.1:PORT``): any HTTP
    answer means it serves (its socket accepts connections from the start, so only an
    answer tells that the application behind it runs)."""
    host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")

    async def probe() -> None:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(
                    b"HEAD / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % (host.encode())
                )
                line = await reader.readline()
            finally:
                writer.close()
                with suppress(OSError):
                    await writer.wait_closed()
        if not line.startswith(b"HTTP/1."):
            raise ConnectionError("no HTTP answer")

    return probe


def backend_health(
    backends: Mapping[str, CounterBackend], timeout: float = STORE_PROBE_TIMEOUT_SECONDS
) -> StoreProbe:
    """A store probe over the regions' counter backends: each one's ``healthy()`` (a
    ``PING``; always true in memory), all regions at once, each bounded by ``timeout``."""

    async def one(backend: CounterBackend) -> bool:
        try:
            async with asyncio.timeout(timeout):
                return bool(await backend.healthy())
        except Exception:  # an unreachable store is an answer, not an error of the check
            return False

    async def probe() -> Mapping[str, bool]:
        names = list(backends)
        found = await asyncio.gather(*(one(backends[n]) for n in names))
        return dict(zip(names, found, strict=True))

    return probe


def database_probe(url: str, timeout_seconds: float = 2.0) -> Callable[[], Awaitable[None]]:
    """One fresh connection to ``url`` answering ``SELECT 1``, with the services' bounded
    connect and statement timeouts (imported here: psycopg only when PostgreSQL is used)."""
    from gateway.upstreams.postgres.breaker import probe_connection
    from gateway.upstreams.postgres.connection import connection_kwargs

    return probe_connection(url, connection_kwargs(timeout_seconds, "gateway-readiness"))


def fail_closed_rules(table: RuleTable, region: str) -> list[str]:
    """The ids of the enforced rules and ceilings (tiers included) that fail closed in
    ``region``: while its counter store is away, requests they hold answer ``503``.
    Shadow rules never refuse, and unlimited ones are never counted."""
    found: list[str] = []
    for rule in (*table.rules, *table.ceilings):
        variants: tuple[Rule, ...] = (rule, *rule.tiers.values())
        if any(
            not r.fail_open and not r.shadow and not r.unlimited and r.limits_for(region)
            for r in variants
        ):
            found.append(rule.id)
    return found


@dataclass
class _DatabaseState:
    check: DatabaseCheck
    ok: bool | None = None  # the latest probe's verdict (None: not probed yet)
    failure: str = ""  # its exception's class name


class Readiness:
    """The checks' latest results and the answer they make (see the module docstring).

    ``start()`` runs the background checks (on the running loop), ``stop()`` ends them;
    ``drain()`` turns the answer to ``503`` for good (a graceful stop has begun)."""

    def __init__(
        self,
        *,
        rules: Callable[[], RuleTable | None],
        last_reload_error: Callable[[], str | None] | None = None,
        stores: StoreProbe | None = None,
        databases: Sequence[DatabaseCheck] = (),
        services: Sequence[ServiceCheck] = (),
        interval: float = CHECK_INTERVAL_SECONDS,
        database_interval: float = DATABASE_INTERVAL_SECONDS,
    ) -> None:
        if interval <= 0 or database_interval <= 0:
            raise ValueError("readiness intervals must be > 0")
        self._rules = rules
        self._last_reload_error = last_reload_error
        self._store_probe = stores
        # region -> PING answered; None until the first round (then: not ready, "starting").
        self._stores: Mapping[str, bool] | None = None if stores is not None else {}
        self._databases = [_DatabaseState(check) for check in databases]
        # The services that have not answered yet (each leaves once it has).
        self._services_waited = [check.service for check in services]
        self._services = tuple(services)
        self._interval = interval
        self._database_interval = database_interval
        self._draining = False
        self._version = 0  # bumped when a background result changes
        self._tasks: list[asyncio.Task[None]] = []
        self._cache: tuple[tuple[object, ...], tuple[int, bytes]] | None = None
        self._cached_table: RuleTable | None = None  # keeps the cached key's id() unique
        self._logged: tuple[str, ...] | None = None  # the not-ready checks last logged
        # The counter-store regions last logged as not answering (see _note_stores).
        self._stores_down: frozenset[str] = frozenset()

    # -- inputs ----------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    def drain(self, quiet: bool = False) -> None:
        """A graceful stop has begun: ``/ready`` answers ``503`` from now on (called before
        the listener closes, so a load balancer polling it stops sending new work).
        ``quiet``: not logged (a start that failed before it listened)."""
        if not self._draining:
            self._draining = True
            if quiet:
                self._logged = tuple(_label(f) for f in self._findings(*self._inputs())[0])
            else:
                self._note()

    def start(self) -> None:
        """Run the background checks (idempotent)."""
        if self._tasks:
            return
        if self._store_probe is not None:
            self._tasks.append(asyncio.create_task(self._watch_stores(), name="ready-stores"))
        for service in self._services:
            self._tasks.append(
                asyncio.create_task(self._await_service(service), name=f"ready-{service.service}")
            )
        for state in self._databases:
            if state.check.probe is not None:
                self._tasks.append(
                    asyncio.create_task(
                        self._watch_database(state), name=f"ready-db-{state.check.service}"
                    )
                )

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with suppress(asyncio.CancelledError):
                await task

    # -- the background checks ---------------------------------------------------------------

    async def _watch_stores(self) -> None:
        while True:
            await self._check_stores()
            await asyncio.sleep(self._interval)

    async def _check_stores(self) -> None:
        if self._store_probe is None:
            return
        try:
            found = dict(await self._store_probe())
        except Exception as exc:  # a broken probe must not end the checks: count it down
            log.warning("counter store readiness check failed: %s", type(exc).__name__)
            found = dict.fromkeys(self._stores or (), False)
        if found != self._stores:
            self._stores = found
            self._note_stores(found)
            self._changed()

    def _note_stores(self, found: Mapping[str, bool]) -> None:
        """Log each region whose counter store stops (WARNING) or starts again (INFO)
        answering, at start-up included. A store down where rules fail closed is logged
        as not ready (``_note``); where every rule fails open the instance stays ready,
        ``/ready`` only lists it under ``degraded``, and without this line a mistyped
        --redis-url or an outage would go unsaid: each instance silently counting alone."""
        down = frozenset(region for region, answers in found.items() if not answers)
        table = self._rules()
        for region in sorted(down - self._stores_down):
            if table is None or not fail_closed_rules(table, region):
                log.warning(
                    "region %s: the counter store does not answer; every rule there fails "
                    "open, so this process alone counts them until it does (check the "
                    "region's Redis URL and that the server is up)",
                    region,
                )
        for region in sorted(self._stores_down - down):
            log.info("region %s: the counter store answers again", region)
        self._stores_down = down

    async def _await_service(self, check: ServiceCheck) -> None:
        """Until the service answers once (then it is the database check's business)."""
        while True:
            try:
                await check.probe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not yet (refused, closed, no HTTP answer): again
                log.debug("built-in %s: no answer yet (%s)", check.service, type(exc).__name__)
                await asyncio.sleep(self._interval)
            else:
                self._services_waited.remove(check.service)
                self._changed()
                return

    async def _watch_database(self, state: _DatabaseState) -> None:
        while True:
            breaker = state.check.breaker_ok
            # While the service's breaker is open its own prober connects once per retry
            # interval; probing besides it would only double the connections.
            if breaker is None or breaker():
                await self._check_database(state)
            await asyncio.sleep(self._database_interval if state.ok else self._interval)

    async def _check_database(self, state: _DatabaseState) -> None:
        probe = state.check.probe
        assert probe is not None
        try:
            async with asyncio.timeout(DATABASE_PROBE_TIMEOUT_SECONDS):
                await probe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            ok, failure = False, type(exc).__name__
        else:
            ok, failure = True, ""
        if (ok, failure) != (state.ok, state.failure):
            state.ok, state.failure = ok, failure
            self._changed()

    def _changed(self) -> None:
        self._version += 1
        self._note()

    def _note(self) -> None:
        """Log when the verdict changes (not every probe): one line per transition."""
        not_ready, _ = self._findings(*self._inputs())
        failing = tuple(_label(f) for f in not_ready)
        if failing == self._logged:
            return
        if failing:
            # Starting and a graceful stop are planned, not faults: news, not warnings.
            planned = all(
                f["check"] == "draining" or f["detail"].endswith(STARTING) for f in not_ready
            )
            log.log(
                logging.INFO if planned else logging.WARNING, "not ready: %s", "; ".join(failing)
            )
        elif self._logged is not None:
            log.info("ready")
        self._logged = failing

    # -- the answer ------------------------------------------------------------------------------

    def answer(self) -> tuple[int, bytes]:
        """``(200 or 503, JSON body)``, from what is known now; no I/O, no waiting."""
        table, error, breakers = inputs = self._inputs()
        key = (self._version, self._draining, id(table), error, breakers)
        cached = self._cache
        if cached is not None and cached[0] == key and self._cached_table is table:
            return cached[1]
        not_ready, degraded = self._findings(*inputs)
        report = {"ready": not not_ready, "not_ready": not_ready, "degraded": degraded}
        answer = (503 if not_ready else 200, json.dumps(report, separators=(",", ":")).encode())
        self._cache, self._cached_table = (key, answer), table
        return answer

    def _inputs(self) -> tuple[RuleTable | None, str | None, tuple[bool, ...]]:
        """What the answer reads as it is made: the table, the last reload's error, and
        each database's breaker (closed or not)."""
        error = self._last_reload_error() if self._last_reload_error is not None else None
        breakers = tuple(
            s.check.breaker_ok() if s.check.breaker_ok is not None else True
            for s in self._databases
        )
        return self._rules(), error, breakers

    def _findings(
        self, table: RuleTable | None, reload_error: str | None, breakers: tuple[bool, ...]
    ) -> tuple[list[Finding], list[Finding]]:
        """What is not ready and what is degraded."""
        not_ready: list[Finding] = []
        degraded: list[Finding] = []
        if self._draining:
            not_ready.append({
                "check": "draining",
                "detail": "a graceful stop has begun: requests in flight finish, new work "
                "should go elsewhere",
            })  # fmt: skip
        if table is None:
            not_ready.append({"check": "rules", "detail": "no rule table is loaded"})
        elif reload_error is not None:
            degraded.append({
                "check": "rules",
                "detail": "the last reload was refused; the table loaded before stays in "
                "force (the admin port's /info says why)",
            })  # fmt: skip
        self._store_findings(table, not_ready, degraded)
        for service in self._services_waited:
            not_ready.append({
                "check": "service",
                "service": service,
                "detail": f"the built-in {service} has not answered yet {STARTING}",
            })  # fmt: skip
        for state, breaker_ok in zip(self._databases, breakers, strict=True):
            finding = _database_finding(state, breaker_ok)
            if finding is not None:
                not_ready.append(finding)
        return not_ready, degraded

    def _store_findings(
        self, table: RuleTable | None, not_ready: list[Finding], degraded: list[Finding]
    ) -> None:
        stores = self._stores
        if stores is None:
            not_ready.append({"check": "counter_store", "detail": f"not checked yet {STARTING}"})
            return
        for region, answers in stores.items():
            if answers:
                continue
            closed = fail_closed_rules(table, region) if table is not None else []
            if closed:
                named = ", ".join(closed[:NAMED_RULES])
                more = len(closed) - NAMED_RULES
                if more > 0:
                    named += f" and {more} more"
                not_ready.append({
                    "check": "counter_store",
                    "region": region,
                    "detail": f"the counter store does not answer; {len(closed)} "
                    f"fail-closed rule(s) here answer 503 until it does: {named}",
                })  # fmt: skip
            else:
                degraded.append({
                    "check": "counter_store",
                    "region": region,
                    "detail": "the counter store does not answer; every rule here fails "
                    "open, so this process alone counts them until it does",
                })  # fmt: skip


def _database_finding(state: _DatabaseState, breaker_ok: bool) -> Finding | None:
    service = state.check.service
    if not breaker_ok:
        detail = (
            f"the {service}'s PostgreSQL stopped answering (its circuit breaker is open): "
            "its requests answer 503 until a probe reaches it"
        )
    elif state.check.probe is None or state.ok:
        return None
    elif state.ok is None:
        detail = f"not checked yet {STARTING}"
    else:
        detail = f"the {service}'s PostgreSQL does not answer a connection and SELECT 1 " + (
            f"({state.failure})"
        )
    return {"check": "database", "service": service, "detail": detail}


def _label(finding: Finding) -> str:
    where = finding.get("region") or finding.get("service")
    name = finding["check"] if where is None else f"{finding['check']} {where}"
    return f"{name}: {finding['detail']}"
