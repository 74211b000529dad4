"""What a review of the failure and identity paths found (fifth review): a JWKS URL's
credentials shown in logs and /info, a counter URL's password tail echoed in an error,
and a token checked against every key without a kid (or every key) -- each bounded by
its class."""

from __future__ import annotations

import json
import string
import time

import jwt
import pytest
from aiohttp import web
from cryptography.hazmat.primitives.asymmetric import ec
from hypothesis import example, given
from hypothesis import strategies as st
from jwt.algorithms import ECAlgorithm

from gateway.counters.factory import parse_counter_url
from gateway.identity.config import JwtConfig
from gateway.identity.jwks import MAX_KEYS_TRIED, JwksError, parse_jwks
from gateway.identity.jwks_fetch import JwksFetcher, JwksFetchError
from gateway.identity.jwt import InvalidToken, JwtVerifier
from gateway.urls import SHOWN_QUERY_KEYS, display_url
from tests.support.fuzz import fuzz
from tests.support.gateway import running_app

SECRET = st.text(
    alphabet=string.ascii_letters + string.digits + "?#/:;=&%", min_size=6, max_size=20
)


@fuzz(200)
@given(user=st.text(alphabet=string.ascii_letters, min_size=1, max_size=8), password=SECRET,
       query=st.text(alphabet=string.ascii_letters + "=&", max_size=20))  # fmt: skip
# Found by this property in a pure-Python run (its examples differ from a compiled
# checkout's): a password's tail after a '?' was shown as a query key, 'https://***?A000=***'.
@example(user="A", password="?A000=", query="")
@example(user="u", password="?tok3n=x&y", query="a=b")
def test_a_shown_url_holds_no_credentials_nor_query(user, password, query):
    url = f"https://{user}:{password}@idp.example:8443/keys" + (f"?{query}" if query else "")
    shown = display_url(url)
    after_scheme = shown.partition("://")[2]
    assert password not in after_scheme and f"{user}:" not in after_scheme
    # the host is shown only when nothing could be credentials read as a host
    assert shown.startswith(("https://***", "(a URL that does not parse)")), shown
    assert "#" not in shown.replace("#***", "")
    # of the query, only the values of the keys that say where a database is
    query = shown.partition("?")[2]
    for piece in query.split("&") if query else []:
        key, _, value = piece.partition("=")
        assert piece == "***" or value == "***" or key in SHOWN_QUERY_KEYS, shown


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


def _jwk(kid: str | None, private=None) -> dict:
    private = private or ec.generate_private_key(ec.SECP256R1())
    key = ECAlgorithm.to_jwk(private.public_key(), as_dict=True)
    return {**key, "use": "sig", **({"kid": kid} if kid else {})}


def _verifier(tmp_path, keys: list[dict]) -> JwtVerifier:
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": keys}))
    settings = {"issuer": "https://idp.test", "audience": ("a",), "algorithms": ("ES256",)}
    return JwtVerifier(JwtConfig(**settings, jwks_file=path))


def _signed(private, kid: str | None) -> str:
    claims = {"iss": "https://idp.test", "aud": "a", "sub": "u", "exp": time.time() + 300}
    return jwt.encode(claims, private, algorithm="ES256", headers={"kid": kid} if kid else {})


@pytest.mark.parametrize("keyed", [0, 3, 60])
def test_a_token_is_checked_against_a_bounded_number_of_keys(tmp_path, keyed):
    """Keys without a kid past MAX_KEYS_TRIED are skipped at load (and said); a token
    whose kid names nothing, or that names none, costs at most MAX_KEYS_TRIED
    signature checks, however many keys could take it."""
    doc = [_jwk(None) for _ in range(30)] + [_jwk(f"k{n}") for n in range(keyed)]
    keys = parse_jwks(json.dumps({"keys": doc}).encode(), ["ES256"])
    assert sum(k.kid is None for k in keys.keys) == MAX_KEYS_TRIED
    assert any("without a kid" in note for note in keys.skipped)
    verifier = _verifier(tmp_path, doc)
    stranger = ec.generate_private_key(ec.SECP256R1())
    for kid in (None, "nobody", "k0"):
        before = verifier.stats.signature_checks
        with pytest.raises(InvalidToken):
            verifier.verify(_signed(stranger, kid))
        assert 1 <= verifier.stats.signature_checks - before <= MAX_KEYS_TRIED


def test_a_rotation_overlap_verifies_tokens_without_a_kid(tmp_path):
    """An old key without a kid beside a new one with: a token without a kid signed by
    the new key still verifies (keys without a kid are tried first, then the others)."""
    old, new = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    verifier = _verifier(tmp_path, [_jwk(None, old), _jwk("new", new)])
    assert verifier.verify(_signed(new, None)).user == "u"
    assert verifier.verify(_signed(old, None)).user == "u"
    assert verifier.verify(_signed(new, "new")).user == "u"


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


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("https://idp.example/.well-known/jwks.json", "https://idp.example/.well-known/jwks.json"),
        ("https://[::1]:8443/jwks", "https://[::1]:8443/jwks"),
        ("https://u:p@idp.example:8443/keys?x=1#f", "https://***@idp.example:8443/keys?x=***#***"),
        (  # Firebase's: a '@' in the path, no credentials
            "https://www.googleapis.com/service_accounts/v1/jwk/securetoken@system.gserviceaccount.com",
            "https://www.googleapis.com/...",
        ),
        ("https://A:00000/@idp.example:8443/keys", "https://***/..."),  # '/' in a password
    ],
)
def test_shown_urls(url, shown):
    assert display_url(url) == shown


def test_an_at_sign_in_an_option_value_is_accepted():
    parsed = parse_counter_url("rediss://h:6380/0?ssl_ca_certs=/etc/redis@main/ca.pem")
    assert dict(parsed.options)["ssl_ca_certs"] == "/etc/redis@main/ca.pem"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32-be"])
def test_a_jwks_in_another_encoding_than_utf8_is_refused(encoding: str) -> None:
    """RFC 7517 JWKS are UTF-8 JSON: ``json.loads`` on the bytes guessed UTF-16/32 and took
    them (with lone surrogates through ``surrogatepass``)."""
    text = json.dumps({"keys": [_jwk("k1")]})
    assert [k.kid for k in parse_jwks(text.encode("utf-8"), ["ES256"]).keys] == ["k1"]
    assert [k.kid for k in parse_jwks(text.encode("utf-8-sig"), ["ES256"]).keys] == ["k1"]
    with pytest.raises(JwksError, match=r"not (UTF-8 encoded|valid) JSON"):
        parse_jwks(text.encode(encoding), ["ES256"])
    with pytest.raises(JwksError, match="not UTF-8 encoded JSON"):
        parse_jwks(b'{"keys": [{"kid": "\xed\xa0\x80"}]}', ["ES256"])
