"""Signature checks are bounded per client address and in all (issue: one client must not
starve the others). A token the gateway has not seen is verified before the request is
counted, so without a budget a client sending fresh random tokens spends the worker's CPU
on public-key operations however low its limits are. 127.0.0.2 attacks; 127.0.0.3 must
still be served. The verifier's own test uses a fake clock; the gateway's, real sockets."""

from __future__ import annotations

import math
import time

import pytest
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


def _section(tmp_path, per_client: int, total: int) -> str:
    return (
        "identity:\n  user:\n    jwt:\n"
        f"      public_key_file: {tmp_path / 'idp.pem'}\n"
        f"      issuer: {ISSUER}\n      audience: {AUDIENCE}\n      algorithms: [RS256]\n"
        f"      max_signature_checks_per_client: {per_client}\n"
        f"      max_signature_checks: {total}\n"
    )


def _forged(stranger, n: int) -> bytes:
    """A fresh token each time (its own sub), signed by a key the gateway does not know."""
    return _token(stranger, sub=f"mallory-{n}")


def test_the_verifier_spends_no_more_than_its_budget(tmp_path, keys):
    import yaml

    idp, stranger = keys
    raw = yaml.safe_load(_section(tmp_path, per_client=3, total=5))["identity"]
    config = parse_identity_config(raw, tmp_path).user.jwt
    assert config is not None
    now = [100.2]
    verifier = JwtVerifier(config, clock=lambda: now[0])
    good = _token(idp).decode()
    assert verifier.verify(good, "b").user == "alice"  # one check, for b

    reasons = []
    for n in range(6):
        try:
            verifier.verify(_forged(stranger, n).decode(), "a")
        except InvalidToken as exc:
            reasons.append(exc.reason)
    assert reasons == ["signature"] * 3 + ["throttled"] * 3
    assert verifier.stats.signature_checks == 4
    # a token whose verdict is known costs no check: answered whatever the budget
    assert verifier.verify(good, "a").user == "alice"
    with pytest.raises(InvalidToken, match="signature"):  # remembered as failed
        verifier.verify(_forged(stranger, 0).decode(), "a")
    # b has one check left of the five in all; then nobody has
    with pytest.raises(InvalidToken, match="signature"):
        verifier.verify(_forged(stranger, 100).decode(), "b")
    with pytest.raises(InvalidToken, match="throttled"):
        verifier.verify(_forged(stranger, 101).decode(), "c")
    assert verifier.stats.signature_checks == 5
    # a throttled token was not checked, so not remembered: checked in the next second
    now[0] = 101.0
    with pytest.raises(InvalidToken, match="signature"):
        verifier.verify(_forged(stranger, 5).decode(), "a")
    assert verifier.stats.signature_checks == 6


async def test_fresh_forged_tokens_from_one_address_do_not_starve_another(tmp_path, upstream, keys):
    idp, stranger = keys
    config = _config(tmp_path, _section(tmp_path, per_client=5, total=1000))
    async with running_gateway(upstream, config_file=config) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        port = _port(gw)
        started = time.time()
        answers = []
        for n in range(30):
            bad = b"Authorization: Bearer " + _forged(stranger, n)
            answers.append(await _get(port, "/x", bad, source=ATTACKER))
        windows = math.floor(time.time()) - math.floor(started) + 1
        statuses = [status for status, _, _ in answers]
        assert set(statuses) <= {401, 429}, statuses
        assert verifier.stats.signature_checks <= 5 * windows
        assert statuses.count(429) >= 30 - 5 * windows
        for status, fields, body in answers:
            if status == 429:
                assert fields["retry-after"] == "1"
                assert b"max_signature_checks_per_client" in body
                assert "www-authenticate" not in fields
            else:
                assert fields["www-authenticate"].startswith("Bearer")
        # another address, meanwhile, has its own share: its new token is checked
        good = b"Authorization: Bearer " + _token(idp, sub="carol")
        status, fields, _ = await _get(port, "/x", good, source=CLIENT)
        assert status == 200 and _remaining(fields)[0] == '"default-user"'


async def test_many_addresses_together_are_held_to_the_total(tmp_path, upstream, keys):
    _, stranger = keys
    config = _config(tmp_path, _section(tmp_path, per_client=5, total=8))
    async with running_gateway(upstream, config_file=config) as gw:
        verifier = gw.proxy.gateway.verified.tokens
        port = _port(gw)
        started = time.time()
        statuses = []
        for n in range(20):  # 4 addresses, 5 tokens each: each within its own share
            bad = b"Authorization: Bearer " + _forged(stranger, n)
            status, _, _ = await _get(port, "/x", bad, source=f"127.0.0.{4 + n % 4}")
            statuses.append(status)
        windows = math.floor(time.time()) - math.floor(started) + 1
        assert verifier.stats.signature_checks <= 8 * windows
        assert statuses.count(429) >= 20 - 8 * windows
        scraped = generate_latest(gw.metrics.registry).decode()
        throttled = f'gateway_token_failures_total{{reason="throttled"}} {statuses.count(429)}.0'
        assert throttled in scraped


async def test_throttled_tokens_are_counted_per_address_like_any_refusal(tmp_path, upstream, keys):
    """A 429 for spent checks is itself counted against the address (the per-address
    catch-all), and in the anonymous mode too: the token was not checked, so it is
    neither accepted nor treated as no token."""
    _, stranger = keys
    section = _section(tmp_path, per_client=1, total=1000).replace(
        "  user:\n", "  user:\n    invalid: anonymous\n"
    )
    async with running_gateway(upstream, config_file=_config(tmp_path, section)) as gw:
        port = _port(gw)
        seen = []
        for n in range(6):
            bad = b"Authorization: Bearer " + _forged(stranger, n)
            status, fields, _ = await _get(port, "/x", bad, source=ATTACKER)
            seen.append((status, _remaining(fields)))
        statuses = [s for s, _ in seen]
        assert 200 in statuses and 429 in statuses  # anonymous first, then throttled
        remaining = [r for _, (name, r) in seen if name == '"catch-all"']
        assert remaining == sorted(remaining, reverse=True) and len(set(remaining)) == 6
