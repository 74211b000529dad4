"""ControlPlaneConfig.from_mapping and the start-up credential bootstrap."""

from __future__ import annotations

import json
import stat

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.upstreams.control_plane import ControlPlaneConfig, bootstrap_credentials
from gateway.upstreams.control_plane.credentials import find_credential, hash_api_key

from .support import KEY_A, TENANT_A, running_control_plane, sha


def test_defaults(tmp_path):
    config = ControlPlaneConfig.from_mapping({}, tmp_path, {})
    assert config.revision_step_seconds == 2.0
    assert config.credentials == ()
    assert config.database_path.parent == tmp_path


def test_environment_credential_and_pacing(tmp_path):
    env = {
        "GATEWAY_API_KEY": KEY_A,
        "GATEWAY_TENANT_ID": TENANT_A,
        "GATEWAY_REVISION_STEP_SECONDS": "0.25",
    }
    config = ControlPlaneConfig.from_mapping({"revision_step_seconds": 5}, tmp_path, env)
    assert config.revision_step_seconds == 0.25
    (credential,) = config.credentials
    assert credential.key_sha256 == hash_api_key(KEY_A)
    assert credential.tenant_ids == {TENANT_A}
    assert KEY_A not in repr(config)
    assert find_credential(config.credentials, KEY_A) is credential
    assert find_credential(config.credentials, KEY_A + "x") is None


def test_file_credentials_are_hashes(tmp_path):
    section = {"credentials": [{"api_key_sha256": sha("k").upper(), "tenant_ids": ["t1", "t2"]}]}
    config = ControlPlaneConfig.from_mapping(section, tmp_path, {})
    assert find_credential(config.credentials, "k").tenant_ids == {"t1", "t2"}


@pytest.mark.parametrize(
    ("section", "env", "message"),
    [
        ({"revision_step_seconds": -1}, {}, "revision_step_seconds"),
        ({"revision_step_seconds": "fast"}, {}, "revision_step_seconds"),
        ({"revision_step_seconds": True}, {}, "revision_step_seconds"),
        ({}, {"GATEWAY_REVISION_STEP_SECONDS": "nan"}, "GATEWAY_REVISION_STEP_SECONDS"),
        ({"revision_step_seconds": 99999}, {}, "at most"),
        ({"unknown": 1}, {}, "unknown"),
        ({}, {"GATEWAY_API_KEY": "k"}, "GATEWAY_TENANT_ID"),
        ({}, {"GATEWAY_API_KEY": "k", "GATEWAY_TENANT_ID": "bad tenant"}, "GATEWAY_TENANT_ID"),
        ({"credentials": {"a": 1}}, {}, "credentials"),
        ({"credentials": [{"api_key_sha256": "abc", "tenant_ids": ["t"]}]}, {}, "api_key_sha256"),
        ({"credentials": [{"api_key_sha256": sha("k"), "tenant_ids": []}]}, {}, "tenant_ids"),
        ({"credentials": [{"api_key": "plain", "tenant_ids": ["t"]}]}, {}, "unknown"),
        ({"integrations": {"github": {"install_url": "ftp://x"}}}, {}, "install_url"),
        (
            {"integrations": {"github": {"installations": [{"id": "a"}, {"id": "a"}]}}},
            {},
            "duplicate",
        ),
        ({"integrations": {"gitlab": {}}}, {}, "gitlab"),
    ],
)
def test_bad_values_are_value_errors(tmp_path, section, env, message):
    with pytest.raises(ValueError, match=message):
        ControlPlaneConfig.from_mapping(section, tmp_path, env)


def test_bootstrap_is_noop_when_configured(tmp_path):
    config = ControlPlaneConfig.from_mapping(
        {}, tmp_path, {"GATEWAY_API_KEY": KEY_A, "GATEWAY_TENANT_ID": TENANT_A}
    )
    assert bootstrap_credentials(config) == (config, None)
    assert not config.credential_file.exists()


# SQLite only: it reads the database file for the raw key.
@pytest.mark.parametrize("control_plane_backend", ["sqlite"])
async def test_bootstrap_generates_keeps_and_reloads(tmp_path):
    data_dir = tmp_path / "data"
    config = ControlPlaneConfig.from_mapping({"revision_step_seconds": 0.05}, data_dir, {})
    first, message = bootstrap_credentials(config)
    stored = json.loads(config.credential_file.read_text())
    # The key is never logged: the message says where it is (SECURITY.md).
    assert stored["api_key"] not in message and stored["tenant_id"] in message
    assert str(config.credential_file) in message
    assert stat.S_IMODE(config.credential_file.stat().st_mode) == 0o600
    (credential,) = first.credentials
    assert credential.key_sha256 == hash_api_key(stored["api_key"])

    again, message2 = bootstrap_credentials(config)
    assert again.credentials == first.credentials
    assert stored["api_key"] not in message2
    assert stored["tenant_id"] in message2

    async with running_control_plane(again) as cp, aiohttp.ClientSession(cp.url) as s:
        ok = {"X-Api-Key": stored["api_key"], "X-Tenant-Id": stored["tenant_id"]}
        r = await s.get("/v2/deployments", headers=ok)
        assert r.status == 200
    # The database holds no raw key.
    assert stored["api_key"].encode() not in config.database_path.read_bytes()


def test_bootstrap_rejects_a_corrupt_credential_file(tmp_path):
    config = ControlPlaneConfig.from_mapping({}, tmp_path, {})
    config.credential_file.write_text("{not json")
    with pytest.raises(ValueError, match="credential"):
        bootstrap_credentials(config)


# Tenants are answered with the install URL and every repository URL as written, so a
# credential in one would be handed to every tenant that may see it: refused at load,
# in either place and whatever its spelling, and the error never quotes it.
_SECRET = "s3cr%40t-Tok:en"
_WITH_CREDENTIALS = [
    f"https://x-access-token:{_SECRET}@github.com/acme/app",
    f"https://{_SECRET}@github.com/acme/app",
    f"HTTPS://user:{_SECRET}@github.com:443/acme/app",
    f"http://:{_SECRET}@github.com/acme/app",
    f"https://u:{_SECRET}@[::1]:8443/acme/app",
    f"https://{_SECRET}@/acme/app",
    f"https://github.com/acme/app?access_token={_SECRET}",  # a review: the query and
    f"https://github.com/acme/app#token={_SECRET}",  # fragment carry tokens too
    f"https://user%3A{_SECRET}%40github.com/acme/app",  # an encoded user and password
]
_NOT_URLS = [
    f"https://github.com/acme/{_SECRET} app",
    f"https://github.com/acme/\n{_SECRET}",
    f"https://github.com/acme/app\u00a0{_SECRET}",  # non-ASCII white space
    f"https://github.com\u2028/{_SECRET}",
    f"https://[{_SECRET}/acme",
    f"https://github.com:{_SECRET}/acme",
    "ftp://github.com/acme/app",
    "https:///acme/app",
    42,
]


def _integrations(install_url=None, repo_url=None):
    github = {"installations": [{"id": "i1", "repos": [{"owner": "acme", "name": "app"}]}]}
    if install_url is not None:
        github["install_url"] = install_url
    if repo_url is not None:
        github["installations"][0]["repos"][0]["url"] = repo_url
    return {"integrations": {"github": github}}


@pytest.mark.parametrize("place", ["install_url", "url"])
@pytest.mark.parametrize("value", _WITH_CREDENTIALS + _NOT_URLS)
def test_urls_shown_to_tenants_carry_no_credentials(tmp_path, place, value):
    section = _integrations(**{("install_url" if place == "install_url" else "repo_url"): value})
    with pytest.raises(ValueError) as caught:
        ControlPlaneConfig.from_mapping(section, tmp_path, {})
    message = str(caught.value)
    assert place in message
    assert "s3cr" not in message and "Tok" not in message
    if value in _WITH_CREDENTIALS:
        assert "credentials" in message


@pytest.mark.parametrize(
    "value",
    [
        "https://github.com/acme/app",
        "https://github.example.com:8443/acme/app",
        "http://[::1]:3000/acme/app",
        "https://gitlab.example.com/group/sub/app.git",
    ],
)
def test_urls_shown_to_tenants_as_written(tmp_path, value):
    config = ControlPlaneConfig.from_mapping(_integrations(value, value), tmp_path, {})
    assert config.github_install_url == value
    assert config.github_integrations[0].repos[0].url == value


# --- one credential per key: a repeated key acted on the tenants of its last entry only

POOL = ["key-one-0123456789abcdef", "key-two-0123456789abcdef", "key-three-0123456789abcd"]
TENANTS = ["t-a", "t-b", "t-c"]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(
        st.tuples(
            st.sampled_from(POOL),
            st.booleans(),  # the digest written in upper case
            st.lists(st.sampled_from(TENANTS), min_size=1, max_size=3, unique=True),
        ),
        max_size=5,
    ),
    env=st.none() | st.tuples(st.sampled_from(POOL), st.sampled_from(TENANTS)),
)
def test_a_key_is_listed_once_or_the_config_is_refused(tmp_path, entries, env) -> None:
    """Property: the config loads exactly when no key is given twice (a digest in either
    case, or GATEWAY_API_KEY again); then each key acts on exactly its entry's tenants.
    A refusal names the entries, never a key or a digest."""
    section = {
        "credentials": [
            {"api_key_sha256": sha(k).upper() if upper else sha(k), "tenant_ids": t}
            for k, upper, t in entries
        ]
    }
    environ = {"GATEWAY_API_KEY": env[0], "GATEWAY_TENANT_ID": env[1]} if env else {}
    given_keys = [k for k, _, _ in entries] + ([env[0]] if env else [])
    if len(set(given_keys)) < len(given_keys):
        with pytest.raises(
            ValueError, match=r"the same API key as control_plane\.credentials\[\d\]"
        ) as refused:
            ControlPlaneConfig.from_mapping(section, tmp_path, environ)
        text = str(refused.value)
        assert not any(k in text or sha(k) in text.lower() for k in POOL)
        if (
            env
            and env[0] in [k for k, _, _ in entries]
            and len(set(k for k, _, _ in entries)) == len(entries)
        ):
            assert text.startswith("GATEWAY_API_KEY: ")
        return
    config = ControlPlaneConfig.from_mapping(section, tmp_path, environ)
    expected = {k: set(t) for k, _, t in entries}
    if env:
        expected[env[0]] = {env[1]}
    for key in POOL:
        found = find_credential(config.credentials, key)
        assert (found.tenant_ids if found else None) == expected.get(key)
