"""DNS rebinding on the admin port (hardening issue, finding 8).

A page in the operator's browser that rebinds its own name to 127.0.0.1 reaches the
admin port with ``Host: <its name>``. Without ``admin_token``, everything but
``/metrics`` and ``/ok`` answers only a ``Host`` naming the admin port itself (loopback
names and addresses, ``admin_host``, ``admin_allowed_hosts``); the rest gets 421 (a
well-formed foreign name) or 400 (no, several or a malformed ``Host``), in JSON.

Every request here is written byte for byte on a socket to a real admin application
listening on loopback, so the ``Host`` line is exactly the one under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import string
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import example, given
from hypothesis import strategies as st

from gateway.app import request_reader
from gateway.explain import ReadRequest
from gateway.metrics import Metrics
from gateway.policy.loader import load_rules_from_texts
from gateway.policy.model import RuleTable
from gateway.proxy.admin import create_admin_app
from gateway.proxy.console import ConsoleSource
from gateway.ratelimit.identity import IdentityHasher
from gateway.settings import Settings
from tests.support.fuzz import fuzz

RULES = """
rules:
  - id: q-key
    match: {prefix: /q}
    identity: api_key
    limits: {default: 5/2}
"""
TOKEN = "rebinding-token-0123456789"
EXPLAIN = json.dumps({"method": "GET", "path": "/q/1", "headers": "x-api-key: sk-1"}).encode()
# (method, path, body): the operator's pages and APIs a rebinding page would read
GUARDED = [
    ("GET", "/console", b""),
    ("GET", "/console/api/rates", b""),
    ("GET", "/console/api/recent", b""),
    ("POST", "/console/api/explain", EXPLAIN),
    ("GET", "/info", b""),
    ("GET", "/console/static/console.js", b""),
]


def _source(
    tmp_path: Path, metrics: Metrics, host: str, token: str | None, allowed: tuple[str, ...]
) -> ConsoleSource:
    table = load_rules_from_texts([("rules/a.yaml", RULES)])

    async def regions() -> list[dict[str, object]]:
        return [{"name": "us", "counter_backend": "memory", "healthy": True}]

    async def reader(table: RuleTable) -> ReadRequest:  # the data plane's reading
        return request_reader(Settings(), table, IdentityHasher(b"s" * 32), None)

    return ConsoleSource(
        table=lambda: table,
        last_reload_error=lambda: None,
        regions=regions,
        registry=metrics.registry,
        recent=lambda: [(1_795_428_000.0, "us", "q-key", "api_key:0123456789ab")],
        hasher=IdentityHasher(b"s" * 32),
        secret_source="a test secret",
        reader=reader,
        data_dir=tmp_path,
        admin_host=host,
        admin_token=token,
        admin_allowed_hosts=allowed,
    )


@contextlib.contextmanager
def admin_port(
    tmp_path: Path,
    admin_host: str = "127.0.0.1",
    token: str | None = None,
    allowed: tuple[str, ...] = (),
    listen: str = "127.0.0.1",
) -> Iterator[int]:
    """The admin application (console and /info) served from a thread on ``listen``."""
    metrics = Metrics()

    async def info() -> dict[str, object]:
        return {"regions": [{"name": "us", "counter": "redis://10.0.0.9:6379/0"}]}

    app = create_admin_app(
        metrics.registry, info, _source(tmp_path, metrics, admin_host, token, allowed)
    )
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, listen, 0)
        await site.start()
        return int(runner.addresses[0][1])

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def send(
    port: int,
    host_lines: list[bytes] | bytes | None,
    method: str = "GET",
    path: str = "/console",
    body: bytes = b"",
    extra: bytes = b"",
    connect: str = "127.0.0.1",
) -> tuple[int, bytes]:
    """One request with exactly these ``Host`` field values; (status, body)."""
    if isinstance(host_lines, bytes):
        host_lines = [host_lines]
    head = f"{method} {path} HTTP/1.1\r\n".encode()
    for value in host_lines or []:
        head += b"Host: " + value + b"\r\n"
    if body:
        head += b"Content-Type: application/json\r\n"
    head += b"Content-Length: %d\r\nConnection: close\r\n" % len(body) + extra + b"\r\n"
    with socket.create_connection((connect, port), timeout=5) as sock:
        sock.sendall(head + body)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def assert_refused(status: int, body: bytes, status_wanted: int = 421) -> str:
    assert status == status_wanted, (status, body[:300])
    detail = json.loads(body)["detail"]
    assert isinstance(detail, str)
    return detail


def test_a_rebound_name_reads_nothing_but_metrics_and_ok(tmp_path):
    """Regression: on 254bf91 every request below with a foreign Host was answered 200."""
    with admin_port(tmp_path) as port:
        for host in (b"evil.example", b"evil.example:%d" % port, b"EVIL.example.:80"):
            for method, path, body in GUARDED:
                status, answer = send(port, host, method, path, body)
                detail = assert_refused(status, answer)
                assert "admin_allowed_hosts" in detail and "admin_token" in detail
                assert "DNS rebinding" in detail
                assert b"api_key:" not in answer and b"q-key" not in answer
            for path in ("/metrics", "/ok"):  # scrapers and probes, by any name
                status, answer = send(port, host, path=path)
                assert status == 200, (path, answer[:200])
        # the port's own names, with and without the port, are served
        for host in (b"localhost:%d" % port, b"127.0.0.1:%d" % port, b"[::1]:%d" % port,
                     b"localhost", b"127.0.0.1", b"[::1]", b"LocalHost:%d" % port,
                     b"127.3.4.5:%d" % port, b"[0:0:0:0:0:0:0:1]", b"[::ffff:127.0.0.1]",
                     b"console.localhost:%d" % port, b"localhost.:%d" % port):  # fmt: skip
            for method, path, body in GUARDED:
                status, answer = send(port, host, method, path, body)
                assert status == 200, (host, path, answer[:300])
            _, answer = send(port, host, "POST", "/console/api/explain", EXPLAIN)
            assert b"q-key: MATCHES" in answer


def test_padded_host_is_read_as_the_name(tmp_path):
    with admin_port(tmp_path) as port:
        for host in (b"localhost \t", b"\t localhost", b" 127.0.0.1:%d\t " % port,
                     b"[::1]:%d \t" % port):  # fmt: skip
            assert send(port, host, path="/info")[0] == 200, host
            assert send(port, host)[0] == 200, host
        assert_refused(*send(port, b"evil.example \t", path="/info"))
        assert_refused(*send(port, b" \tevil.example", path="/console/api/recent"))


def test_missing_repeated_or_malformed_host_is_400(tmp_path):
    with admin_port(tmp_path) as port:
        for lines in ([b"[::1"], [b"::1"], [b"localhost:80a"], [b"local host"], [b"[127.0.0.1]"],
                      [b"[v1.x]"], [b""], [b"localhost:1:2"], [b"localhost\xc2\xa0"]):  # fmt: skip
            detail = assert_refused(*send(port, lines, path="/info"), status_wanted=400)
            assert "Host" in detail
            assert send(port, lines, path="/ok")[0] == 200, lines
        # no Host, or two: aiohttp's parser refuses them before any handler (400)
        for lines in ([], [b"localhost", b"localhost"], [b"localhost", b"evil.example"]):
            assert send(port, lines, path="/info")[0] == 400, lines


def test_a_configured_allowed_host_is_served(tmp_path):
    allowed = ("gateway.internal", ".corp.example", "10.9.8.7", "fd00::9", "ops.example:9090")
    with admin_port(tmp_path, allowed=allowed) as port:
        served = (b"gateway.internal:%d" % port, b"GATEWAY.internal.", b"corp.example",
                  b"admin.corp.example:1", b"a.b.corp.example", b"10.9.8.7:9090",
                  b"[fd00::9]:9090", b"[FD00:0::9]", b"ops.example",
                  b" ops.example:1 ")  # fmt: skip
        for host in served:
            for method, path, body in GUARDED:
                assert send(port, host, method, path, body)[0] == 200, (host, path)
        refused = (b"evilcorp.example", b"corp.example.evil", b"gateway.internal.evil",
                   b"xgateway.internal", b"10.9.8.70", b"[fd00::90]", b"evil.example")  # fmt: skip
        for host in refused:
            assert_refused(*send(port, host, path="/info"))
            assert_refused(*send(port, host))


def test_admin_host_itself_is_a_name_of_the_port(tmp_path):
    # admin_host off loopback and no token: the console is off (403, as before), /info
    # answers the admin_host's own name and loopback, not a rebound one.
    with admin_port(tmp_path, admin_host="admin.example") as port:
        assert send(port, b"admin.example:%d" % port, path="/info")[0] == 200
        assert send(port, b"localhost", path="/info")[0] == 200
        assert send(port, b"admin.example")[0] == 403  # the console's own refusal
        assert_refused(*send(port, b"evil.example", path="/info"))
    with admin_port(tmp_path, admin_host="0.0.0.0") as port:
        assert send(port, b"0.0.0.0:%d" % port, path="/info")[0] == 200
        assert_refused(*send(port, b"rebound.example", path="/info"))


def test_on_ipv6_loopback_the_bracketed_address_is_served(tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no ::1 on this host")
    with admin_port(tmp_path, admin_host="::1", listen="::1") as port:
        assert send(port, b"[::1]:%d" % port, connect="::1")[0] == 200
        assert send(port, b"localhost:%d" % port, connect="::1", path="/info")[0] == 200
        assert_refused(*send(port, b"evil.example:%d" % port, connect="::1"))
        assert send(port, b"evil.example", connect="::1", path="/metrics")[0] == 200


def test_with_a_token_the_console_keeps_its_token_and_info_needs_host_or_token(tmp_path):
    with admin_port(tmp_path, admin_host="0.0.0.0", token=TOKEN) as port:
        bearer = b"Authorization: Bearer " + TOKEN.encode() + b"\r\n"
        # the console: token behaviour as before, whatever the Host
        assert send(port, b"gw.example", path="/console")[0] == 303  # to the sign-in form
        assert send(port, b"gw.example", path="/console/login")[0] == 200
        assert send(port, b"gw.example", path="/console/api/rates")[0] == 401
        status, body = send(port, b"gw.example", path="/console/api/recent", extra=bearer)
        assert status == 200 and b"api_key:0123456789ab" in body
        # /info, never covered by the token: a name of the port, or the token
        detail = assert_refused(*send(port, b"gw.example", path="/info"))
        assert "Authorization: Bearer" in detail and "admin_allowed_hosts" in detail
        wrong = b"Authorization: Bearer " + b"x" * len(TOKEN) + b"\r\n"
        assert_refused(*send(port, b"gw.example", path="/info", extra=wrong))
        assert send(port, b"gw.example", path="/info", extra=bearer)[0] == 200
        assert send(port, b"localhost:%d" % port, path="/info")[0] == 200
        assert send(port, b"gw.example", path="/metrics")[0] == 200


# --- the property: only the port's own names are served --------------------------------------

ALLOWED_CONFIG = ("gateway.internal", ".corp.example", "10.9.8.7")
# (spelling, allowed): names of the port, and names a rebinding page could have
HOSTS = [
    ("localhost", True), ("127.0.0.1", True), ("127.200.3.4", True), ("[::1]", True),
    ("[0:0:0:0:0:0:0:1]", True), ("[::ffff:127.0.0.1]", True), ("a.localhost", True),
    ("x-1.y.localhost", True), ("gateway.internal", True), ("corp.example", True),
    ("a.corp.example", True), ("10.9.8.7", True),
    ("evil.example", False), ("localhost.evil.example", False), ("evil-localhost", False),
    ("localhostx", False), ("127.0.0.1.evil.example", False), ("evil.localhost.example", False),
    ("0x7f.1", False), ("2130706433", False), ("127.1", False), ("0177.0.0.1", False),
    ("127.000.000.001", False), ("[::2]", False), ("10.0.0.1", False), ("[::]", False),
    ("0.0.0.0", False), ("..localhost", False), ("a..localhost", False), ("-a.localhost", False),
    ("a_b.localhost", False), ("evilcorp.example", False), ("corp.example.evil", False),
    ("gateway.internal.evil", False), ("10.9.8.70", False), ("[::ffff:10.0.0.1]", False),
    ("%6cocalhost", False), ("local%2ehost", False), ("localhost%00", False),
    ("xn--localhost", False), ("[fe80::1]", False), ("localhost..", False),
]  # fmt: skip
TEXT = string.ascii_letters + string.digits + string.punctuation + " \t"
MARKERS = ("localhost", "127.", "[", "gateway.internal", "corp.example", "10.9.8.7")


def _random_case(draw: st.DrawFn, text: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if flip else c for c, flip in zip(text, flips, strict=True))


@st.composite
def host_values(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A Host field value and whether it names the port: a known spelling in any case,
    with or without a port, a trailing dot on a name, SP/HTAB padding; or random text."""
    if draw(st.integers(0, 4)) == 0:
        text = draw(st.text(TEXT, max_size=40))
        if any(marker in text.lower() for marker in MARKERS):
            text = "evil.example"  # might spell an allowed name: not for this oracle
        return text.encode(), False
    spelling, allowed = draw(st.sampled_from(HOSTS))
    value = _random_case(draw, spelling)
    if not value.startswith("[") and draw(st.booleans()) and not value.endswith("."):
        value += "."  # a fully qualified name: the same name
    if draw(st.booleans()):
        value += ":" + draw(st.sampled_from(["", "80", "9090", "65535", "1"]))
    pad = st.text(" \t", max_size=3)
    return (draw(pad) + value + draw(pad)).encode(), allowed


@pytest.fixture(scope="module")
def fuzz_port(tmp_path_factory):
    with admin_port(tmp_path_factory.mktemp("rebinding"), allowed=ALLOWED_CONFIG) as port:
        yield port


@fuzz(300)
@given(case=host_values(), target=st.sampled_from(GUARDED))
@example(case=(b"localhost \t", True), target=GUARDED[0])
@example(case=(b"evil.example", False), target=GUARDED[3])
@example(case=(b"127.0.0.1.", True), target=GUARDED[4])
def test_property_only_the_ports_own_names_are_served(fuzz_port, case, target):
    value, allowed = case
    method, path, body = target
    status, answer = send(fuzz_port, value, method, path, body)
    if allowed:
        assert status == 200, (value, path, answer[:300])
    else:
        assert status in (400, 421), (value, path, status)
        assert "detail" in json.loads(answer)
    assert send(fuzz_port, value, path="/ok")[0] == 200  # probes: any Host
