"""The CPU that verifying tokens that fail may take is bounded per client address and in
all (one client must not starve the others). A token the gateway has not seen is
verified before the request is counted, so without a budget a client sending fresh
forged tokens spends the worker's CPU on parsing and public-key operations however low
its limits are. 127.0.0.2 attacks; 127.0.0.3 must still be served. The verifier's own
tests use fake clocks; the gateway's, real sockets and real CPU time."""

from __future__ import annotations

import itertools
import time

import pytest
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from prometheus_client import generate_latest

from gateway.identity.config import parse_identity_config
from gateway.identity.jwt import InvalidToken, JwtVerifier
from tests.integration.test_verified_identities import (
    AUDIENCE,
    ISSUER,
    _config,
    _get,
    _port,
    _remaining,
    _token,
)
from tests.support.gateway import running_gateway

ATTACKER = "127.0.0.2"
CLIENT = "127.0.0.3"
MS = 0.001
# What one forged token of these tests may cost to verify at most (CPU time, charged in
# full when it starts with budget left): a 4 KB RS256 token takes well under 1 ms.
ONE_TOKEN = 20 * MS
TICK = 1.001 * MS


@pytest.fixture
def keys(tmp_path):
    """The IdP's key (its public half in idp.pem) and a stranger's, whose tokens fail."""
    idp = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (tmp_path / "idp.pem").write_bytes(
        idp.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return idp, rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _section(tmp_path, per_client_ms: float, total_ms: float, extra: str = "") -> str:
    return (
        "identity:\n  user:\n" + extra + "    jwt:\n"
        f"      public_key_file: {tmp_path / 'idp.pem'}\n"
        f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      algorithms: [RS256]\n"
        f"      max_failed_verify_ms_per_client: {per_client_ms}\n"
        f"      max_failed_verify_ms: {total_ms}\n"
    )


def _forged(stranger, n: int) -> bytes:
    """A fresh 4 KB token each time, signed by a key the gateway does not know."""
    return _token(stranger, sub=f"mallory-{n}", pad="x" * 4000)


def _verifier(tmp_path, per_client_ms: float, total_ms: float, now: list[float]):
    raw = yaml.safe_load(_section(tmp_path, per_client_ms, total_ms))["identity"]
    config = parse_identity_config(raw, tmp_path).user.jwt
    assert config is not None
    ticks = itertools.count()
    # Each reading of the CPU clock is a little over 1 ms after the last (over: so that
    # three make 3 ms in floating point): a verification that fails reads it twice.
    return JwtVerifier(config, clock=lambda: now[0], cpu_clock=lambda: next(ticks) * TICK)


def _reasons(verifier, tokens, client: str) -> list[str]:
    reasons = []
    for token in tokens:
        try:
            verifier.verify(token.decode(), client)
            reasons.append("ok")
        except InvalidToken as exc:
            reasons.append(exc.reason)
    return reasons


def test_failed_verifications_are_charged_and_stop_at_the_share(tmp_path, keys):
    idp, stranger = keys
    now = [100.2]
    verifier = _verifier(tmp_path, per_client_ms=3, total_ms=5, now=now)
    forged = [_forged(stranger, n) for n in range(8)]
    assert _reasons(verifier, forged[:6], "a") == ["signature"] * 3 + ["throttled"] * 3
    assert verifier.stats.throttled == 3 and verifier.stats.failed_seconds == pytest.approx(
        3 * TICK
    )
    # a valid token is not charged, and is verified while its client has share left
    assert _reasons(verifier, [_token(idp)], "b") == ["ok"]
    # a token whose verdict is known costs nothing: answered whatever the budget
    assert _reasons(verifier, [_token(idp), forged[0]], "a") == ["ok", "signature"]
    # b has 2 ms of the 5 in all left; then nobody has, not even a valid new token
    assert _reasons(verifier, forged[6:8], "b") == ["signature", "signature"]
    assert _reasons(verifier, [_token(idp, sub="carol")], "c") == ["throttled"]
    # throttled tokens were not verified, so not remembered: verified in the next second
    now[0] = 101.0
    assert _reasons(verifier, forged[3:4], "a") == ["signature"]


def test_tokens_that_fail_before_any_signature_check_are_charged_too(tmp_path, keys):
    """A disallowed algorithm, a malformed header or bad base64 fail before a signature
    is checked, after PyJWT's pure-Python pass over the whole token: charged the same."""
    idp, _ = keys
    now = [50.5]
    verifier = _verifier(tmp_path, per_client_ms=2, total_ms=100, now=now)
    hs = [_token(idp, sub=f"s{n}") for n in range(4)]
    wrong_alg = [b"eyJhbGciOiJIUzI1NiJ9." + t.split(b".", 1)[1] for t in hs]  # {"alg":"HS256"}
    assert _reasons(verifier, wrong_alg, "a") == ["algorithm"] * 2 + ["throttled"] * 2
    garbage = [b"eyJhbGciOi!!." + bytes([65 + n]) * 3000 + b".x" for n in range(3)]
    assert _reasons(verifier, garbage, "b") == ["malformed"] * 2 + ["throttled"]
    assert verifier.stats.signature_checks == 0


async def test_fresh_forged_tokens_from_one_address_do_not_starve_another(tmp_path, upstream, keys):
    idp, stranger = keys
    config = _config(tmp_path, _section(tmp_path, per_client_ms=1, total_ms=1000))
    forged = [_forged(stranger, n) for n in range(60)]
    async with running_gateway(upstream, config_file=config) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        frozen = time.time()
        verifier._clock = lambda: frozen  # one second throughout: the share never renews
        port = _port(gw)
        answers = []
        for bad in forged:
            answers.append(await _get(port, "/x", b"Authorization: Bearer " + bad, source=ATTACKER))
        statuses = [status for status, _, _ in answers]
        checked = statuses.count(401)
        assert statuses == [401] * checked + [429] * (60 - checked), statuses
        assert statuses.count(429) == verifier.stats.throttled > 0
        assert verifier.stats.failed_seconds <= 1 * MS + ONE_TOKEN
        for status, fields, body in answers:
            if status == 429:
                assert fields["retry-after"] == "1"
                assert b"max_failed_verify_ms_per_client" in body
                assert "www-authenticate" not in fields
            else:
                assert fields["www-authenticate"].startswith("Bearer")
        # another address, meanwhile, has its own share: its new token is verified
        good = b"Authorization: Bearer " + _token(idp, sub="carol")
        status, fields, _ = await _get(port, "/x", good, source=CLIENT)
        assert status == 200 and _remaining(fields)[0] == '"default-user"'
        scraped = generate_latest(gw.metrics.registry).decode()
        assert f'gateway_token_failures_total{{reason="throttled"}} {statuses.count(429)}.0' in (
            scraped
        )


async def test_the_share_is_the_counted_client_not_the_proxy_nor_the_full_ipv6_address(
    tmp_path, upstream, keys
):
    """Behind a trusted proxy each client named in X-Forwarded-For has its own share, and
    an IPv6 client's is its counted /64 group's (every address of it shares one)."""
    _, stranger = keys
    config = _config(tmp_path, _section(tmp_path, per_client_ms=1, total_ms=1000))
    forged = iter([_forged(stranger, n) for n in range(200)])
    async with running_gateway(
        upstream, config_file=config, trusted_proxies=["127.0.0.1/32"]
    ) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        frozen = time.time()
        verifier._clock = lambda: frozen  # one second throughout: the shares never renew
        port = _port(gw)

        async def spend(client: str, count: int = 25) -> list[int]:
            statuses = []
            for _ in range(count):
                status, _, _ = await _get(
                    port,
                    "/x",
                    b"Authorization: Bearer " + next(forged),
                    f"X-Forwarded-For: {client}".encode(),
                )
                statuses.append(status)
            return statuses

        first = await spend("2001:db8:0:1::1")
        assert first[0] == 401 and first[-1] == 429  # verified, until its share was spent
        assert await spend("2001:db8:0:1::ffff", 5) == [429] * 5  # the same /64: spent
        assert (await spend("198.51.100.7", 1)) == [401]  # its own share, not the proxy's
        assert (await spend("2001:db8:0:2::1", 1)) == [401]  # another /64: its own


async def test_in_the_anonymous_mode_a_throttled_token_is_counted_without_a_user(
    tmp_path, upstream, keys
):
    """``invalid: anonymous`` counts a token that does not verify as a request without a
    user; one not verified because the budget is spent is counted the same way (no CPU
    spent, nothing refused that would otherwise pass), per address."""
    _, stranger = keys
    section = _section(tmp_path, per_client_ms=1, total_ms=1000, extra="    invalid: anonymous\n")
    async with running_gateway(upstream, config_file=_config(tmp_path, section)) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        port = _port(gw)
        seen = []
        for n in range(30):
            bad = b"Authorization: Bearer " + _forged(stranger, n)
            status, fields, _ = await _get(port, "/x", bad, source=ATTACKER)
            seen.append((status, _remaining(fields)))
        assert verifier.stats.throttled > 0
        assert {s for s, _ in seen} == {200}
        names = {name for _, (name, _) in seen}
        remaining = [r for _, (_, r) in seen]
        assert names == {'"catch-all"'} and remaining == sorted(remaining, reverse=True)
        assert len(set(remaining)) == 30  # each counted once, against the address
