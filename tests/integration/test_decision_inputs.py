"""Review round: the rule is chosen only from what the upstream receives and acts on.

Four findings, each tested by its class over real HTTP on loopback (the gateway and a
raw recording upstream that keeps every header as it arrived):

1. method overrides (keep_method_override): the method a rule is chosen by equals the one
   an override-honouring upstream applies to the bytes it received (differential);
2. '_' spellings of headers the gateway reads (x_api_key): refused, never relayed;
3. verified keys: a key header that forms no identity (empty, over-long) is an unknown
   key, never forwarded with ``unknown: reject``;
4. a served region no rule or ceiling limits: a start-up WARNING and ``rules check``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import urllib.parse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.identity.config import IdentityConfigError, parse_identity_config
from gateway.identity.key_edit import add_key
from gateway.ratelimit.identity import MAX_IDENTITY_HEADER_BYTES
from tests.support.fuzz import fuzz
from tests.support.gateway import ROOT, GatewayProcess, running_gateway
from tests.support.raw_upstream import running_raw_upstream


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _send(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    try:
        reply = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), fields, body


def _rule(fields: dict[str, str]) -> str:
    return fields["ratelimit-policy"].split(";")[0].strip('"')


async def _settle(up, count: int) -> None:
    """Wait (briefly) until the recording upstream holds ``count`` requests."""
    for _ in range(100):
        if len(up.recording.requests) >= count:
            return
        await asyncio.sleep(0.01)


# --- 1. method overrides: the rule's method is the one the upstream applies

METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
OVERRIDE_NAMES = ["x-http-method-override", "x-http-method", "x-method-override"]
ACCEPTED = frozenset(METHODS)
# One rule per method on /m (GET rules also match HEAD), so RateLimit-Policy names the
# method the rule was chosen by.
METHOD_RULES = "rules:\n" + "".join(
    f"  - {{id: m-{m.lower()}, match: {{methods: [{m}], path: /m}}, identity: ip, "
    f"limits: {{default: 1000000/60}}}}\n"
    for m in METHODS
    if m != "HEAD"
)


def _recase(draw, name: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    return "".join(c.upper() if f else c for c, f in zip(name, flips, strict=True))


OVERRIDE_VALUES = [*METHODS, "delete", "put", "BREW", "get"]
# Spellings of a query key, those frameworks read as '_method' and those they do not.
QUERY_KEYS = ["_method", "%5Fmethod", "%5fmethod", "_%6Dethod", "_method%5B0%5D",
              ".method", "%2Emethod", "+_method", "%20_method", "_method%00", "_method%00x",
              "_METHOD", "x_method", "method", "-method"]  # fmt: skip


@st.composite
def _override_request(draw) -> tuple[str, list[tuple[str, str]], list[str], str]:
    method = draw(st.sampled_from(METHODS))
    overrides = []
    for _ in range(draw(st.integers(0, 2))):
        name = _recase(draw, draw(st.sampled_from(OVERRIDE_NAMES)))
        value = draw(st.sampled_from(OVERRIDE_VALUES))
        overrides.append((name, value))
    named = draw(st.lists(st.sampled_from([*OVERRIDE_NAMES, "keep-alive", "x-other"]),
                          max_size=3))  # fmt: skip
    params = [
        f"{draw(st.sampled_from(QUERY_KEYS))}={draw(st.sampled_from(OVERRIDE_VALUES))}"
        for _ in range(draw(st.integers(0, 2)))
    ]
    sep = draw(st.sampled_from(["&", ";"]))
    query = "?" + sep.join(["a=_method", *params]) if params else ""
    return method, overrides, [_recase(draw, n) for n in named], query


def _php_name(key: str) -> str:
    """A decoded query key as PHP names it in ``$_GET`` (Laravel and Symfony read the
    override there): cut at a NUL, leading spaces dropped, '.' and ' ' made '_'."""
    return key.split("\0", 1)[0].lstrip(" ").replace(".", "_").replace(" ", "_")


def _query_methods(target: bytes) -> list[str]:
    """The '_method' values some framework reads from the target's query: keys decoded
    by urllib's own parser, split at '&' and ';' (Rack 2 takes both; PHP and Node '&'),
    then named as PHP names them, which takes every key the others take and more."""
    query = target.decode("latin-1").partition("?")[2].replace(";", "&")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True)
    names = [(_php_name(k), v) for k, v in pairs]
    return [v for k, v in names if k == "_method" or k.startswith("_method[")]


def _applied(method: str, headers: list[tuple[bytes, bytes]], target: bytes = b"/") -> str:
    """The method an override-honouring upstream applies to what it received: Rack's
    MethodOverride, express method-override, ASP.NET Core, Laravel and Symfony take an
    override (a header, or '_method' in the query) only on POST."""
    if method != "POST":
        return method
    found = [v.decode() for n, v in headers if n.lower().decode() in OVERRIDE_NAMES]
    found += _query_methods(target)
    if len(found) == 1 and found[0].upper() in ACCEPTED:
        return found[0].upper()
    return method


@fuzz(12)
@given(requests=st.lists(_override_request(), min_size=10, max_size=20))
def test_the_rule_method_is_the_method_the_upstream_applies(tmp_path_factory, requests):
    rules = tmp_path_factory.mktemp("rules") / "methods.yaml"
    rules.write_text(METHOD_RULES)

    async def check() -> None:
        async with (
            running_raw_upstream() as up,
            running_gateway(up.url, rules=[str(rules)], keep_method_override=True) as gw,
        ):
            for method, overrides, named, query in requests:
                fields = b"".join(f"{n}: {v}\r\n".encode() for n, v in overrides)
                connection = ", ".join([*named, "close"]).encode()
                request = (
                    f"{method} /m{query} HTTP/1.1\r\nHost: a\r\n".encode() + fields
                    + b"Connection: " + connection + b"\r\nContent-Length: 0\r\n\r\n"
                )  # fmt: skip
                before = len(up.recording.requests)
                status, got, body = await _send(_port(gw), request)
                dropped = {n.lower() for n in named}
                relayed = [v for n, v in overrides if n.lower() not in dropped]
                in_query = _query_methods(query.encode())
                asked = [*relayed, *in_query] if method == "POST" else []
                # Refused exactly where the upstream would be asked for an override the
                # gateway cannot count by: several, one naming no method, or one in the
                # query on another method (it cannot be dropped as a header is).
                refused = (
                    len(asked) > 1
                    or (len(asked) == 1 and asked[0].upper() not in ACCEPTED)
                    or (bool(in_query) and method != "POST")
                )
                case = (method, overrides, named, query, body)
                if refused:
                    assert status == 400, case
                    assert len(up.recording.requests) == before
                    continue
                assert status == 200, case
                await _settle(up, before + 1)
                received = up.recording.requests[before]
                assert received.target == f"/m{query}".encode()  # the query as it came
                applied = _applied(received.method.decode(), received.headers, received.target)
                expected = "m-get" if applied == "HEAD" else f"m-{applied.lower()}"
                assert _rule(got) == expected, (case, received.headers)
                if received.method != b"POST":
                    # None passed on: an upstream honouring one on any method agrees too.
                    names = {n.lower().decode() for n, _ in received.headers}
                    assert not names & set(OVERRIDE_NAMES), received.headers

    asyncio.run(check())


async def test_the_reviewers_override_cases():
    """GET /runs/<uuid> with an override to PUT is run-lookup (what the upstream serves),
    and an override named in Connection chooses nothing."""
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, keep_method_override=True) as gw,
    ):
        run = "/runs/0b6a6a53-4d4c-4b0b-9c0f-54f3c7f6f0a1"
        status, fields, _ = await _send(
            _port(gw),
            f"GET {run} HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n".encode()
            + b"X-HTTP-Method-Override: PUT\r\nConnection: close\r\n\r\n",
        )
        assert status == 200 and _rule(fields) == "run-lookup"
        status, fields, _ = await _send(
            _port(gw),
            b"POST /runs/query HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n"
            b"X-HTTP-Method-Override: GET\r\nConnection: X-HTTP-Method-Override, close\r\n"
            b"Content-Length: 0\r\n\r\n",
        )
        assert status == 200 and _rule(fields) == "runs-query-api-key"
        await _settle(up, 2)
        for received in up.recording.requests:
            assert not any(n.lower().startswith(b"x-http-method") for n, _ in received.headers)


async def test_overrides_the_gateway_does_not_count_by_never_reach_the_upstream():
    """By default (keep_method_override off): a '_method' query parameter, in any spelling
    a framework decodes to it, is refused with 400 and nothing reaches the upstream; the
    path overrides (X-Original-URL, X-Rewrite-URL: IIS URL Rewrite, older Symfony and
    Zend) are dropped, so the upstream runs the path the rule was chosen by."""
    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        targets = [
            "/sessions/s1?_method=DELETE", "/sessions/s1?a=1&%5Fmethod=delete",
            "/sessions/s1?b=2;_%6Dethod=DELETE", "/runs/query?_method%5B0%5D=GET",
        ]  # fmt: skip
        for target in targets:
            for method in ["POST", "GET"]:
                status, fields, body = await _send(
                    _port(gw),
                    f"{method} {target} HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n".encode()
                    + b"Content-Length: 0\r\nConnection: close\r\n\r\n",
                )
                assert status == 400, (method, target, body)
                assert fields["content-type"].startswith("application/json")
                assert "'_method'" in json.loads(body)["detail"]
        assert up.recording.requests == []
        # Other parameters, and '_method' only as a value, pass as they came.
        status, fields, _ = await _send(
            _port(gw),
            b"POST /runs/query?q=_method&x_method=1&%41=2 HTTP/1.1\r\nHost: a\r\n"
            b"x-api-key: k\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        )
        assert status == 200 and _rule(fields) == "runs-query-api-key"
        status, fields, _ = await _send(
            _port(gw),
            b"GET /public/download/x HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n"
            b"X-Original-URL: /runs/stats\r\nx-rewrite-url: /runs/stats\r\n"
            b"Connection: close\r\n\r\n",
        )
        assert status == 200 and _rule(fields) == "public-download"
        await _settle(up, 2)
        assert up.recording.requests[0].target == b"/runs/query?q=_method&x_method=1&%41=2"
        names = {n.lower() for n, _ in up.recording.requests[1].headers}
        assert not names & {b"x-original-url", b"x-rewrite-url"}, names


async def test_a_query_with_more_spellings_of_method_than_the_bound_is_refused():
    """What the '_method' check costs is bounded by the query's size: more spellings of
    "method" than MAX_METHOD_SPELLINGS are refused (400, JSON), nothing reaches the
    upstream; a query of tens of thousands of escaped parameters that spell none passes."""
    from gateway.proxy.handler import MAX_METHOD_SPELLINGS

    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        over = "&".join(["payment_method=card"] * (MAX_METHOD_SPELLINGS + 1))
        status, fields, body = await _send(
            _port(gw),
            f"GET /runs/query?{over} HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n".encode()
            + b"Connection: close\r\n\r\n",
        )
        assert status == 400, body
        assert fields["content-type"].startswith("application/json")
        assert "spellings of 'method'" in json.loads(body)["detail"]
        many = "%41=1&" * 5000  # 30 KB, under the head's bound
        status, fields, _ = await _send(
            _port(gw),
            f"POST /runs/query?{many}q=1 HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n".encode()
            + b"Content-Length: 0\r\nConnection: close\r\n\r\n",
        )
        assert status == 200 and _rule(fields) == "runs-query-api-key"
        await _settle(up, 1)
        assert len(up.recording.requests) == 1
        assert up.recording.requests[0].target.endswith(b"q=1")


async def test_a_path_is_counted_by_its_rule_whatever_its_case():
    """Express and ASP.NET Core route /RUNS/QUERY as /runs/query: it is counted by that
    rule (not the looser default) and forwarded as it came."""
    async with running_raw_upstream() as up, running_gateway(up.url) as gw:
        for target in ["/RUNS/QUERY", "/Runs/Query", "/runs/STATS"]:
            method = "GET" if target.endswith("STATS") else "POST"
            status, fields, _ = await _send(
                _port(gw),
                f"{method} {target} HTTP/1.1\r\nHost: a\r\nx-api-key: k\r\n".encode()
                + b"Content-Length: 0\r\nConnection: close\r\n\r\n",
            )
            expected = "runs-stats" if method == "GET" else "runs-query-api-key"
            assert status == 200 and _rule(fields) == expected, (target, fields)
        await _settle(up, 3)
        assert [r.target for r in up.recording.requests] == [
            b"/RUNS/QUERY",
            b"/Runs/Query",
            b"/runs/STATS",
        ]


# --- 2. '_' spellings of the headers the gateway reads

# Every header name the gateway reads for a decision, sets, or drops (the identity
# headers, Connection's hop-by-hop family, the forwarding headers, the overrides, framing
# and the singletons it checks), with at least one '-'.
READ_NAMES = [
    "x-api-key", "x-user-id", "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host",
    "x-forwarded-port", "x-real-ip", "x-request-id", "x-http-method-override",
    "x-http-method", "x-method-override", "content-length", "transfer-encoding",
    "keep-alive", "proxy-connection", "proxy-authorization", "content-type", "user-agent",
    "x-original-url", "x-rewrite-url",
]  # fmt: skip


@st.composite
def _alias(draw, names: list[str]) -> tuple[str, str]:
    name = draw(st.sampled_from(names))
    dashes = name.count("-")
    seps = draw(
        st.lists(st.sampled_from("-_"), min_size=dashes, max_size=dashes).filter(lambda s: "_" in s)
    )
    parts = name.split("-")
    spelled = parts[0] + "".join(sep + part for sep, part in zip(seps, parts[1:], strict=True))
    return name, _recase(draw, spelled)


@fuzz(8)
@given(spellings=st.lists(_alias(READ_NAMES), min_size=8, max_size=16))
def test_an_underscore_spelling_of_a_header_the_gateway_reads_is_refused(spellings):
    async def check() -> None:
        async with running_raw_upstream() as up, running_gateway(up.url) as gw:
            for name, spelled in spellings:
                status, fields, body = await _send(
                    _port(gw),
                    b"GET /runs/stats HTTP/1.1\r\nHost: a\r\n" + spelled.encode()
                    + b": 5\r\nConnection: close\r\n\r\n",
                )  # fmt: skip
                assert status == 400, (spelled, body)
                assert fields["content-type"].startswith("application/json")
                detail = json.loads(body)["detail"]
                assert repr(spelled) in detail and repr(name) in detail
            # the same names spelled with '-' (any case) and other '_' headers pass
            status, fields, _ = await _send(
                _port(gw),
                b"GET /runs/stats HTTP/1.1\r\nHost: a\r\nX-Api-KEY: k\r\nx_trace_id: 1\r\n"
                b"Connection: close\r\n\r\n",
            )
            assert status == 200 and _rule(fields) == "runs-stats"
            await _settle(up, 1)
            assert len(up.recording.requests) == 1  # nothing refused reached it
            assert (b"x_trace_id", b"1") in up.recording.requests[0].headers

    asyncio.run(check())


async def test_a_configured_key_header_is_guarded_too(tmp_path):
    keys = tmp_path / "keys.yaml"
    add_key(keys, "acme")
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"identity:\n  api_key: {{keys: {keys}, header: x-consumer-key, unknown: reject}}\n"
    )
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, config_file=str(config)) as gw,
    ):
        for spelled in (b"x_consumer_key", b"X-Consumer_Key", b"x_user_id", b"x_api_key"):
            request = b"GET /x HTTP/1.1\r\nHost: a\r\n" + spelled + b": random\r\n"
            status, _, body = await _send(_port(gw), request + b"Connection: close\r\n\r\n")
            if spelled == b"x_api_key":  # x-api-key is not read in this configuration
                assert status == 200, body
            else:
                assert status == 400 and spelled in body, body
    for header in ("x_consumer_key", "x_user_id", "x-a-b-c-d-e-f-g-h-i"):
        with pytest.raises(IdentityConfigError):
            parse_identity_config({"api_key": {"keys": str(keys), "header": header}}, tmp_path)


# --- 3. verified keys: a present key header that forms no identity is an unknown key

OVER = b"R" * (MAX_IDENTITY_HEADER_BYTES + 1)
NO_IDENTITY = [b"", b"   ", b"\t", OVER, b"R" * 600, b"\x80" * 300]


@pytest.fixture
def reject_config(tmp_path):
    keys = tmp_path / "keys.yaml"
    known = add_key(keys, "acme")
    config = tmp_path / "gateway.yaml"
    config.write_text(f"identity:\n  api_key: {{keys: {keys}, unknown: reject}}\n")
    return str(config), known, keys


def _key_request(value: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /runs/query HTTP/1.1\r\nHost: a\r\nx-api-key: " + value + b"\r\n" + extra
        + b"Content-Length: 0\r\nConnection: close\r\n\r\n"
    )  # fmt: skip


async def test_a_key_forming_no_identity_is_refused_as_unknown(reject_config):
    config, known, _ = reject_config
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, config_file=config) as gw,
    ):
        for value in NO_IDENTITY:
            status, fields, body = await _send(_port(gw), _key_request(value))
            assert status == 401, (value[:20], body)
            assert fields["www-authenticate"].startswith("ApiKey")
            assert "unknown API key" in json.loads(body)["detail"]
        assert not up.recording.requests  # never forwarded
        # Named in Connection the key is hop-by-hop: dropped, so it identifies nobody and
        # the request is one without a key (forwarded without it).
        status, fields, _ = await _send(_port(gw), _key_request(OVER, b"Connection: x-api-key\r\n"))
        assert status == 200 and _rule(fields) == "catch-all"
        await _settle(up, 1)
        assert not any(n.lower() == b"x-api-key" for n, _ in up.recording.requests[0].headers)
        status, fields, _ = await _send(_port(gw), _key_request(known.encode()))
        assert status == 200 and _rule(fields) == "runs-query-api-key"


@pytest.mark.parametrize("mode", ["anonymous", "unverified"])
async def test_without_reject_such_keys_are_counted_per_address(tmp_path, mode):
    """Kept: ``unknown: anonymous`` forwards unknown keys counted per address, and so these;
    without a key file a value that forms no identity is counted per address (SPEC 2)."""
    keys = tmp_path / "keys.yaml"
    add_key(keys, "acme")
    config = None
    if mode == "anonymous":
        config = tmp_path / "gateway.yaml"
        config.write_text(f"identity:\n  api_key: {{keys: {keys}}}\n")
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, config_file=None if config is None else str(config)) as gw,
    ):
        for value in (b"", OVER):
            status, fields, _ = await _send(_port(gw), _key_request(value))
            assert status == 200 and _rule(fields) == "catch-all"


# --- 4. a served region no rule and no ceiling limits


REGIONS = (
    "regions:\n  us: {hosts: [us.example]}\n  eu: {hosts: [eu.example]}\n"
    "  ap: {hosts: [ap.example]}\n"
)


async def test_a_served_region_without_limits_is_a_start_up_warning(tmp_path, caplog):
    config = tmp_path / "gateway.yaml"
    config.write_text(REGIONS)
    with caplog.at_level(logging.WARNING, logger="gateway.rules.regions"):
        async with running_raw_upstream() as up, running_gateway(up.url, config_file=str(config)):
            pass
    warned = [r.getMessage() for r in caplog.records if r.name == "gateway.rules.regions"]
    assert len(warned) == 1 and warned[0].startswith("region 'ap' has no limits"), warned
    assert "every request served there is exempt" in warned[0]


def test_gateway_serve_logs_it(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(REGIONS)
    log = tmp_path / "gateway.log"
    gw = GatewayProcess(
        ["--config", str(config), "--no-embedded", "--data-dir", str(tmp_path)], log_path=log
    )
    try:
        gw.wait_ready()
    finally:
        gw.stop()
    lines = [line for line in log.read_text().splitlines() if "has no limits" in line]
    assert len(lines) == 1 and "WARNING" in lines[0] and "'ap'" in lines[0], lines


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", "rules", "check", *args],
        cwd=ROOT, text=True, capture_output=True, timeout=60,
    )  # fmt: skip


def test_rules_check_reports_regions_without_limits(tmp_path):
    plain = _check("rules")
    assert plain.returncode == 0 and "warning" not in plain.stderr
    served = _check("rules", "--region", "ap")
    assert served.returncode == 1, served
    assert "region 'ap' has no limits" in served.stderr and "'eu'" not in served.stderr
    us_only = tmp_path / "us.yaml"
    us_only.write_text("rules:\n  - {id: all, identity: ip, limits: {us: 10/60}}\n")
    loose = _check(str(us_only))  # us2 takes us's values; eu is not said to be served
    assert loose.returncode == 0 and "ok: 1 rules" in loose.stdout
    assert loose.stderr.count("warning: region") == 1 and "'eu'" in loose.stderr
    strict = _check(str(us_only), "--region", "eu")
    assert strict.returncode == 1 and "region 'eu' has no limits" in strict.stderr
    # A ceiling alone limits a region; a shadow rule alone does not.
    ceiling = tmp_path / "ceiling.yaml"
    ceiling.write_text(
        "rules:\n  - {id: all, identity: ip, limits: {us: 10/60}}\n"
        "  - {id: try, identity: ip, shadow: true, limits: {ap: 1/60}}\n"
        "ceilings:\n  - {id: cap, identity: ip, limits: {eu: 10/60}}\n"
    )
    checked = _check(str(ceiling), "--region", "eu", "--region", "ap")
    assert checked.returncode == 1 and "'ap'" in checked.stderr and "'eu'" not in checked.stderr


async def test_a_host_two_readers_would_read_apart_is_refused(tmp_path):
    """A security review: ``Host: eu.example:80:80`` was in no region's list (counted in
    the default region, its own quota) while nginx serves it as eu.example. Every Host
    value that is not ``host[:port]`` is refused (RFC 9112 3.2) and never forwarded; one
    that is names its region whatever the port (tests/unit/test_host_header.py: the
    property over values)."""
    config = tmp_path / "gateway.yaml"
    config.write_text("regions:\n  us: {hosts: [us.example]}\n  eu: {hosts: [eu.example]}\n")
    async with (
        running_raw_upstream() as up,
        running_gateway(up.url, config_file=str(config)) as gw,
    ):
        for host in [b"eu.example:80:80", b"eu.example:80 x", b"eu.example/x", b"eu.example@us",
                     b"[eu.example]:80", b"eu.example:65536"]:  # fmt: skip
            status, _, body = await _send(
                _port(gw), b"GET /a HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
            )
            assert status == 400 and b"Host header" in body, (host, status, body)
        status, fields, _ = await _send(
            _port(gw), b"GET /a HTTP/1.1\r\nHost: EU.example.:8080\r\nConnection: close\r\n\r\n"
        )
        assert status == 200, fields
        await _settle(up, 1)
        assert [r.target for r in up.recording.requests] == [b"/a"]
        samples = {
            (sample.labels.get("region"), sample.labels.get("status_class")): sample.value
            for family in gw.metrics.registry.collect()
            if family.name == "gateway_responses"
            for sample in family.samples
            if sample.name.endswith("_total")
        }
        assert samples.get(("eu", "2xx")) == 1 and ("us", "2xx") not in samples, samples
