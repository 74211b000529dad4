"""What a review of the failure and identity paths found (fifth review): a JWKS URL's
credentials shown in logs and /info, a counter URL's password tail echoed in an error,
and a token checked against every key without a kid (or every key) -- each bounded by
its class."""

from __future__ import annotations

import json
import string

import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import given
from hypothesis import strategies as st
from jwt.algorithms import ECAlgorithm

from gateway.counters.factory import parse_counter_url
from gateway.identity.config import JwtConfig
from gateway.identity.jwks import MAX_KEYS_TRIED, parse_jwks
from gateway.identity.jwks_fetch import JwksFetcher, JwksFetchError, display_url
from gateway.identity.jwt import JwtVerifier
from tests.support.fuzz import fuzz
from tests.support.gateway import running_app

SECRET = st.text(
    alphabet=string.ascii_letters + string.digits + "?#/:;=&%", min_size=6, max_size=20
)


@fuzz(200)
@given(user=st.text(alphabet=string.ascii_letters, min_size=1, max_size=8), password=SECRET,
       query=st.text(alphabet=string.ascii_letters + "=&", max_size=20))  # fmt: skip
def test_a_shown_url_holds_no_credentials_nor_query(user, password, query):
    url = f"https://{user}:{password}@idp.example:8443/keys" + (f"?{query}" if query else "")
    shown = display_url(url)
    assert password not in shown and f"{user}:" not in shown
    assert shown.startswith("https://***@") and "?" not in shown.replace("?***", "")


@fuzz(200)
@given(password=SECRET.filter(lambda p: "?" in p or "#" in p))
def test_a_counter_url_error_never_echoes_the_password(password):
    """A '?' or '#' inside the password splits the URL there; whatever the error, no
    part of the password after it is shown."""
    url = f"redis://:{password}@127.0.0.1:6390/0"
    try:
        parse_counter_url(url)
    except ValueError as exc:
        text = str(exc)
        tail = password.split("?", 1)[-1].split("#", 1)[-1]
        assert len(tail) < 3 or tail not in text, text
        assert "6390" not in text or "@" not in text


def test_the_reviewers_spelling_says_what_to_do():
    with pytest.raises(ValueError) as caught:
        parse_counter_url("redis://:S3c?retM@127.0.0.1:16391/0")
    assert "retM" not in str(caught.value) and "%3F" in str(caught.value)


def _jwk(kid: str | None) -> dict:
    key = ECAlgorithm.to_jwk(ec.generate_private_key(ec.SECP256R1()).public_key(), as_dict=True)
    return {**key, "use": "sig", **({"kid": kid} if kid else {})}


@pytest.mark.parametrize("keyed", [0, 3, 60])
def test_a_token_is_checked_against_a_bounded_number_of_keys(keyed):
    """Keys without a kid past MAX_KEYS_TRIED are skipped at load (and said); a kid that
    names nothing, or no kid, meets at most MAX_KEYS_TRIED keys."""
    doc = {"keys": [_jwk(None) for _ in range(30)] + [_jwk(f"k{n}") for n in range(keyed)]}
    keys = parse_jwks(json.dumps(doc).encode(), ["ES256"])
    assert sum(k.kid is None for k in keys.keys) == MAX_KEYS_TRIED
    assert any("without a kid" in note for note in keys.skipped)
    for kid in (None, "nobody", "k0"):
        assert 1 <= len(keys.for_kid(kid)) <= MAX_KEYS_TRIED
    if keyed:
        assert [k.kid for k in keys.for_kid("k1")] == ["k1"]
    only_keyed = parse_jwks(json.dumps({"keys": [_jwk(f"k{n}") for n in range(20)]}).encode(),
                            ["ES256"])  # fmt: skip
    assert len(only_keyed.for_kid(None)) == MAX_KEYS_TRIED
    assert only_keyed.for_kid("nobody") == ()


async def test_a_jwks_urls_credentials_appear_neither_in_errors_nor_in_the_source(tmp_path):
    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404)

    app = web.Application()
    app.router.add_get("/{tail:.*}", missing)
    async with running_app(app) as base:
        url = base.replace("http://", "http://idpuser:JwksS3cret@") + "/jwks?token=T0ps3cret"
        fetcher = JwksFetcher(url)
        try:
            with pytest.raises(JwksFetchError) as caught:
                await fetcher.fetch()
        finally:
            await fetcher.close()
        assert "JwksS3cret" not in str(caught.value) and "T0ps3cret" not in str(caught.value)
        verifier = JwtVerifier(
            JwtConfig(
                issuer="https://idp.test", audience=("a",), algorithms=("ES256",), jwks_url=url
            )
        )
        try:
            assert not await verifier.start()
            shown = verifier.source + " " + str(verifier.last_error)
            assert "JwksS3cret" not in shown and "T0ps3cret" not in shown
            assert "***@127.0.0.1" in verifier.source
        finally:
            await verifier.close()
