"""``gateway rules explain`` tells the data plane's story, for every request (differential).

For generated requests over the shipped rule table (methods, paths of its rules, and
headers: an API key absent, empty, blank, known, unknown, exactly 256 and over 256 bytes,
padded, with obs-text or control bytes, sent twice, named in Connection; x-user-id;
X-Forwarded-For from trusted and untrusted peers; '_' spellings of headers the gateway
reads; method overrides; bearer tokens), under three configurations (identities as
claimed; known keys with ``unknown: reject``, trusted proxies and kept method overrides;
known keys under another header with ``unknown: anonymous``, JWT users and trusted
proxies), what explain prints — the gateway's own refusal and its status, the rule
chosen, its identity kind and hash, the ceilings applied, the answer besides the count
(401) — is what the data plane's decision code returns for the same bytes:
``Gateway.begin`` and ``Gateway.after_decision`` of the gateway ``gateway serve`` builds
(``running_gateway``), fed what llhttp parses from the request's bytes. Each request is
also sent over TCP to that gateway, whose status must be the one the decision code gave.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import ipaddress
import os
import re
import time
from dataclasses import dataclass, field

import httptools
import jwt as pyjwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hypothesis import given
from hypothesis import strategies as st

from gateway.cli import main
from gateway.counters.memory import MemoryBackend
from gateway.explain import Refused, described_request
from gateway.identity.key_edit import add_key
from gateway.proxy.handler import Gateway
from gateway.proxy.request import Incoming
from gateway.proxy.wire import Answer
from gateway.ratelimit.decision import Outcome
from gateway.ratelimit.limiter import Limiter
from tests.support.fuzz import fuzz
from tests.support.gateway import DEFAULT_RULES, SECRET, running_gateway

ISSUER = "https://idp.example"
AUDIENCE = "gateway"
UUID = "0b6a6a53-4d4c-4b0b-9c0f-54f3c7f6f0a1"
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "BREW"]
# Paths of the shipped table's rules (rules/default.yaml), and some it normalises or refuses.
PATHS = [
    "/ok", "/ready", "/info", "/auth/login", "/v1/beacon/x", "/repos/a/b", "/repository",
    "/runs/batch", "/otel/v1/traces", "/x/charts/1", "/runs/multipart", "/runs/query",
    "/runs//query/", "/runs/query?x=1", "/generate", "/commits/abc", "/sessions/1",
    "/a/trigger", "/runs", f"/runs/{UUID}", f"/api/v1/runs/{UUID}", "/runs/not-a-uuid",
    "/examples/1", "/feedback", "/public/download/x", "/runs/stats", "/x",
    "/a/v1/metadata/submit", "/a;b", "/a%2Fb", "/%7Erepos",
]  # fmt: skip
PEERS = ["203.0.113.7", "198.51.100.3", "10.0.0.5", "2001:db8::1", "2001:db8:aaaa::9",
         "::ffff:203.0.113.9"]  # fmt: skip
FORWARDED = [b"198.51.100.9", b"10.0.0.7, 203.0.113.50", b"garbage", b"", b"2001:db8::77",
             b"10.0.0.1, 10.0.0.2"]  # fmt: skip
OVERRIDES = [b"X-HTTP-Method-Override", b"x-http-method", b"X-Method-Override"]
OVERRIDE_VALUES = [b"GET", b"PUT", b"DELETE", b"delete", b"GET", b"BREW", b""]
# '_' spellings of headers the gateway reads or manages, and one it does not (relayed).
UNDERSCORED = [b"x_api_key", b"X_User_Id", b"x_forwarded-for", b"x_http_method_override",
               b"x_consumer_key", b"transfer_encoding", b"x_trace_id"]  # fmt: skip
CONNECTION = [b"close", b"x-api-key", b"x-consumer-key, x-user-id", b"X-HTTP-Method-Override",
              b"authorization"]  # fmt: skip


@dataclass
class Plane:
    """One configuration: the data plane gateway serve builds, and explain's arguments."""

    name: str
    gateway: Gateway
    port: int
    loop: asyncio.AbstractEventLoop
    args: list[str]
    keys: list[bytes]  # known keys
    key_names: list[bytes]  # header names a key is sent in (the configured one first)
    tokens: list[bytes] = field(default_factory=list)  # Authorization values


def _token(private: rsa.RSAPrivateKey, **claims: object) -> bytes:
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": int(time.time()) + 3600}
    return b"Bearer " + pyjwt.encode({**body, **claims}, private, algorithm="RS256").encode()


@pytest.fixture(scope="module")
def planes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("explain")
    keys = tmp / "keys.yaml"
    known = [add_key(keys, "acme").encode(), add_key(keys, "beta", "gold").encode()]
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp / "idp.pem").write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    configs = {
        "claimed": None,
        "reject": (
            f"identity:\n  api_key: {{keys: {keys}, unknown: reject}}\n"
            "trusted_proxies: [10.0.0.0/8]\nkeep_method_override: true\n"
        ),
        "anonymous": (
            f"identity:\n  api_key: {{keys: {keys}, header: x-consumer-key}}\n"
            f"  user:\n    invalid: anonymous\n    jwt:\n      public_key_file: {tmp / 'idp.pem'}\n"
            f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      tier_claim: tier\n"
            "      algorithms: [RS256]\n"
            "trusted_proxies: [10.0.0.0/8, '2001:db8:aaaa::/48']\n"
        ),
    }
    tokens = [
        _token(private),
        _token(private, sub="bob", tier="gold"),
        _token(private, aud="other"),
        _token(private, exp=int(time.time()) - 3600),
        b"Bearer not.a.token",
        b"Basic dXNlcjpwYXNz",
    ]
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    out: dict[str, Plane] = {}
    with pytest.MonkeyPatch.context() as env:
        # explain reads the environment as gateway serve does: only the secret here.
        for name in [n for n in os.environ if n.startswith("GATEWAY_")]:
            env.delenv(name)
        env.setenv("GATEWAY_IDENTITY_SECRET", SECRET.decode())
        try:
            for name, text in configs.items():
                config = None
                args = ["--rules", DEFAULT_RULES]
                if text is not None:
                    config = tmp / f"{name}.yaml"
                    config.write_text(text)
                    args += ["--config", str(config)]
                gw = loop.run_until_complete(
                    stack.enter_async_context(
                        running_gateway(None, config_file=None if config is None else str(config))
                    )
                )
                key_names = [b"x-consumer-key", b"x-api-key"] if name == "anonymous" else [
                    b"x-api-key", b"X-API-Key"]  # fmt: skip
                out[name] = Plane(
                    name, gw.gateway, int(gw.url.rsplit(":", 1)[1]), loop, args, known, key_names,
                    tokens if name == "anonymous" else [],
                )  # fmt: skip
            yield out
        finally:
            loop.run_until_complete(stack.aclose())
            loop.close()


# --- what the data plane decides


@dataclass(frozen=True)
class Story:
    """What happens to one request, as either side tells it."""

    refused: int | None = None  # the gateway answers before any rule, with this status
    own: bool = False  # the gateway answers it itself (/ok, /ready): no rule counts it
    rule: str | None = None  # the enforced rule (None: none applies)
    kind: str | None = None  # its identity kind
    identity: str | None = None  # its identity hash
    exempt: bool = False
    ceilings: tuple[tuple[str, str], ...] = ()  # (ceiling id, identity hash)
    answer: int | None = None  # answered so once the count lets it through (401)


def _wire(method: str, target: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    lines = [f"{method} {target} HTTP/1.1".encode()]
    lines += [name + b": " + value for name, value in headers]
    if not any(name.lower() == b"host" for name, _ in headers):
        lines.append(b"Host: localhost")  # (explain's default Host)
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Head:
    """What llhttp reports of a request head, as the data plane's connection keeps it
    (trailing SP/HTAB off a value: gateway/proxy/server.py, on_header)."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value.rstrip(b" \t")))


def _fresh_counters(gateway: Gateway) -> None:
    """Counting is not what is compared: every request meets empty counters."""
    gateway.limiter = Limiter({name: MemoryBackend() for name in gateway.backends})


def dataplane_story(plane: Plane, wire: bytes, peer: str) -> Story:
    head = _Head()
    parser = httptools.HttpRequestParser(head)
    try:
        parser.feed_data(wire)
    except httptools.HttpParserUpgrade:
        pass
    except httptools.HttpParserError:
        return Story(refused=400)  # llhttp's refusal: the connection answers 400
    req = Incoming()
    req.method = parser.get_method().decode("ascii")
    req.target, req.headers = head.url, head.headers
    gateway = plane.gateway
    _fresh_counters(gateway)
    answer = gateway.begin(req, gateway.peer(peer))
    if answer is not None:
        if answer.status < 400 or b"Cache-Control: no-store" in answer.head:  # /ok, /ready
            return Story(own=True)
        return Story(refused=answer.status)
    selection = req.selection
    assert selection is not None
    decision = req.decision
    if decision is None:
        decision = plane.loop.run_until_complete(gateway.decide(req))
    assert decision.outcome is not Outcome.LIMITED, "fresh counters refused a request"
    step = gateway.after_decision(req, decision)
    # An Answer here is the identity refusal (401, or 429 for spent token checks) or the
    # 404 of a gateway without an upstream (what it forwards, it forwards to none here).
    status = step.status if isinstance(step, Answer) and step.status != 404 else None
    rule = selection.rule
    return Story(
        rule=None if rule is None else rule.id,
        kind=None if rule is None else rule.identity.value,
        identity=selection.identity,
        exempt=selection.exempt,
        ceilings=tuple((c.id, key) for c, key in selection.ceilings),
        answer=status,
    )


async def _status_over_tcp(port: int, wire: bytes) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(wire)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    return int(status_line.split()[1])


# --- what explain says

_REGION = "us"  # the data plane's (default) region


def explain_story(plane: Plane, method: str, target: str, headers: list[str], peer: str) -> Story:
    out, err = io.StringIO(), io.StringIO()
    args = ["rules", "explain", method, target, "--client-ip", peer, "--region", _REGION]
    for header in headers:
        args += ["-H", header]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*args, *plane.args])
    if code != 0:
        found = re.search(r"the gateway refuses this request \((\d+)\)", err.getvalue())
        assert found, (code, err.getvalue())
        return Story(refused=int(found[1]))
    return parse_explanation(out.getvalue())


def parse_explanation(text: str) -> Story:
    if re.search(r"^answered by the gateway itself \(\d+\)", text, re.M):
        return Story(own=True)
    answer = re.search(r"^answer: (\d+) ", text, re.M)
    block = text.split(f"\nregion {_REGION}:\n", 1)[1]
    rule = kind = identity = None
    exempt = False
    ceilings: list[tuple[str, str]] = []
    lines = block.splitlines()
    for n, line in enumerate(lines):
        matched = re.match(r"  = (\S+): MATCHES(, exempt)?", line)
        if matched:
            rule, exempt = matched[1], bool(matched[2])
            for after in lines[n + 1 :]:
                said = re.match(r"      identity: (\S+) -> (\S+)", after)
                if said:
                    kind, identity = said[1], said[2]
                    break
                if not after.startswith("      "):
                    break
        applied = re.match(r"  \+ (\S+): APPLIES", line)
        if applied:
            said = re.match(r"      identity: \S+ -> (\S+)", lines[n + 1])
            assert said, lines[n + 1]
            ceilings.append((applied[1], said[1]))
    if rule is None:
        assert "  no rule matches: the request is not limited" in lines, text
    return Story(
        rule=rule,
        kind=kind,
        identity=identity,
        exempt=exempt,
        ceilings=tuple(ceilings),
        answer=None if answer is None else int(answer[1]),
    )


# --- the requests


def _key_values(plane: Plane) -> st.SearchStrategy[bytes]:
    known = plane.keys
    usable = [*known, *known, b"sk-unknown-1", b"  " + known[0] + b" \t", b"\t" + known[1],
              known[0] + b"x", b"k e y", b"R" * 256]  # fmt: skip
    no_identity = [b"", b"   ", b"\t", b"R" * 257, b"R" * 600, b"\x80" * 300]
    refused = [b"\x80abc", "é".encode() * 3, b"a\x01b", b"a\x7fb"]
    return st.sampled_from([usable, usable, usable, no_identity, no_identity, refused]).flatmap(
        st.sampled_from
    )


USER_VALUES = [b"u1", b"alice", b"  u2 ", b"", b"U" * 257, b"u1", b"\xffu", b"user\x0bx"]


def _rarely(draw, n: int) -> bool:
    """True once in ``n`` draws (st.integers would favour its bounds)."""
    return draw(st.sampled_from([False] * (n - 1) + [True]))


@st.composite
def requests(draw, plane: Plane) -> tuple[str, str, list[tuple[bytes, bytes]], str]:
    method = draw(st.sampled_from(["GET", "POST"] if not _rarely(draw, 3) else METHODS))
    path = draw(st.sampled_from(PATHS))
    headers: list[tuple[bytes, bytes]] = []
    for _ in range(2 if _rarely(draw, 12) else draw(st.sampled_from([0, 1, 1, 1]))):
        headers.append((draw(st.sampled_from(plane.key_names)), draw(_key_values(plane))))
    if draw(st.booleans()):
        headers.append((draw(st.sampled_from([b"x-user-id", b"X-User-Id"])),
                        draw(st.sampled_from(USER_VALUES))))  # fmt: skip
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        headers.append((b"X-Forwarded-For", draw(st.sampled_from(FORWARDED))))
    if _rarely(draw, 3):
        headers.append((draw(st.sampled_from(OVERRIDES)), draw(st.sampled_from(OVERRIDE_VALUES))))
    if _rarely(draw, 8):
        headers.append((draw(st.sampled_from(UNDERSCORED)), b"5"))
    if _rarely(draw, 6):
        headers.append((b"Connection", draw(st.sampled_from(CONNECTION))))
    if plane.tokens and draw(st.booleans()):
        headers.append((b"Authorization", draw(st.sampled_from(plane.tokens))))
    headers = list(draw(st.permutations(headers)))
    return method, path, headers, draw(st.sampled_from(PEERS))


def _as_described(headers: list[tuple[bytes, bytes]]) -> list[str]:
    """The -H arguments for the same bytes (a command line carries bytes that are not
    UTF-8 as surrogate escapes, which explain sends back as they were)."""
    return [(name + b": " + value).decode("utf-8", "surrogateescape") for name, value in headers]


TRUSTED = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8:aaaa::/48")]


def _compare_over_tcp(plane: Plane, wire: bytes, peer: str, expected: Story) -> None:
    """The same bytes to the running gateway: the status is the one the decision code
    gave. (Its TCP peer is 127.0.0.1, untrusted: compared for untrusted peers only, the
    rest of the story being the same for any of them but the counted address.)"""
    if any(ipaddress.ip_address(peer) in net for net in TRUSTED):
        return
    _fresh_counters(plane.gateway)
    status = plane.loop.run_until_complete(_status_over_tcp(plane.port, wire))
    if expected.refused is not None:
        assert status == expected.refused, (wire, status)
    elif expected.own:
        assert status in (200, 503), (wire, status)
    elif expected.answer is not None:
        assert status == expected.answer, (wire, status)
    else:  # forwarded (to no upstream: 404), or /info answered by the gateway
        assert status in (404, 200), (wire, status)


CASES = fuzz(120)


def _run(plane: Plane, request) -> None:
    method, path, headers, peer = request
    wire = _wire(method, path, headers)
    expected = dataplane_story(plane, wire, peer)
    told = explain_story(plane, method, path, _as_described(headers), peer)
    assert told == expected, (plane.name, method, path, headers, peer)
    _compare_over_tcp(plane, wire, peer, expected)


@pytest.mark.parametrize("name", ["claimed", "reject", "anonymous"])
def test_explain_tells_what_the_data_plane_decides(planes, name):
    plane = planes[name]

    @CASES
    @given(request=requests(plane))
    def check(request) -> None:
        _run(plane, request)

    check()


# --- the reported cases, by name

OVER = b"R" * 257


@pytest.mark.parametrize(
    ("value", "answer"),
    [(b"", 401), (b"   ", 401), (OVER, 401), (b"R" * 600, 401), (b"\x80" * 300, 401),
     (b"sk-unknown-1", 401), (b"\x80abc", None)],
)  # fmt: skip
def test_a_key_forming_no_identity_is_explained_as_unknown(planes, value, answer):
    """The defect: with verified keys and ``unknown: reject`` an empty or over-long key is
    an unknown key (401 once counted per address), not an absent one."""
    plane = planes["reject"]
    headers = [(b"x-api-key", value)]
    expected = dataplane_story(plane, _wire("POST", "/runs/query", headers), "203.0.113.7")
    told = explain_story(plane, "POST", "/runs/query", _as_described(headers), "203.0.113.7")
    assert told == expected
    if answer is None:
        assert told.refused == 400  # not printable ASCII: refused, as the data plane does
    else:
        assert told.answer == answer and told.rule == "catch-all" and told.kind == "ip"


def test_the_cli_says_why(planes):
    plane = planes["reject"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["rules", "explain", "POST", "/runs/query", "-H", "x-api-key: " + "R" * 257,
                     "--region", "us", *plane.args])  # fmt: skip
    text = out.getvalue()
    assert code == 0
    assert "identity: the API key is unknown: answered 401 after its per-address count" in text
    assert "answer: 401 once the rule below lets it through (never forwarded): unknown API key" in (
        text
    )
    assert "= catch-all: MATCHES" in text
    for refused, detail in [
        (["-H", "x_api_key: 5"], "header 'x_api_key' is refused"),
        (["-H", "x-api-key: a", "-H", "x-api-key: b"], "send one x-api-key header, not 2"),
        (["-H", "x-http-method-override: BREW"], "names no method accepted here"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["rules", "explain", "POST", "/runs/query", *refused, *plane.args])
        assert code == 2 and "the gateway refuses this request (400)" in err.getvalue()
        assert detail in err.getvalue(), err.getvalue()


def test_a_kept_override_and_a_trusted_proxy_are_explained(planes):
    plane = planes["reject"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main([
            "rules", "explain", "POST", f"/runs/{UUID}", "-H", "X-HTTP-Method-Override: GET",
            "-H", "X-Forwarded-For: 198.51.100.9", "--client-ip", "10.0.0.5", "--region", "us",
            "--api-key", plane.keys[0].decode(), *plane.args,
        ])  # fmt: skip
    text = out.getvalue()
    assert code == 0
    assert f"request: GET /runs/{UUID}" in text and "kept method override (POST sent)" in text
    assert "= run-lookup: MATCHES" in text and "known API key of consumer acme" in text
    story = parse_explanation(text)
    headers = [(b"X-HTTP-Method-Override", b"GET"), (b"X-Forwarded-For", b"198.51.100.9"),
               (b"x-api-key", plane.keys[0])]  # fmt: skip
    assert story == dataplane_story(plane, _wire("POST", f"/runs/{UUID}", headers), "10.0.0.5")


def test_api_key_names_the_configured_header(planes):
    plane = planes["anonymous"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["rules", "explain", "GET", "/x", "--region", "us", "--api-key",
              plane.keys[1].decode(), *plane.args])  # fmt: skip
    text = out.getvalue()
    assert "known API key of consumer beta, tier gold" in text
    assert "= default-api-key: MATCHES" in text


def test_described_headers_are_the_bytes_llhttp_reads():
    method, target, headers = described_request(
        "post", "/a?b=1", ["X-Api-Key:   k e y \t", "x-user-id: \u00e9", "Host: h"]
    )
    assert (method, target) == ("POST", b"/a?b=1")
    assert headers == [(b"X-Api-Key", b"k e y"), (b"x-user-id", "\u00e9".encode()), (b"Host", b"h")]
    with pytest.raises(Refused) as refused:
        described_request("GET", "/", ["x-api-key: a\x01b"])
    assert refused.value.status == 400
    for bad in (["x-api-key: a\r\nx-user-id: b"], ["no colon"]):
        with pytest.raises(ValueError):
            described_request("GET", "/", bad)
    with pytest.raises(ValueError, match="line break"):
        described_request("GET", "/\r\nx-api-key: a", [])


def test_explain_keys_its_hashes_as_the_gateway_does(tmp_path, monkeypatch):
    """The identity secret comes from the config file (or GATEWAY_IDENTITY_SECRET), else
    from the data dir's file, as ``gateway serve`` finds it, and explaining never makes
    one: the hashes it prints are those of the gateway's logs."""
    from gateway.policy.model import IdentityKind
    from gateway.ratelimit.identity import IdentityHasher

    monkeypatch.delenv("GATEWAY_IDENTITY_SECRET", raising=False)
    monkeypatch.delenv("GATEWAY_DATA_DIR", raising=False)
    secret = "0123456789abcdef0123456789abcdef"
    key = "sk-explained-key"

    def explained(config_text: str) -> str:
        config = tmp_path / "gateway.yaml"
        config.write_text(config_text)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = main(["rules", "explain", "GET", "/repos/a", "--api-key", key,
                         "--region", "us", "--config", str(config)])  # fmt: skip
        assert code == 0, out.getvalue()
        return out.getvalue()

    text = explained(f'identity_secret: "{secret}"\ndata_dir: {tmp_path / "d1"}\n')
    assert "identity hashes keyed with identity_secret" in text
    assert IdentityHasher(secret.encode()).digest(IdentityKind.API_KEY, key) in text
    assert not (tmp_path / "d1").exists()  # nothing made

    data_dir = tmp_path / "d2"
    data_dir.mkdir()
    (data_dir / "identity-secret").write_text("fedcba9876543210fedcba9876543210\n")
    text = explained(f"data_dir: {data_dir}\n")
    assert f"identity hashes keyed with {data_dir / 'identity-secret'}" in text
    assert (
        IdentityHasher(b"fedcba9876543210fedcba9876543210").digest(IdentityKind.API_KEY, key)
        in text
    )

    text = explained(f"data_dir: {tmp_path / 'd3'}\n")
    assert "a throwaway secret" in text and not (tmp_path / "d3").exists()
