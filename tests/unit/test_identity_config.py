"""The config file's ``identity:`` section: defaults, every field, and every way it can be
wrong (the message names the key path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gateway.identity.config import (
    ApiKeyConfig,
    IdentityConfig,
    IdentityConfigError,
    JwtConfig,
    UserConfig,
    parse_identity_config,
)

BASE = Path("/etc/gateway")


def parse(text: str) -> IdentityConfig:
    return parse_identity_config(yaml.safe_load(text) or {}, BASE)


def jwt_section(**overrides: object) -> dict:
    section = {
        "jwks_url": "https://idp.example/.well-known/jwks.json",
        "issuer": "https://idp.example",
        "audience": "my-api",
    }
    section.update(overrides)
    return {"user": {"jwt": section}}


def test_an_empty_section_is_todays_behaviour():
    config = parse_identity_config({}, BASE)
    assert config == IdentityConfig(ApiKeyConfig(), UserConfig())
    assert config.api_key.keys is None and config.api_key.header == "x-api-key"
    assert config.user.header_from == "any" and config.user.jwt is None


def test_the_issue_example_parses_whole():
    config = parse(
        """
        api_key: {header: X-API-Key, keys: keys.yaml, unknown: reject}
        user:
          jwt:
            header: Authorization
            jwks_url: https://idp.example/.well-known/jwks.json
            issuer: https://idp.example
            audience: my-api
            claim: sub
            tier_claim: plan
            algorithms: [RS256, ES256, EdDSA]
            leeway_seconds: 10
            jwks_refresh_seconds: 60
          invalid: anonymous
        """
    )
    assert config.api_key == ApiKeyConfig("x-api-key", BASE / "keys.yaml", "reject")
    assert config.user.header_from == "trusted"  # always, with jwt
    assert config.user.invalid == "anonymous"
    assert config.user.jwt == JwtConfig(
        issuer="https://idp.example",
        audience=("my-api",),
        header="authorization",
        jwks_url="https://idp.example/.well-known/jwks.json",
        claim="sub",
        tier_claim="plan",
        algorithms=("RS256", "ES256", "EdDSA"),
        leeway_seconds=10.0,
        jwks_refresh_seconds=60.0,
    )


def test_paths_resolve_against_the_config_folder_and_absolute_ones_stay():
    config = parse_identity_config(
        {"api_key": {"keys": "sub/keys.yaml"}, **jwt_section(jwks_url=None, jwks_file="/k.json")},
        BASE,
    )
    assert config.api_key.keys == BASE / "sub" / "keys.yaml"
    assert config.user.jwt is not None and config.user.jwt.jwks_file == Path("/k.json")
    pem = parse_identity_config(jwt_section(jwks_url=None, public_key_file="idp.pem"), BASE)
    assert pem.user.jwt is not None and pem.user.jwt.public_key_file == BASE / "idp.pem"


def test_defaults_of_the_jwt_section():
    jwt = parse_identity_config(jwt_section(), BASE).user.jwt
    assert jwt is not None
    assert jwt.header == "authorization" and jwt.claim == "sub" and jwt.tier_claim is None
    assert jwt.algorithms == ("RS256", "ES256", "EdDSA")
    assert jwt.leeway_seconds == 30 and jwt.jwks_refresh_seconds == 300
    assert jwt.max_failed_verify_ms_per_client == 10 and jwt.max_failed_verify_ms == 100
    assert parse_identity_config(jwt_section(), BASE).user.invalid == "reject"
    tuned = parse_identity_config(
        jwt_section(max_failed_verify_ms_per_client=2.5, max_failed_verify_ms=50), BASE
    ).user.jwt
    assert tuned is not None
    assert tuned.max_failed_verify_ms_per_client == 2.5 and tuned.max_failed_verify_ms == 50


def test_header_from_trusted_without_jwt():
    assert parse("user: {header_from: trusted}").user.header_from == "trusted"
    assert parse("user: {header_from: any}").user.header_from == "any"


def test_audience_may_be_a_list():
    jwt = parse_identity_config(jwt_section(audience=["a", "b"]), BASE).user.jwt
    assert jwt is not None and jwt.audience == ("a", "b")


def test_loopback_http_jwks_is_allowed_for_sidecars_and_tests():
    for url in ("http://127.0.0.1:8081/jwks", "http://localhost/jwks", "http://[::1]:9/j"):
        jwt = parse_identity_config(jwt_section(jwks_url=url), BASE).user.jwt
        assert jwt is not None and jwt.jwks_url == url


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([], "identity: expected a mapping"),
        ({"apikey": {}}, "identity.apikey: unknown key"),
        ({"api_key": {"hedaer": "x"}}, "identity.api_key.hedaer: unknown key"),
        ({"api_key": "keys.yaml"}, "identity.api_key: expected a mapping"),
        ({"api_key": {"header": "x api key"}}, "identity.api_key.header: 'x api key' is not"),
        ({"api_key": {"keys": 3}}, "identity.api_key.keys: expected a file path"),
        ({"api_key": {"keys": "k", "unknown": "drop"}}, "identity.api_key.unknown: 'drop'"),
        ({"api_key": {"unknown": "reject"}}, "identity.api_key.unknown: 'reject' needs"),
        ({"user": {"header_from": "everyone"}}, "identity.user.header_from: 'everyone'"),
        ({"user": {"invalid": "reject"}}, "identity.user.invalid: has no effect without"),
        ({"user": {"jwt": "yes"}}, "identity.user.jwt: expected a mapping"),
        ({"user": {"jwtt": {}}}, "identity.user.jwtt: unknown key"),
    ],
)
def test_each_mistake_is_named_by_its_key_path(raw, message):
    with pytest.raises(IdentityConfigError) as caught:
        parse_identity_config(raw, BASE)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"algorithms": ["HS256"]}, "identity.user.jwt.algorithms: 'HS256' is refused"),
        ({"algorithms": ["RS256", "hs512"]}, "'hs512' is refused"),
        ({"algorithms": ["none"]}, "'none' is refused"),
        ({"algorithms": ["RS1"]}, "identity.user.jwt.algorithms: unknown algorithm 'RS1'"),
        ({"algorithms": []}, "identity.user.jwt.algorithms: expected a non-empty list"),
        ({"algorithms": "RS256"}, "identity.user.jwt.algorithms: expected a non-empty list"),
        ({"algorithms": ["RS256", "RS256"]}, "'RS256' is listed twice"),
        ({"jwks_file": "k.json"}, "identity.user.jwt: exactly one of jwks_url, jwks_file"),
        ({"jwks_url": None}, "exactly one of jwks_url, jwks_file, public_key_file is needed"),
        ({"jwks_url": "http://idp.example/jwks"}, "identity.user.jwt.jwks_url: must be an https"),
        ({"jwks_url": "ftp://idp.example/jwks"}, "identity.user.jwt.jwks_url: must be an https"),
        ({"jwks_url": ""}, "identity.user.jwt.jwks_url: required"),
        ({"issuer": None}, "identity.user.jwt.issuer: required"),
        ({"issuer": ""}, "identity.user.jwt.issuer: required"),
        ({"audience": None}, "identity.user.jwt.audience: required"),
        ({"audience": []}, "identity.user.jwt.audience: required"),
        ({"audience": ["a", 3]}, "identity.user.jwt.audience: required"),
        ({"claim": ""}, "identity.user.jwt.claim: required"),
        ({"tier_claim": 7}, "identity.user.jwt.tier_claim: required"),
        ({"leeway_seconds": "30"}, "identity.user.jwt.leeway_seconds: expected a number"),
        ({"leeway_seconds": True}, "identity.user.jwt.leeway_seconds: expected a number"),
        ({"leeway_seconds": -1}, "identity.user.jwt.leeway_seconds: must be between 0 and 300"),
        ({"leeway_seconds": float("nan")}, "leeway_seconds: expected a number"),
        ({"jwks_refresh_seconds": 0}, "identity.user.jwt.jwks_refresh_seconds: must be between"),
        ({"header": "x-api-key"}, "identity.user.jwt.header: 'x-api-key' is also"),
        ({"secret": "s3cr3t"}, "identity.user.jwt.secret: unknown key"),
        ({"max_failed_verify_ms": 0}, "identity.user.jwt.max_failed_verify_ms: expected milli"),
        ({"max_failed_verify_ms": "5"}, "max_failed_verify_ms: expected milliseconds"),
        ({"max_failed_verify_ms": True}, "max_failed_verify_ms: expected milliseconds"),
        ({"max_failed_verify_ms": float("inf")}, "max_failed_verify_ms: expected milliseconds"),
        ({"max_failed_verify_ms_per_client": 1001}, "per_client: expected milliseconds"),
    ],
)
def test_each_jwt_mistake_is_named_by_its_key_path(overrides, message):
    with pytest.raises(IdentityConfigError) as caught:
        parse_identity_config(jwt_section(**overrides), BASE)
    assert message in str(caught.value)


def test_header_from_any_contradicts_jwt():
    raw = jwt_section()
    raw["user"]["header_from"] = "any"
    with pytest.raises(IdentityConfigError, match=r"identity\.user\.header_from: 'any'"):
        parse_identity_config(raw, BASE)
    raw["user"]["header_from"] = "trusted"
    assert parse_identity_config(raw, BASE).user.header_from == "trusted"


def test_the_error_is_a_value_error():
    assert issubclass(IdentityConfigError, ValueError)


def test_the_pure_identity_modules_import_no_network_or_counting_code():
    import ast

    package = Path(__file__).resolve().parents[2] / "gateway" / "identity"
    banned = ("aiohttp", "redis", "gateway.proxy", "gateway.counters", "gateway.policy")
    for name in (
        "config.py",
        "keys.py",
        "key_edit.py",
        "safe_yaml.py",
        "jwks.py",
        "verify_budget.py",
    ):
        tree = ast.parse((package / name).read_text())
        imported = {
            alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        for module in imported:
            assert not any(module == b or module.startswith(b + ".") for b in banned), (
                name,
                module,
            )
