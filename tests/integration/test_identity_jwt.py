"""JWT verification against a JWKS served by a real HTTP server on loopback, with tokens
signed by real RSA, EC P-256 and Ed25519 keys made here."""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import hmac
import json
import time
from pathlib import Path

import jwt
import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import NameOID
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

from gateway.identity.config import JwtConfig
from gateway.identity.jwks import JwksError
from gateway.identity.jwt import (
    MAX_TOKEN_BYTES,
    InvalidToken,
    JwtVerifier,
    VerifiedUser,
    bearer_token,
)

ISS = "https://idp.test"
AUD = "my-api"
DROP = object()  # a claim left out of the token

RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
RSA_KEY_2 = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
ED_KEY = ed25519.Ed25519PrivateKey.generate()


def jwk(private_key, kid: str, **extra) -> dict:
    public = private_key.public_key()
    if isinstance(public, rsa.RSAPublicKey):
        out = RSAAlgorithm.to_jwk(public, as_dict=True)
    elif isinstance(public, ec.EllipticCurvePublicKey):
        out = ECAlgorithm.to_jwk(public, as_dict=True)
    else:
        out = OKPAlgorithm.to_jwk(public, as_dict=True)
    return {**out, "kid": kid, "use": "sig", **extra}


def jwks(*keys: dict) -> dict:
    return {"keys": list(keys)}


STANDARD = jwks(jwk(RSA_KEY, "rsa-1"), jwk(EC_KEY, "ec-1"), jwk(ED_KEY, "ed-1"))


class Clock:
    def __init__(self) -> None:
        self.now = float(int(time.time()))

    def __call__(self) -> float:
        return self.now


def claims(clock: Clock, **overrides) -> dict:
    out = {"iss": ISS, "aud": AUD, "sub": "user-1", "exp": clock.now + 3600, "plan": "gold"}
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not DROP}


def sign(private_key, alg: str, kid: str | None, payload: dict, **header) -> str:
    headers = {**({"kid": kid} if kid else {}), **header}
    return jwt.encode(payload, private_key, algorithm=alg, headers=headers)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unsigned(header: dict, payload: dict, signature: bytes = b"") -> str:
    head = b64(json.dumps(header).encode()) + "." + b64(json.dumps(payload).encode())
    return head + "." + b64(signature)


class Idp:
    """A JWKS endpoint whose document and status the test changes."""

    def __init__(self) -> None:
        self.document: dict = STANDARD
        self.status = 200
        self.hits = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        if self.status != 200:
            return web.Response(status=self.status, text="down")
        return web.json_response(self.document)

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/.well-known/jwks.json", self.handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/.well-known/jwks.json"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def idp():
    server = Idp()
    await server.start()
    yield server
    await server.stop()


def config(**overrides) -> JwtConfig:
    values = {
        "issuer": ISS,
        "audience": (AUD,),
        "algorithms": ("RS256", "ES256", "EdDSA"),
        "tier_claim": "plan",
    }
    values.update(overrides)
    return JwtConfig(**values)


@pytest.fixture
async def verifier(idp):
    clock = Clock()
    made = JwtVerifier(config(jwks_url=idp.url), clock=clock)
    assert await made.start()
    made.test_clock = clock
    yield made
    await made.close()


def refused(verifier: JwtVerifier, token: str) -> str:
    with pytest.raises(InvalidToken) as caught:
        verifier.verify(token)
    return caught.value.reason


async def test_valid_tokens_of_each_key_type(verifier):
    clock = verifier.test_clock
    payload = claims(clock)
    for key, alg, kid in ((RSA_KEY, "RS256", "rsa-1"), (EC_KEY, "ES256", "ec-1"),
                          (ED_KEY, "EdDSA", "ed-1")):  # fmt: skip
        user = verifier.verify(sign(key, alg, kid, payload))
        assert user == VerifiedUser("user-1", "gold", payload["exp"])
    # No tier claim: no tier; the audience may be one of a list.
    assert verifier.verify(sign(RSA_KEY, "RS256", "rsa-1", claims(clock, plan=DROP))).tier is None
    listed = claims(clock, aud=["other", AUD], sub="user-2")
    assert verifier.verify(sign(EC_KEY, "ES256", "ec-1", listed)).user == "user-2"


async def test_a_token_without_kid_is_tried_with_each_key_of_its_algorithm(verifier):
    assert verifier.verify(sign(ED_KEY, "EdDSA", None, claims(verifier.test_clock))).user


async def test_bad_signatures(verifier):
    clock = verifier.test_clock
    assert refused(verifier, sign(RSA_KEY_2, "RS256", "rsa-1", claims(clock))) == "signature"
    good = sign(EC_KEY, "ES256", "ec-1", claims(clock))
    head, _, sig = good.split(".")
    forged = head + "." + b64(json.dumps(claims(clock, sub="admin")).encode()) + "." + sig
    assert refused(verifier, forged) == "signature"
    # Another key's kid on the right algorithm family: still its signature that counts.
    other = ec.generate_private_key(ec.SECP256R1())
    assert refused(verifier, sign(other, "ES256", "ec-1", claims(clock))) == "signature"


async def test_expiry_and_not_before_with_leeway(verifier):
    clock = verifier.test_clock
    assert refused(verifier, sign(RSA_KEY, "RS256", "rsa-1", claims(clock, exp=clock.now - 31)))\
        == "expired"  # fmt: skip
    # Within the 30 s leeway.
    assert verifier.verify(sign(RSA_KEY, "RS256", "rsa-1", claims(clock, exp=clock.now - 29)))
    early = sign(RSA_KEY, "RS256", "rsa-1", claims(clock, nbf=clock.now + 100))
    assert refused(verifier, early) == "not_yet_valid"
    assert verifier.verify(sign(RSA_KEY, "RS256", "rsa-1", claims(clock, nbf=clock.now + 29)))
    # A not-yet-valid verdict is not remembered: the same token works once its time comes.
    clock.now += 80
    assert verifier.verify(early).user == "user-1"


async def test_issuer_and_audience(verifier):
    clock = verifier.test_clock
    for changed, reason in (
        ({"iss": "https://evil.test"}, "issuer"),
        ({"iss": DROP}, "issuer"),
        ({"aud": "other-api"}, "audience"),
        ({"aud": ["a", "b"]}, "audience"),
        ({"aud": DROP}, "audience"),
    ):
        token = sign(RSA_KEY, "RS256", "rsa-1", claims(clock, **changed))
        assert refused(verifier, token) == reason, changed


async def test_claims_that_are_missing_or_not_an_identity(verifier):
    clock = verifier.test_clock
    for changed in (
        {"sub": DROP},
        {"sub": ""},
        {"sub": 42},
        {"sub": "a\nb"},
        {"sub": "x" * 257},
        {"exp": DROP},
        {"exp": "tomorrow"},
        {"exp": True},
        {"nbf": "now"},
        {"plan": ["gold"]},
        {"plan": "gold tier"},
    ):
        token = sign(RSA_KEY, "RS256", "rsa-1", claims(clock, **changed))
        assert refused(verifier, token) == "claim", changed
    assert verifier.verify(sign(RSA_KEY, "RS256", "rsa-1", claims(clock, sub="x" * 256)))
    assert verifier.verify(sign(RSA_KEY, "RS256", "rsa-1", claims(clock, sub="Zoë"))).user == "Zoë"


async def test_alg_none_and_algorithm_confusion_are_refused(verifier):
    clock = verifier.test_clock
    payload = claims(clock)
    assert refused(verifier, jwt.encode(payload, None, algorithm="none")) == "algorithm"
    assert refused(verifier, unsigned({"alg": "none", "kid": "rsa-1"}, payload)) == "algorithm"
    assert refused(verifier, unsigned({"alg": "None", "kid": "rsa-1"}, payload)) == "algorithm"
    # HS256 "signed" with the RSA public key's bytes as the HMAC secret.
    pem = RSA_KEY.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    header = {"alg": "HS256", "typ": "JWT", "kid": "rsa-1"}
    head = unsigned(header, payload).rsplit(".", 1)[0]
    mac = hmac.new(pem, head.encode(), hashlib.sha256).digest()
    assert refused(verifier, head + "." + b64(mac)) == "algorithm"
    # A configured algorithm, but not the key's own family or curve.
    assert refused(verifier, sign(EC_KEY, "ES256", "rsa-1", payload)) == "algorithm"
    assert refused(verifier, sign(RSA_KEY, "RS256", "ec-1", payload)) == "algorithm"
    # An algorithm of the key's family that is not configured.
    assert refused(verifier, sign(RSA_KEY, "PS256", "rsa-1", payload)) == "algorithm"


async def test_malformed_and_oversize_tokens(verifier):
    clock = verifier.test_clock
    checks = verifier.stats.signature_checks
    for token in ("", "abc", "a.b.c", "....", "é.é.é"):
        assert refused(verifier, token) == "malformed", token
    padded = sign(RSA_KEY, "RS256", "rsa-1", claims(clock, pad="x" * MAX_TOKEN_BYTES))
    assert len(padded) > MAX_TOKEN_BYTES
    assert refused(verifier, padded) == "malformed"
    assert refused(verifier, unsigned({"alg": "RS256", "kid": 7}, claims(clock))) == "malformed"
    crit = sign(RSA_KEY, "RS256", "rsa-1", claims(clock), crit=["exp"])
    assert refused(verifier, crit) == "malformed"
    assert verifier.stats.signature_checks == checks


async def test_a_verified_token_is_cached_until_it_expires(verifier):
    clock = verifier.test_clock
    token = sign(RSA_KEY, "RS256", "rsa-1", claims(clock, exp=clock.now + 60))
    first = verifier.verify(token)
    checks, hits = verifier.stats.signature_checks, verifier.stats.cache_hits
    assert verifier.verify(token) is first
    assert verifier.stats.signature_checks == checks and verifier.stats.cache_hits == hits + 1
    clock.now += 60 + 30  # exp plus the leeway
    assert refused(verifier, token) == "expired"
    assert verifier.stats.signature_checks == checks + 1


async def test_a_failed_token_is_remembered_briefly(verifier):
    clock = verifier.test_clock
    bad = sign(RSA_KEY_2, "RS256", "rsa-1", claims(clock))
    assert refused(verifier, bad) == "signature"
    checks = verifier.stats.signature_checks
    for _ in range(5):
        assert refused(verifier, bad) == "signature"
    assert verifier.stats.signature_checks == checks
    assert verifier.stats.failure_cache_hits == 5
    clock.now += 11
    assert refused(verifier, bad) == "signature"
    assert verifier.stats.signature_checks == checks + 1


async def test_an_unknown_kid_asks_for_one_refresh_and_a_rotation_is_picked_up(idp, verifier):
    clock = verifier.test_clock
    token = sign(RSA_KEY_2, "RS256", "rsa-2", claims(clock))
    runner = asyncio.create_task(verifier.run())
    try:
        hits = idp.hits
        assert refused(verifier, token) == "unknown_kid"
        await wait_for(lambda: idp.hits == hits + 1)
        # Anyone can send any kid: the refreshes asked for are rate-limited.
        clock.now += 10
        verifier.clear_cache()
        assert refused(verifier, token) == "unknown_kid"
        await asyncio.sleep(0.2)
        assert idp.hits == hits + 1
        # The IdP rotates: rsa-2 in, rsa-1 out.
        old = sign(RSA_KEY, "RS256", "rsa-1", claims(clock))
        assert verifier.verify(old).user == "user-1"  # cached as verified
        idp.document = jwks(jwk(RSA_KEY_2, "rsa-2"), jwk(EC_KEY, "ec-1"))
        clock.now += 300
        assert refused(verifier, token) == "unknown_kid"
        await wait_for(lambda: idp.hits == hits + 2)
        await wait_for(lambda: verifier.keys is not None and len(verifier.keys.keys) == 2)
        assert verifier.verify(token).user == "user-1"  # the remembered failure is forgotten
        # The removed key's tokens stop working, even one verified before.
        assert refused(verifier, old) == "unknown_kid"
    finally:
        runner.cancel()


async def test_a_jwks_outage_keeps_the_last_good_keys(idp, verifier):
    clock = verifier.test_clock
    token = sign(EC_KEY, "ES256", "ec-1", claims(clock))
    for status in (500, 404, 302):
        idp.status = status
        assert not await verifier.refresh()
        assert f"HTTP {status}" in verifier.last_error
        assert len(verifier.keys.keys) == 3
    idp.status = 200
    idp.document = {"keys": [{"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"}]}
    assert not await verifier.refresh()
    assert "no key usable" in verifier.last_error
    idp.document = {"not": "a jwks"}
    assert not await verifier.refresh()
    await idp.stop()
    assert not await verifier.refresh()
    assert "cannot fetch" in verifier.last_error
    assert verifier.verify(token).user == "user-1"
    assert verifier.stats.refresh_failures == 6


async def test_an_idp_down_at_start_means_no_keys_until_it_answers(idp):
    idp.status = 503
    clock = Clock()
    verifier = JwtVerifier(config(jwks_url=idp.url), clock=clock)
    try:
        assert not await verifier.start()
        assert verifier.keys is None
        token = sign(ED_KEY, "EdDSA", "ed-1", claims(clock))
        assert refused(verifier, token) == "no_keys"
        idp.status = 200
        assert await verifier.refresh()
        assert verifier.verify(token).user == "user-1"
    finally:
        await verifier.close()


@pytest.mark.filterwarnings("ignore:The RSA key is 1024 bits")  # signing with the weak key
async def test_keys_that_must_not_be_used_are_skipped(idp):
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    private = RSAAlgorithm.to_jwk(RSA_KEY_2, as_dict=True)
    idp.document = jwks(
        jwk(weak, "weak"),
        {**private, "kid": "private"},
        jwk(RSA_KEY, "enc", use="enc"),
        jwk(RSA_KEY, "rs512-only", alg="RS512"),
        {"kty": "oct", "k": "c2VjcmV0", "kid": "hmac"},
        jwk(EC_KEY, "ec-1"),
    )
    clock = Clock()
    verifier = JwtVerifier(config(jwks_url=idp.url), clock=clock)
    try:
        assert await verifier.start()
        assert [k.kid for k in verifier.keys.keys] == ["ec-1"]
        assert len(verifier.keys.skipped) == 5
        payload = claims(clock)
        assert refused(verifier, sign(weak, "RS256", "weak", payload)) == "unknown_kid"
        assert refused(verifier, sign(RSA_KEY_2, "RS256", "private", payload)) == "unknown_kid"
        assert verifier.verify(sign(EC_KEY, "ES256", "ec-1", payload))
    finally:
        await verifier.close()


async def test_a_jwks_file_and_a_public_key_file(tmp_path: Path):
    clock = Clock()
    jwks_file = tmp_path / "jwks.json"
    jwks_file.write_text(json.dumps(jwks(jwk(ED_KEY, "ed-1"))))
    from_file = JwtVerifier(config(jwks_file=jwks_file), clock=clock)
    assert from_file.verify(sign(ED_KEY, "EdDSA", "ed-1", claims(clock))).user == "user-1"
    # Re-read by refresh(): a rotation in the file is picked up, a broken file is not.
    jwks_file.write_text(json.dumps(jwks(jwk(EC_KEY, "ec-1"))))
    assert await from_file.refresh()
    assert from_file.verify(sign(EC_KEY, "ES256", "ec-1", claims(clock)))
    jwks_file.write_text("{")
    assert not await from_file.refresh()
    assert from_file.verify(sign(EC_KEY, "ES256", "ec-1", claims(clock)))

    pem = tmp_path / "idp.pem"
    pem.write_bytes(
        RSA_KEY.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    from_pem = JwtVerifier(config(public_key_file=pem), clock=clock)
    payload = claims(clock)
    # A PEM key has no kid: tokens with or without one are checked with it.
    assert from_pem.verify(sign(RSA_KEY, "RS256", "any-kid", payload)).user == "user-1"
    assert from_pem.verify(sign(RSA_KEY, "RS256", None, payload)).user == "user-1"
    # The classic confusion, against a PEM key: HS256 with the PEM's bytes as the secret.
    head = unsigned({"alg": "HS256", "typ": "JWT"}, payload).rsplit(".", 1)[0]
    mac = hmac.new(pem.read_bytes(), head.encode(), hashlib.sha256).digest()
    assert refused(from_pem, head + "." + b64(mac)) == "algorithm"

    cert = tmp_path / "idp.crt"
    cert.write_bytes(self_signed(EC_KEY).public_bytes(serialization.Encoding.PEM))
    from_cert = JwtVerifier(config(public_key_file=cert), clock=clock)
    assert from_cert.verify(sign(EC_KEY, "ES256", None, payload)).user == "user-1"

    private = tmp_path / "private.pem"
    private.write_bytes(
        RSA_KEY.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(JwksError, match="not a PEM public key"):
        JwtVerifier(config(public_key_file=private))
    with pytest.raises(JwksError, match="verifies none of"):
        JwtVerifier(config(public_key_file=pem, algorithms=("ES256",)))
    with pytest.raises(FileNotFoundError):
        JwtVerifier(config(jwks_file=tmp_path / "missing.json"))


def self_signed(key) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idp.test")])
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )


@pytest.mark.parametrize(
    ("value", "token"),
    [
        (b"Bearer abc.def.ghi", "abc.def.ghi"),
        (b"bearer abc", "abc"),
        (b"BEARER  a-b_c~d+e/f==", "a-b_c~d+e/f=="),
        (b"Bearer", None),
        (b"Bearer ", None),
        (b"Basic dXNlcjpwYXNz", None),
        (b"Bearer a b", None),
        (b"Bearer a=b", None),
        (b"Bearer a,b", None),
        (b"Bearer\ta", None),
        (b"Bearer a\n", None),
        (b"Bearer \xc3\xa9", None),
        (b"Bearerabc", None),
        (b"", None),
    ],
)
def test_bearer_token(value, token):
    assert bearer_token(value) == token


async def wait_for(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")
