"""Issue 25, items 2 and 3 on the request path: known API keys counted per consumer,
unknown keys counted per address (or refused 401, itself counted per address), users
only from verified JWTs, x-user-id only from trusted proxies. Real gateway, real
upstreams on loopback, keys and tokens made in the test."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import uuid

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from prometheus_client import generate_latest

from gateway.identity.key_edit import add_key
from tests.support.gateway import running_gateway
from tests.support.raw_upstream import running_raw_upstream

ISSUER = "https://idp.test"
AUDIENCE = "my-api"


def _port(gw) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def _get(port: int, path: str = "/x", *headers: bytes, source: str = "127.0.0.1"):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    fields = b"".join(h + b"\r\n" for h in headers)
    start = b"GET " + path.encode() + b" HTTP/1.1\r\nHost: a\r\n"
    writer.write(start + fields + b"Connection: close\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), fields, body


def _remaining(fields) -> tuple[str, int]:
    first = fields["ratelimit"].split(",")[0]
    name, _, rest = first.partition(";")
    return name, int(dict(p.split("=") for p in rest.split(";"))["r"])


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    acme1 = add_key(path, "acme")
    acme2 = add_key(path, "acme")
    gold = add_key(path, "beta", "gold")
    return path, acme1, acme2, gold


def _config(tmp_path, section: str) -> str:
    config = tmp_path / "gateway.yaml"
    config.write_text(section)
    return str(config)


async def test_the_keys_of_one_consumer_share_its_counters(tmp_path, upstream, keys_file):
    path, acme1, acme2, _ = keys_file
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}}}\n")
    async with running_gateway(upstream, config_file=config) as gw:
        _, f1, body = await _get(_port(gw), "/x", b"x-api-key: " + acme1.encode())
        _, f2, _ = await _get(_port(gw), "/x", b"x-api-key: " + acme2.encode())
        name1, r1 = _remaining(f1)
        name2, r2 = _remaining(f2)
        assert name1 == name2 == '"default-api-key"'
        assert r2 == r1 - 1  # rotating to the consumer's other key resets nothing
        # the key itself is still what the upstream receives
        assert json.loads(body)["headers"]["x-api-key"] == acme1
        # an unknown key is counted as a request without one: by address
        _, f3, _ = await _get(_port(gw), "/x", b"x-api-key: not-a-known-key")
        assert _remaining(f3)[0] == '"catch-all"'


async def test_unknown_keys_are_refused_and_counted_per_address(tmp_path, keys_file):
    path, acme1, _, _ = keys_file
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}, unknown: reject}}\n")
    async with running_raw_upstream() as up, running_gateway(up.url, config_file=config) as gw:
        statuses = []
        for _ in range(105):  # the catch-all: 100/60 per address
            status, fields, body = await _get(
                _port(gw), "/x", b"x-api-key: k-" + uuid.uuid4().hex.encode(), source="127.0.0.2"
            )
            statuses.append(status)
            if status == 401:
                assert fields["www-authenticate"].startswith("ApiKey")
                assert "unknown API key" in json.loads(body)["detail"]
        assert statuses == [401] * 100 + [429] * 5
        assert not up.recording.requests  # key spraying cost the upstream nothing
        # another address, and a known key, are served
        known = b"x-api-key: " + acme1.encode()
        status, _, _ = await _get(_port(gw), "/x", known, source="127.0.0.3")
        assert status == 200
        assert len(up.recording.requests) == 1


async def test_a_key_added_under_traffic_is_known_without_a_restart(tmp_path, upstream, keys_file):
    path, *_ = keys_file
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}, unknown: reject}}\n")
    async with running_gateway(
        upstream, config_file=config, watch_rules=True, watch_interval=0.1
    ) as gw:
        fresh = add_key(path, "newcomer")
        deadline = time.monotonic() + 10
        while True:
            status, _, _ = await _get(_port(gw), "/x", b"x-api-key: " + fresh.encode())
            if status == 200 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert status == 200
        path.write_text("keys: [{sha256: nothex}]\n")  # a bad edit: refused, old set kept
        await asyncio.sleep(0.5)
        status, _, _ = await _get(_port(gw), "/x", b"x-api-key: " + fresh.encode())
        assert status == 200
        # the operator's /info says so, without a key or a digest
        shown = (await gw.proxy.info())["identity"]["api_keys"]
        assert shown["keys"] == 4 and shown["consumers"] == 3
        assert shown["last_reload_error"]  # the bad edit, refused whole
        assert fresh not in json.dumps(shown)


@pytest.fixture
def signing_key(tmp_path):
    private = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = private.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    (tmp_path / "idp.pem").write_bytes(pem)
    return private, pem


def _token(private, **claims) -> bytes:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "sub": "alice", "exp": now + 300, **claims}
    return jwt.encode(body, private, algorithm="RS256").encode()


def _hs256(claims: dict, secret: bytes) -> bytes:
    def part(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = (
        part(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
        + b"."
        + part(json.dumps(claims).encode())
    )
    return signing_input + b"." + part(hmac.new(secret, signing_input, hashlib.sha256).digest())


def _jwt_config(tmp_path, invalid: str = "reject") -> str:
    return _config(
        tmp_path,
        "identity:\n  user:\n    invalid: " + invalid + "\n    jwt:\n"
        f"      public_key_file: {tmp_path / 'idp.pem'}\n"
        f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      algorithms: [RS256]\n",
    )


async def test_users_come_only_from_verified_tokens(tmp_path, upstream, signing_key):
    private, pem = signing_key
    async with running_gateway(upstream, config_file=_jwt_config(tmp_path)) as gw:
        port = _port(gw)
        good = b"Authorization: Bearer " + _token(private)
        _, f1, _ = await _get(port, "/x", good)
        _, f2, _ = await _get(port, "/x", good, b"x-user-id: mallory")  # claimed: ignored
        assert _remaining(f1)[0] == _remaining(f2)[0] == '"default-user"'
        assert _remaining(f2)[1] == _remaining(f1)[1] - 1
        # x-user-id alone, from an untrusted peer, identifies nobody: counted by address
        _, f3, _ = await _get(port, "/x", b"x-user-id: mallory")
        assert _remaining(f3)[0] == '"catch-all"'
        # bad tokens: 401 with a Bearer challenge, never forwarded
        expired = _token(private, exp=int(time.time()) - 3600)
        # HS256 "signed" with the RSA public key as its secret (PyJWT will not make one)
        confused = _hs256(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "eve", "exp": int(time.time()) + 300}, pem
        )
        unsigned = jwt.encode(
            {"iss": ISSUER, "aud": AUDIENCE, "sub": "eve", "exp": int(time.time()) + 300},
            None,
            algorithm="none",
        ).encode()
        for bad in (
            expired,
            confused,
            unsigned,
            _token(private, iss="https://evil.test"),
            _token(private, aud="other"),
            _token(private)[:-4] + b"AAAA",
        ):
            status, fields, body = await _get(port, "/x", b"Authorization: Bearer " + bad)
            assert status == 401, (bad, body)
            assert fields["www-authenticate"].startswith("Bearer")
        # two tokens: upstreams disagree about which one counts
        status, _, _ = await _get(port, "/x", good, good)
        assert status == 400


async def test_invalid_tokens_counted_as_anonymous_when_so_configured(
    tmp_path, upstream, signing_key
):
    private, _ = signing_key
    config = _jwt_config(tmp_path, invalid="anonymous")
    async with running_gateway(upstream, config_file=config) as gw:
        bad = _token(private, exp=int(time.time()) - 3600)
        status, fields, _ = await _get(_port(gw), "/x", b"Authorization: Bearer " + bad)
        assert status == 200 and _remaining(fields)[0] == '"catch-all"'


CEILING = """
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 50/60, eu: 50/60}
"""
# Beside the default table's own per-address ceiling (36000/10, which 1,000 requests do
# not reach): a tighter one of the test's.
SPRAY_CEILING = CEILING.replace("per-address", "spray-guard")


async def test_key_spraying_is_held_to_the_per_address_ceiling(tmp_path, upstream):
    """1,000 requests from one address with 1,000 random keys: each key is a fresh
    per-key quota, but the ceiling counts the address whatever key is sent."""
    from tests.support.gateway import DEFAULT_RULES

    (tmp_path / "ceilings.yaml").write_text(SPRAY_CEILING)
    rules = [DEFAULT_RULES, str(tmp_path / "ceilings.yaml")]
    async with running_gateway(upstream, rules=rules) as gw:
        statuses = []
        for _ in range(1000):
            key = b"x-api-key: k-" + uuid.uuid4().hex.encode()
            status, fields, _ = await _get(_port(gw), "/x", key, source="127.0.0.2")
            statuses.append(status)
            if status == 429:
                assert fields["ratelimit"].startswith('"spray-guard";r=0;')
        assert statuses.count(200) == 50 and statuses.count(429) == 950
        # another address is served, and its RateLimit-Policy lists both policies
        status, fields, _ = await _get(_port(gw), "/x", b"x-api-key: k", source="127.0.0.3")
        assert status == 200
        assert fields["ratelimit-policy"] == (
            '"default-api-key";q=1000;w=10, "per-address";q=36000;w=10, "spray-guard";q=50;w=60'
        )


async def test_key_spraying_with_reject_costs_the_upstream_nothing(tmp_path, keys_file):
    from tests.support.gateway import DEFAULT_RULES

    path, *_ = keys_file
    (tmp_path / "ceilings.yaml").write_text(SPRAY_CEILING)
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}, unknown: reject}}\n")
    rules = [DEFAULT_RULES, str(tmp_path / "ceilings.yaml")]
    async with running_raw_upstream() as up:
        async with running_gateway(up.url, rules=rules, config_file=config) as gw:
            statuses = []
            for _ in range(1000):
                key = b"x-api-key: k-" + uuid.uuid4().hex.encode()
                status, _, _ = await _get(_port(gw), "/x", key, source="127.0.0.2")
                statuses.append(status)
        assert statuses.count(401) == 50 and statuses.count(429) == 950
        assert not up.recording.requests


def test_rules_explain_says_which_consumer_tier_user_and_ceilings_apply(
    tmp_path, keys_file, signing_key
):
    import subprocess
    import sys

    path, acme1, _, gold = keys_file
    private, _ = signing_key
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n"
        "  - id: per-key\n    identity: api_key\n    limits: {us: 5/60}\n"
        "    tiers: {gold: {us: 50/60}}\n"
        "  - id: per-user\n    identity: user_ip\n    limits: {us: 7/60}\n"
        "  - id: per-ip\n    identity: ip\n    limits: {us: 100/60}\n" + CEILING
    )
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"identity:\n  api_key: {{keys: {path}, unknown: reject}}\n  user:\n    jwt:\n"
        f"      public_key_file: {tmp_path / 'idp.pem'}\n"
        f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      algorithms: [RS256]\n"
    )

    def explain(*extra: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "rules", "explain", "GET", "/x", "--rules",
             str(rules), "--config", str(config), "--region", "us", *extra],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert gold not in done.stdout and acme1 not in done.stdout  # never a key
        return done.stdout

    out = explain("--api-key", gold)
    assert "known API key of consumer beta, tier gold" in out
    assert "tier: gold (policy per-key.gold)" in out and "50/60" in out
    assert "+ per-address: APPLIES" in out
    out = explain("--api-key", "not-known")
    assert "unknown: answered 401" in out and "= per-ip: MATCHES" in out
    out = explain("--token", _token(private).decode())
    assert "verified token of user alice" in out and "= per-user: MATCHES" in out
    out = explain("--token", _token(private, aud="other").decode())
    assert "does not verify (audience)" in out


async def test_a_key_header_of_another_name_is_still_a_key(tmp_path, upstream, keys_file):
    path, acme1, _, _ = keys_file
    config = _config(
        tmp_path, f"identity:\n  api_key: {{header: x-key, keys: {path}, unknown: reject}}\n"
    )
    async with running_gateway(upstream, config_file=config) as gw:
        status, fields, _ = await _get(_port(gw), "/x", b"x-key: " + acme1.encode())
        assert status == 200 and _remaining(fields)[0] == '"default-api-key"'
        status, _, _ = await _get(_port(gw), "/x", b"x-key: unknown")
        assert status == 401
        # x-api-key is now just a header like any other
        status, fields, _ = await _get(_port(gw), "/x", b"x-api-key: " + acme1.encode())
        assert status == 200 and _remaining(fields)[0] == '"catch-all"'


async def test_an_untrusted_x_user_id_is_neither_counted_nor_passed_on(tmp_path, upstream):
    config = _config(tmp_path, "identity:\n  user: {header_from: trusted}\n")
    async with running_gateway(upstream, config_file=config) as gw:
        status, fields, body = await _get(_port(gw), "/x", b"x-user-id: mallory")
        assert status == 200 and _remaining(fields)[0] == '"catch-all"'
        assert "x-user-id" not in {k.lower() for k in json.loads(body)["headers"]}


async def test_a_refusal_of_one_tier_is_not_replayed_to_another(tmp_path, upstream, keys_file):
    path, acme1, _, gold = keys_file
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - id: per-ip\n    identity: ip\n    limits: {us: 2/60}\n"
        "    tiers: {gold: {us: 1000/60}}\n"
    )
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}}}\n")
    async with running_gateway(upstream, rules=[str(rules)], config_file=config) as gw:
        free = b"x-api-key: " + acme1.encode()
        assert [(await _get(_port(gw), "/x", free))[0] for _ in range(4)] == [200, 200, 429, 429]
        status, fields, _ = await _get(_port(gw), "/x", b"x-api-key: " + gold.encode())
        assert status == 200 and _remaining(fields)[0] == '"per-ip.gold"'


@pytest.mark.parametrize("mode", ["plain", "json"])
async def test_the_access_log_and_metrics_carry_consumer_and_tier_never_the_key(
    tmp_path, upstream, keys_file, caplog, mode
):
    from gateway.replay.records import parse_line

    path, acme1, _, gold = keys_file
    config = _config(tmp_path, f"identity:\n  api_key: {{keys: {path}}}\n")
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with running_gateway(upstream, config_file=config, access_log=mode) as gw:
            for key in (gold, acme1, "not-a-known-key"):
                assert (await _get(_port(gw), "/x", b"x-api-key: " + key.encode()))[0] == 200
            gw.proxy.gateway.access_log.flush()
            scraped = generate_latest(gw.metrics.registry).decode()
    lines = [
        line
        for r in caplog.records
        if r.name == "gateway.access"
        for line in r.getMessage().splitlines()
    ]
    assert len(lines) == 3
    for line in lines:
        assert gold not in line and acme1 not in line and "not-a-known-key" not in line
    if mode == "json":
        parsed = [json.loads(line) for line in lines]
        assert [(p["consumer"], p["tier"]) for p in parsed] == [
            ("beta", "gold"), ("acme", None), (None, None)
        ]  # fmt: skip
    else:
        assert lines[0].endswith(" consumer=beta tier=gold")
        assert lines[1].endswith(" consumer=acme tier=-")
        assert "consumer=" not in lines[2]  # an unknown key verifies no consumer
    # a replay reads the tier back (it picks the rule's tier limits)
    assert [parse_line(line, {}).tier for line in lines] == ["gold", None, None]
    assert (
        'gateway_consumer_requests_total{consumer="beta",decision="allowed",region="us",'
        'tier="gold"} 1.0' in scraped
    )
    assert 'consumer="acme"' in scraped and "not-a-known-key" not in scraped


async def test_a_repeated_token_is_verified_once_and_not_past_its_expiry(
    tmp_path, upstream, signing_key
):
    private, _ = signing_key
    config = _config(
        tmp_path,
        "identity:\n  user:\n    jwt:\n"
        f"      public_key_file: {tmp_path / 'idp.pem'}\n      leeway_seconds: 0\n"
        f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      algorithms: [RS256]\n",
    )
    async with running_gateway(upstream, config_file=config) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        port = _port(gw)
        # 3-4 s ahead (exp is whole seconds): the five requests must all come before it,
        # also on a slow, loaded machine, and the wait for it to pass stays short.
        soon = int(time.time()) + 4
        token = b"Authorization: Bearer " + _token(private, exp=soon)
        for _ in range(5):
            status, fields, _ = await _get(port, "/x", token)
            assert status == 200 and _remaining(fields)[0] == '"default-user"', (
                status,
                soon - time.time(),
            )
        # one signature check, and the repeats answered before the verifier's own cache
        assert verifier.stats.signature_checks == 1 and verifier.stats.cache_hits == 0
        while time.time() < soon + 0.5:
            await asyncio.sleep(0.1)
        status, fields, _ = await _get(port, "/x", token)  # expired: never from a cache
        assert status == 401 and fields["www-authenticate"].startswith("Bearer")


async def test_a_rotated_out_keys_tokens_stop_working_at_once(tmp_path, upstream, signing_key):
    """The request path keeps its own cache of verified tokens (by their SHA-256); a
    change of the keys voids it, as it voids the verifier's: a token of a key removed
    from the key set is refused on its next use, not at its own exp (which may be far
    off: a far-future token minted with a leaked key must die with the key)."""
    private, _ = signing_key
    async with running_gateway(upstream, config_file=_jwt_config(tmp_path)) as gw:
        port = _port(gw)
        token = b"Authorization: Bearer " + _token(private, exp=int(time.time()) + 10**8)
        for _ in range(2):  # the second from the cache
            status, fields, _ = await _get(port, "/x", token)
            assert status == 200 and _remaining(fields)[0] == '"default-user"'
        rotated = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        (tmp_path / "idp.pem").write_bytes(
            rotated.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        verifier = gw.proxy.gateway.verified.tokens
        assert await verifier.refresh()
        status, fields, _ = await _get(port, "/x", token)
        assert status == 401, fields
        fresh = b"Authorization: Bearer " + _token(rotated)
        status, fields, _ = await _get(port, "/x", fresh)
        assert status == 200 and _remaining(fields)[0] == '"default-user"'
