"""The operator console: a read-only page on the admin port (never on the public port).

Server-rendered HTML, one small script and one stylesheet served from the package (no
build chain, no external asset, no JS library: the charts are SVG drawn by
``console_static/console.js``), under a strict Content-Security-Policy. For one region at a
time (a selector; ``?region=``), and the rules a text filter leaves (``?rule=``): the loaded
rules in table order, each with a chart of its allowed / limited / shadow-limited rate
over the last ten minutes; the counter stores' health now and over the same window; the
identities limited most in it (hashed, as logged, with their consumer and tier when
known); an explain form (the described request read as the data plane reads it:
``ConsoleSource.reader``); and the last replay report saved with
``gateway rules simulate --save``. The history is sampled server-side into a bounded ring
(``console_history.py``) while the admin application runs.

Access: with no ``admin_token`` configured the console answers only when the admin port
listens on loopback; with one, a browser signs in once through a form (the token goes in
a POST body, never in a URL that lands in logs) and gets an HttpOnly, SameSite=Strict
cookie holding a keyed hash of the token; scripts may send ``Authorization: Bearer``.
``/metrics`` and ``/ok`` stay open for scrapers and probes. Without a token, the admin
application also answers the console only to a ``Host`` naming the admin port (loopback
names and addresses, ``admin_host``, ``admin_allowed_hosts``): see ``admin.py``, a defence
against DNS rebinding.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import html
import ipaddress
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.explain import ReadRequest, explain_request
from gateway.identity.keys import Consumer
from gateway.identity.verified import VerifiedIdentities
from gateway.policy.model import Rule, RuleTable
from gateway.proxy.console_history import (
    BUCKET_SECONDS,
    BUCKETS,
    ConsoleHistory,
    ConsumerNames,
    Totals,
    check_health_forever,
    request_totals,
    sample_forever,
)
from gateway.ratelimit.identity import IdentityHasher
from gateway.replay.saved import load_report

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
COOKIE = "gateway_console"
SAMPLE_SECONDS = 2.0
HISTORY_SECONDS = 300.0
RATE_WINDOWS = (60, 300)  # rates over the last minute and the last five minutes
DECISIONS = ("allowed", "limited", "shadow_limited")
MAX_FILTER_CHARS = 200
NO_CONSUMERS: Mapping[str, Consumer] = MappingProxyType({})
# A refusal the gateway keeps for the console: epoch s, region, rule, identity as logged
# (``<kind>:<12 hex>``), and, when the decision carries them, the consumer's name and
# the tier (never a key).
Recent = (
    tuple[float, str, str | None, str | None]
    | tuple[float, str, str | None, str | None, str | None, str | None]
)


@dataclass
class ConsoleSource:
    """What the console reads, from one gateway process or from a supervisor of workers."""

    table: Callable[[], RuleTable]
    last_reload_error: Callable[[], str | None]
    regions: Callable[[], Awaitable[list[dict[str, object]]]]  # name, counter_backend, healthy
    registry: CollectorRegistry  # the metrics (every worker's, with --workers)
    recent: Callable[[], list[Recent]]
    hasher: IdentityHasher
    secret_source: str
    # The data plane's reading of a request for a loaded table (``Gateway.begin`` on the
    # gateway's settings, ``hasher`` and verified identities: ``gateway.app``'s
    # ``request_reader``), for the explain form.
    reader: Callable[[RuleTable], Awaitable[ReadRequest]]
    data_dir: Path
    admin_host: str
    admin_token: str | None
    # Host values answered without a token besides loopback and admin_host (see admin.py).
    admin_allowed_hosts: tuple[str, ...] = ()
    # The key file's consumers (name -> consumer), to name the consumer behind a limited
    # ``api_key:`` identity; None: no key file, or not wired.
    consumers: Callable[[], Mapping[str, Consumer]] | None = None


def known_consumers(verified: VerifiedIdentities | None) -> Mapping[str, Consumer]:
    """The consumers of the key file a gateway process has loaded (its latest reload), for
    ``ConsoleSource.consumers``; none without a key file."""
    if verified is None or verified.keys is None:
        return NO_CONSUMERS
    return verified.keys.ring.consumers


def on_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class RateSampler:
    """Samples ``gateway_requests_total`` per (region, rule, decision) every few seconds
    and keeps the last minutes, so the console shows rates without a Prometheus."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.samples: deque[tuple[float, dict[tuple[str, str, str], float]]] = deque()

    def take(self, now: float | None = None, totals: Totals | None = None) -> None:
        """One sample: ``totals`` as ``request_totals`` reads them (read here if not given)."""
        if totals is None:
            totals = request_totals(self.registry)
        now = time.monotonic() if now is None else now
        self.samples.append((now, totals))
        while self.samples and now - self.samples[0][0] > HISTORY_SECONDS + SAMPLE_SECONDS:
            self.samples.popleft()

    def rates(self) -> list[dict[str, Any]]:
        """Per (region, rule): requests per second by decision over each window."""
        if not self.samples:
            return []
        now, latest = self.samples[-1]
        rows: dict[tuple[str, str], dict[str, Any]] = {}
        for window in RATE_WINDOWS:
            then, old = self.samples[0]
            for t, values in self.samples:
                if now - t <= window:
                    then, old = t, values
                    break
            span = now - then
            for (region, rule, decision), value in latest.items():
                if decision not in DECISIONS:
                    continue
                row = rows.setdefault(
                    (region, rule),
                    {"region": region, "rule": rule, **{f"{d}_{w}s": 0.0 for d in DECISIONS
                                                        for w in RATE_WINDOWS}},
                )  # fmt: skip
                delta = value - old.get((region, rule, decision), 0.0)
                row[f"{decision}_{window}s"] = round(delta / span, 3) if span > 0 else 0.0
                row[f"{decision}_total"] = value
        return sorted(rows.values(), key=lambda r: (r["region"], r["rule"]))


def breaker_states(registry: CollectorRegistry) -> dict[str, list[float]]:
    """region -> breaker state of each process (0 closed, 1 open, 2 half-open)."""
    found: dict[str, list[float]] = {}
    for metric in registry.collect():
        if metric.name == "gateway_counter_breaker_state":
            for sample in metric.samples:
                found.setdefault(sample.labels.get("region", ""), []).append(sample.value)
    return found


BREAKER_NAMES = {0: "closed", 1: "open", 2: "half-open"}

# --- rendering ---------------------------------------------------------------------------------

e = html.escape


def _rule_row(rule: Rule, region: str, rates: Mapping[str, Any] | None, hidden: bool) -> str:
    if rule.unlimited:
        limit, flags = "exempt", ["exempt"]
    else:
        limit = ", ".join(str(s) for s in rule.limits_for(region))
        flags = []
    if rule.ceiling:
        flags.append("ceiling")
    if rule.tiers:
        flags.append("tiers: " + ", ".join(sorted(rule.tiers)))
    if rule.shadow:
        flags.append("shadow")
    if not rule.fail_open:
        flags.append("fails closed")
    match = " or ".join(a.describe() for a in rule.alternatives) or "any request"
    cls = ' class="shadow"' if rule.shadow else ""
    now = (rates or {}).get("now") or {}

    def rate(name: str) -> str:
        value = now.get(name, 0.0)
        shown = "-" if rates is None else f"{value:.2f}"
        return f'<td class="num {name}{"" if value else " zero"}">{shown}</td>'

    return (
        f'<tr{cls} data-rule="{e(rule.id)}"{" hidden" if hidden else ""}>'
        f"<td>{rule.index}</td><td>{e(rule.id)}</td><td>{e(rule.category)}</td>"
        f'<td class="match">{e(match)}</td>'
        f"<td>{e(rule.identity.value if not rule.unlimited else '-')}</td>"
        f"<td>{e(limit)}</td><td>{e(', '.join(flags))}</td>"
        f"{rate('allowed')}{rate('limited')}"
        f'<td class="chart"></td><td class="file">{e(rule.source)}</td></tr>'
    )


def region_rules(table: RuleTable, region: str) -> list[Rule]:
    """The rules that apply in ``region`` in table order, then the ceilings with a limit
    there (they apply besides the rule a request matches)."""
    return [*table.for_region(region), *(c for c in table.ceilings if c.limits_for(region))]


def _rules_section(
    table: RuleTable,
    error: str | None,
    regions: list[str],
    selected: str,
    rule_filter: str,
    rates: Mapping[str, Mapping[str, Any]],
) -> str:
    """One rule table per region, all but the selected one hidden (the selector shows
    another without a round trip); rows the filter leaves out hidden too."""
    wanted = rule_filter.casefold()
    parts = [
        f"<p>table <code>{e(table.digest[:12])}</code>, {len(table.rules)} rules from "
        f"{e(', '.join(table.sources))}; first match in this order. "
        '<span class="key allowed">allowed</span> <span class="key limited">limited</span> '
        '<span class="key shadow">shadow-limited</span> per second, in 10-second bars; '
        "rates: the last minute. Focus a chart and use the arrow keys to read its bars."
        '</p><p id="rules-note" aria-live="polite"></p>'
    ]
    if error:
        parts.append(f'<p class="error">last reload refused: <pre>{e(error)}</pre></p>')
    for region in regions:
        shown = region == selected
        rows = "".join(
            _rule_row(r, region, rates.get(r.id) if shown else None,
                      wanted not in r.id.casefold())
            for r in region_rules(table, region)
        )  # fmt: skip
        parts.append(
            f'<table class="rules" data-region="{e(region)}"{"" if shown else " hidden"}>'
            f"<caption>rules in region {e(region)}</caption>"
            "<thead><tr><th>#</th><th>rule</th><th>category</th><th>match</th>"
            "<th>identity</th><th>limit (count/s)</th><th>flags</th>"
            '<th class="num">allowed/s</th><th class="num">limited/s</th>'
            "<th>last 10 minutes</th><th>file</th></tr></thead>"
            f"<tbody>{rows}</tbody></table>"
        )
    return "".join(parts)


def _regions_section(regions: list[dict[str, object]], breakers: dict[str, list[float]]) -> str:
    rows = []
    for region in regions:
        name = str(region["name"])
        states = breakers.get(name, [])
        shown = ", ".join(BREAKER_NAMES.get(int(s), "?") for s in states) or "none (in-process)"
        health = "healthy" if region["healthy"] else "NOT ANSWERING"
        rows.append(
            f'<tr data-region="{e(name)}"><td>{e(name)}</td>'
            f"<td>{e(str(region['counter_backend']))}</td>"
            f'<td class="health {"ok" if region["healthy"] else "bad"}">{health}</td>'
            f'<td>{e(shown)}</td><td class="strip"></td></tr>'
        )
    return (
        '<table id="regions"><thead><tr><th>region</th><th>counter store</th><th>health</th>'
        "<th>breaker (per process)</th><th>last 10 minutes</th></tr></thead><tbody>"
        + "".join(rows) + "</tbody></table>"
    )  # fmt: skip


def recent_identities(recent: list[Recent], limit: int = 20) -> list[dict[str, Any]]:
    """The identities limited most recently (newest first), each with its latest refusal
    and how many of the refusals kept it accounts for."""
    found: dict[tuple[str, str | None, str | None], dict[str, Any]] = {}
    for item in recent:  # newest first
        at, region, rule, identity = item[0], item[1], item[2], item[3]
        entry = found.get((region, rule, identity))
        if entry is None:
            if len(found) >= limit:
                continue
            found[(region, rule, identity)] = {
                "time": at, "region": region, "rule": rule, "identity": identity, "refusals": 1,
            }  # fmt: skip
        else:
            entry["refusals"] += 1
    return list(found.values())


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch))


def _top_rows(top: list[dict[str, Any]]) -> str:
    rows = []
    for item in top:
        rows.append(
            f'<tr><td><code class="id">{e(item["identity"])}</code></td>'
            f"<td>{e(item['consumer'] or '-')}</td><td>{e(item['tier'] or '-')}</td>"
            f'<td class="num">{int(item["refusals"]):,}</td>'
            f"<td>{e(', '.join(item['rules']))}</td><td>{_clock(item['last'])}</td></tr>"
        )
    return "".join(rows) or '<tr><td colspan="6">none in the last 10 minutes</td></tr>'


def _replay_section(report: Mapping[str, Any] | None) -> str:
    if report is None:
        return (
            "<p>No replay saved. Run <code>gateway rules simulate --rules NEW "
            "--baseline OLD --save ACCESS_LOG</code> to keep one here.</p>"
        )
    new = report.get("new") or {}
    lines = [
        f"<p>{int(report.get('replayed', 0)):,} requests from "
        f"{e(', '.join(str(x) for x in report.get('logs', [])))}, recorded "
        f"{e(str(report.get('from')))} to {e(str(report.get('to')))}; new table "
        f"<code>{e(str(new.get('digest', ''))[:12])}</code>"
        + (
            f", baseline <code>{e(str(report['baseline'].get('digest', ''))[:12])}</code>"
            if report.get("baseline") else ""
        )
        + ".</p>"
    ]  # fmt: skip
    rows = []
    old_rules = {r["id"]: r for r in (report.get("baseline") or {}).get("rules", [])}
    for rule in new.get("rules", []):
        if not rule.get("matched") and not old_rules.get(rule["id"], {}).get("matched"):
            continue
        old = old_rules.get(rule["id"])
        before = "" if old is None else f"{int(old['limited']):,}"
        top = ", ".join(str(t["identity"]) for t in rule.get("top_limited", [])[:3])
        rows.append(
            f"<tr><td>{e(str(rule['id']))}</td><td>{int(rule['matched']):,}</td>"
            f"<td>{before}</td><td>{int(rule['limited']):,}</td>"
            f"<td>{int(rule['identities_limited']):,}</td><td><code>{e(top)}</code></td></tr>"
        )
    lines.append(
        '<table id="replay"><thead><tr><th>rule</th><th>matched</th><th>limited (baseline)</th>'
        "<th>limited (new)</th><th>identities limited</th><th>most limited</th></tr></thead>"
        "<tbody>" + "".join(rows) + "</tbody></table>"
    )
    diff = report.get("diff")
    if diff:
        lines.append(
            f"<p>newly limited: {int(diff['requests_newly_limited']):,} requests, "
            f"{int(diff['identities_newly_limited']):,} identities; newly allowed: "
            f"{int(diff['requests_newly_allowed']):,} requests, "
            f"{int(diff['identities_newly_freed']):,} identities freed.</p>"
        )
    return "".join(lines)


def _page(title: str, body: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        '<link rel="icon" href="/console/static/favicon.svg" type="image/svg+xml">'
        '<link rel="stylesheet" href="/console/static/console.css">'
        '<script src="/console/static/console.js" defer></script>'
        f"</head><body>{body}</body></html>"
    )


# --- the application ---------------------------------------------------------------------------

SOURCE_KEY = web.AppKey("console_source", ConsoleSource)
SAMPLER_KEY = web.AppKey("console_sampler", RateSampler)
HISTORY_KEY = web.AppKey("console_history", ConsoleHistory)
CONSUMERS_KEY = web.AppKey("console_consumers", ConsumerNames)


def _session_value(token: str) -> str:
    return hmac.new(token.encode(), b"gateway-console-session", hashlib.sha256).hexdigest()


def _authorised(request: web.Request, source: ConsoleSource) -> bool:
    token = source.admin_token
    if token is None:
        return on_loopback(source.admin_host)
    bearer = request.headers.get("Authorization", "")
    if bearer.startswith("Bearer ") and hmac.compare_digest(bearer[7:].encode(), token.encode()):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return hmac.compare_digest(cookie.encode(), _session_value(token).encode())


def _json_error(status: int, detail: str) -> web.Response:
    return web.json_response({"detail": detail}, status=status)


@web.middleware
async def _console_guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    path = request.path
    if not path.startswith("/console"):
        return await handler(request)
    source = request.app[SOURCE_KEY]
    open_paths = ("/console/login", "/console/static/")
    if not path.startswith(open_paths) and not _authorised(request, source):
        if source.admin_token is None:
            response: web.StreamResponse = _json_error(
                403,
                f"the console is off: the admin port listens on {source.admin_host}, not on "
                "loopback, and no admin_token is configured (set GATEWAY_ADMIN_TOKEN)",
            )
        elif path.startswith("/console/api/"):
            response = _json_error(401, "sign in at /console/login or send Authorization: Bearer")
        else:
            response = _see_other("/console/login")
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            _harden(exc.headers)
            raise
    _harden(response.headers)
    return response


def _harden(headers: Any) -> None:
    headers["Content-Security-Policy"] = CSP
    headers["X-Content-Type-Options"] = "nosniff"
    headers["Referrer-Policy"] = "no-referrer"
    headers["Cache-Control"] = "no-store"


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def _region_names(table: RuleTable, regions: Sequence[Mapping[str, object]]) -> list[str]:
    """Every region the console can show: the served ones (the default first), then the
    others the rule files name, sorted."""
    served = [str(r["name"]) for r in regions]
    return served + sorted(set(table.regions) - set(served))


def _view(request: web.Request, names: list[str]) -> tuple[str, str] | web.Response:
    """The region and rule filter a request asks for (``?region=``, ``?rule=``), or the
    4xx answer to a bad one."""
    region = request.query.get("region") or (names[0] if names else "us")
    if region not in names:
        return _json_error(
            422, f"unknown region {region[:64]!r}; this console shows {', '.join(names)}"
        )
    rule_filter = request.query.get("rule", "").strip()
    if len(rule_filter) > MAX_FILTER_CHARS or not rule_filter.isprintable():
        return _json_error(
            422, f"rule must be printable text of at most {MAX_FILTER_CHARS} characters"
        )
    return region, rule_filter


def _snapshot(request: web.Request, region: str, rule_filter: str) -> dict[str, Any]:
    source = request.app[SOURCE_KEY]
    history = request.app[HISTORY_KEY]
    lookup = None
    if source.consumers is not None:
        names = request.app[CONSUMERS_KEY]
        names.update(source.consumers())
        lookup = names.lookup
    rules = [r.id for r in region_rules(source.table(), region)]
    return history.snapshot(region, rules, rule_filter, consumer_of=lookup)


async def _index(request: web.Request) -> web.Response:
    source = request.app[SOURCE_KEY]
    table = source.table()
    regions = await source.regions()
    names = _region_names(table, regions)
    view = _view(request, names)
    if isinstance(view, web.Response):
        return view
    region, rule_filter = view
    snapshot = _snapshot(request, region, rule_filter)
    rates = {row["rule"]: row for row in snapshot["rules"]}
    region_options = "".join(
        f"<option{' selected' if r == region else ''}>{e(r)}</option>" for r in names
    )
    body = (
        "<header><h1>ratelimit-gateway console</h1>"
        '<form id="view" method="get" action="/console" role="search">'
        f'<label>region <select name="region" id="region">{region_options}</select></label>'
        '<label>rules matching <input type="search" name="rule" id="rule-filter" '
        f'value="{e(rule_filter)}" maxlength="{MAX_FILTER_CHARS}" placeholder="rule id" '
        'autocomplete="off"></label>'
        '<button type="submit" class="nojs">show</button>'
        '<span id="filter-count" aria-live="polite"></span>'
        "</form><p>read-only; refreshes live (sampled every few seconds, 10 minutes "
        'kept)</p><p id="chart-status" class="visually-hidden" aria-live="polite"></p>'
        "</header>"
        '<div class="overview"><section id="stores"><h2>Counter stores</h2>'
        + _regions_section(regions, breaker_states(source.registry))
        + '</section><section id="limited"><h2>Top limited identities in region '
        f'<span class="region-name">{e(region)}</span></h2>'
        "<p>refusals in the last 10 minutes, read from the latest refusals each process keeps "
        "(at high refusal rates, a sample); identities hashed as logged.</p>"
        '<table id="top-limited"><thead><tr><th>identity</th><th>consumer</th><th>tier</th>'
        '<th class="num">refusals</th><th>rules</th><th>last (UTC)</th></tr></thead><tbody>'
        + _top_rows(snapshot["top_limited"])
        + "</tbody></table></section></div>"
        '<section id="rules-section"><h2>Rules and rates in region '
        f'<span class="region-name">{e(region)}</span></h2>'
        + _rules_section(table, source.last_reload_error(), names, region, rule_filter, rates)
        + "</section><section><h2>Explain a request</h2>"
        '<form id="explain"><label>method <input name="method" value="GET" size="8">'
        '</label> <label>path <input name="path" value="/" size="40"></label> '
        f'<label>region <select name="region">{region_options}</select></label> '
        '<label>client address <input name="client_ip" value="203.0.113.7" size="16">'
        '</label><br><label>headers, one per line<br><textarea name="headers" rows="3" '
        'cols="60" placeholder="x-api-key: ..."></textarea></label><br>'
        '<button type="submit">explain</button></form>'
        '<pre id="explain-answer" aria-live="polite"></pre></section>'
        "<section><h2>Last replay</h2>"
        + _replay_section(load_report(source.data_dir))
        + "</section>"
    )
    return web.Response(text=_page("gateway console", body), content_type="text/html")


async def _history(request: web.Request) -> web.Response:
    """The charts' data for one region (bounded: see ``ConsoleHistory.snapshot``)."""
    source = request.app[SOURCE_KEY]
    # The served regions as the health checks found them (no store asked per poll);
    # before the first check, asked once.
    served = request.app[HISTORY_KEY].served
    regions = [{"name": r} for r in served] if served else await source.regions()
    names = _region_names(source.table(), regions)
    view = _view(request, names)
    if isinstance(view, web.Response):
        return view
    return web.json_response(_snapshot(request, *view), dumps=_compact)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


async def _rates(request: web.Request) -> web.Response:
    sampler = request.app[SAMPLER_KEY]
    return web.json_response({"windows_s": list(RATE_WINDOWS), "rates": sampler.rates()})


async def _recent(request: web.Request) -> web.Response:
    return web.json_response(recent_identities(request.app[SOURCE_KEY].recent()))


async def _explain(request: web.Request) -> web.Response:
    source = request.app[SOURCE_KEY]
    if request.content_type != "application/json":
        return _json_error(415, "send the request to explain as application/json")
    try:
        body = await request.json()
    except ValueError:
        return _json_error(400, "the body is not JSON")
    if not isinstance(body, dict):
        return _json_error(422, "send a JSON object with method, path and headers")
    fields = {}
    for name, default in (("method", "GET"), ("path", "/"), ("headers", ""),
                          ("client_ip", "203.0.113.7"), ("region", "")):  # fmt: skip
        value = body.get(name, default)
        if not isinstance(value, str) or len(value) > 8192:
            return _json_error(422, f"{name} must be a string of at most 8192 characters")
        fields[name] = value
    headers = [line for line in fields["headers"].splitlines() if line.strip()]
    table = source.table()
    try:
        read = await source.reader(table)
    except (ValueError, OSError) as exc:  # (the identity files, for a supervisor's console)
        return _json_error(503, f"cannot read requests as the data plane does: {exc}")
    try:
        text = explain_request(
            table, source.hasher, source.secret_source, fields["method"],
            fields["path"] or "/", headers, fields["client_ip"] or "203.0.113.7",
            fields["region"] or None, read=read,
        )  # fmt: skip
    except ValueError as exc:  # (a Refused too: the gateway answers it before any rule)
        return _json_error(422, str(exc))
    return web.json_response({"text": text})


async def _login_form(request: web.Request) -> web.Response:
    source = request.app[SOURCE_KEY]
    if source.admin_token is None:
        return _see_other("/console")
    body = (
        "<h1>gateway console</h1>"
        '<form method="post" action="/console/login"><label>admin token '
        '<input type="password" name="token" autocomplete="current-password"></label> '
        '<button type="submit">sign in</button></form>'
    )
    return web.Response(text=_page("sign in", body), content_type="text/html")


async def _login(request: web.Request) -> web.StreamResponse:
    source = request.app[SOURCE_KEY]
    if source.admin_token is None:
        return _see_other("/console")
    form = await request.post()
    given = form.get("token")
    if not isinstance(given, str) or not hmac.compare_digest(
        given.encode(), source.admin_token.encode()
    ):
        await asyncio.sleep(0.5)  # slows guessing a little; the token is long anyway
        return _json_error(401, "wrong admin token")
    response = _see_other("/console")
    response.set_cookie(
        COOKIE,
        _session_value(source.admin_token),
        httponly=True,
        samesite="Strict",
        path="/console",
        secure=request.secure,
    )
    return response


def _static(name: str, content_type: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    data = resources.files("gateway.proxy").joinpath("console_static", name).read_bytes()

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=data, content_type=content_type)

    return handler


async def _sampling(app: web.Application) -> Any:
    """The history's sampler and health checks, for as long as the admin app runs."""
    source = app[SOURCE_KEY]
    rates = app[SAMPLER_KEY]

    def also(totals: Totals) -> None:
        rates.take(totals=totals)

    tasks = [
        asyncio.create_task(sample_forever(app[HISTORY_KEY], source.registry, source.recent, also)),
        asyncio.create_task(check_health_forever(app[HISTORY_KEY], source.regions)),
    ]
    yield
    for task in tasks:
        task.cancel()
    for task in tasks:
        with suppress(asyncio.CancelledError):
            await task


def add_console(app: web.Application, source: ConsoleSource) -> None:
    """Mount the console on an admin application."""
    app[SOURCE_KEY] = source
    app[SAMPLER_KEY] = RateSampler(source.registry)
    app[HISTORY_KEY] = ConsoleHistory(BUCKET_SECONDS, BUCKETS)
    app[CONSUMERS_KEY] = ConsumerNames(source.hasher)
    app.middlewares.append(_console_guard)
    app.cleanup_ctx.append(_sampling)
    app.router.add_get("/console", _index)
    app.router.add_get("/console/api/history", _history)
    app.router.add_get("/console/api/rates", _rates)
    app.router.add_get("/console/api/recent", _recent)
    app.router.add_post("/console/api/explain", _explain)
    app.router.add_get("/console/login", _login_form)
    app.router.add_post("/console/login", _login)
    app.router.add_get("/console/static/console.js", _static("console.js", "text/javascript"))
    app.router.add_get("/console/static/console.css", _static("console.css", "text/css"))
    app.router.add_get("/console/static/favicon.svg", _static("favicon.svg", "image/svg+xml"))
