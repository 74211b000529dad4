"""HTTPS settings (gateway/settings.py ``tls_cert``, ``tls_key``, the config file's ``tls``
section) and their setup (gateway/tls_setup.py): where each value comes from, the
errors that say what does not fit, files refused as configuration errors, and reloads
counted in the metrics. Certificates are real (tests/support/tls_pki.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gateway.metrics import Metrics
from gateway.proxy.tls import PASSPHRASE_ENV, TlsListener
from gateway.settings import (
    Settings,
    SettingsError,
    TlsConfig,
    TlsPair,
    load_settings,
)
from gateway.tls_setup import admin_tls, check_tls, tls_listener, tls_source
from tests.support.tls_pki import Pki, write_pair


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return str(path)


def load(tmp_path: Path, text: str = "", flags: dict | None = None, env: dict | None = None):
    file = config(tmp_path, text) if text else None
    return load_settings(flags or {}, env=env or {}, config_file=file)


@pytest.fixture(scope="module")
def pki() -> Pki:
    return Pki()


# --- where the values come from


def test_without_a_certificate_both_ports_are_plain(tmp_path: Path) -> None:
    assert load(tmp_path).tls_config() == TlsConfig()
    assert Settings().tls_config() == TlsConfig(proxy=None, admin=None)
    assert tls_source(Settings(), Metrics()) is None
    assert tls_listener(Settings(), Metrics()) is None
    assert admin_tls(Settings(), Metrics()) is None
    check_tls(Settings())  # nothing to load


def test_flags_and_environment_give_the_pair_as_given(tmp_path: Path) -> None:
    s = load(tmp_path, flags={"tls_cert": "certs/tls.crt", "tls_key": "certs/tls.key"})
    assert s.tls_config() == TlsConfig(proxy=TlsPair("certs/tls.crt", "certs/tls.key"))
    env = {"GATEWAY_TLS_CERT": "/etc/gw/tls.crt", "GATEWAY_TLS_KEY": "/etc/gw/tls.key"}
    config = load(tmp_path, env=env).tls_config()
    assert config.proxy == TlsPair("/etc/gw/tls.crt", "/etc/gw/tls.key")
    assert (config.client_auth, config.watch_interval, config.handshake_timeout) == (
        "none",
        5.0,
        10.0,
    )
    # The flag over the environment, field by field (as every setting).
    mixed = load(tmp_path, flags={"tls_cert": "flag.crt"}, env=env).tls_config()
    assert mixed.proxy == TlsPair("flag.crt", "/etc/gw/tls.key")


def test_the_config_file_section_with_paths_beside_it(tmp_path: Path) -> None:
    s = load(
        tmp_path,
        "tls:\n"
        "  cert: certs/tls.crt\n"
        "  key: /abs/tls.key\n"
        "  client_ca: clients-ca.pem\n"
        "  client_auth: required\n"
        "  watch_interval: 2\n"
        "  handshake_timeout: 3.5\n"
        "  admin: {cert: admin.crt, key: admin.key}\n",
    )
    assert s.tls_config() == TlsConfig(
        proxy=TlsPair(str(tmp_path / "certs/tls.crt"), "/abs/tls.key"),
        client_ca=str(tmp_path / "clients-ca.pem"),
        client_auth="required",
        watch_interval=2.0,
        handshake_timeout=3.5,
        admin=TlsPair(str(tmp_path / "admin.crt"), str(tmp_path / "admin.key")),
    )
    assert s.tls_cert is None  # the section is not copied into the flag's field


def test_a_flag_pair_replaces_the_files_pair_and_keeps_its_other_settings(
    tmp_path: Path,
) -> None:
    s = load(
        tmp_path,
        "tls: {cert: file.crt, key: file.key, client_ca: ca.pem, client_auth: optional}\n",
        flags={"tls_cert": "/run/flag.crt", "tls_key": "/run/flag.key"},
    )
    config = s.tls_config()
    assert config.proxy == TlsPair("/run/flag.crt", "/run/flag.key")
    assert (config.client_ca, config.client_auth) == (str(tmp_path / "ca.pem"), "optional")


def test_the_admin_port_alone_may_serve_https(tmp_path: Path) -> None:
    config = load(tmp_path, "tls:\n  admin: {cert: a.crt, key: a.key}\n").tls_config()
    assert config.proxy is None
    assert config.admin == TlsPair(str(tmp_path / "a.crt"), str(tmp_path / "a.key"))


def test_the_passphrase_has_no_flag_and_no_config_key(tmp_path: Path) -> None:
    import argparse

    from gateway.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in commands.choices["serve"]._actions for o in a.option_strings}
    assert not {f for f in flags if "pass" in f}
    with pytest.raises(SettingsError, match=f"environment variable {PASSPHRASE_ENV}"):
        load(tmp_path, "tls: {cert: a.crt, key: a.key, passphrase: hunter2}\n")


# --- what does not fit


@pytest.mark.parametrize(
    ("flags", "env", "words"),
    [
        ({"tls_cert": "a.crt"}, {}, "tls_cert (--tls-cert, GATEWAY_TLS_CERT) is set but tls_key"),
        ({}, {"GATEWAY_TLS_KEY": "a.key"}, "tls_key (--tls-key, GATEWAY_TLS_KEY) is set but"),
        ({"tls_cert": "a.crt", "tls_key": ""}, {}, "give the certificate and its key together"),
    ],
)
def test_half_a_pair_from_flags_or_environment(tmp_path, flags, env, words) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, flags=flags, env=env)
    assert words in str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("tls: [a.crt, a.key]\n", "'tls' is a mapping"),
        ("tls: {cert: a.crt}\n", "tls.cert is given without tls.key"),
        ("tls: {key: a.key}\n", "tls.key is given without tls.cert"),
        ("tls: {cert: '', key: a.key}\n", "tls.cert must be a file path"),
        ("tls: {cert: 5, key: a.key}\n", "tls.cert must be a file path"),
        ("tls: {crt: a.crt, key: a.key}\n", "unknown key(s) ['crt']; it takes cert, key,"),
        (
            "tls: {cert: a.crt, key: a.key, client_auth: required}\n",
            "tls.client_auth is 'required' but there is no tls.client_ca",
        ),
        (
            "tls: {cert: a.crt, key: a.key, client_auth: optional}\n",
            "tls.client_auth is 'optional' but there is no tls.client_ca",
        ),
        (
            "tls: {cert: a.crt, key: a.key, client_ca: ca.pem}\n",
            "tls.client_ca is given but client certificates are not asked for",
        ),
        (
            "tls: {cert: a.crt, key: a.key, client_ca: ca.pem, client_auth: none}\n",
            "tls.client_ca is given but client certificates are not asked for",
        ),
        (
            "tls: {cert: a.crt, key: a.key, client_ca: ca.pem, client_auth: sometimes}\n",
            "tls.client_auth must be 'none', 'optional' or 'required', not 'sometimes'",
        ),
        (  # YAML reads a bare off as false
            "tls: {cert: a.crt, key: a.key, client_ca: ca.pem, client_auth: off}\n",
            "tls.client_auth must be 'none', 'optional' or 'required', not False",
        ),
        ("tls: {cert: a.crt, key: a.key, watch_interval: 0}\n", "tls.watch_interval must be"),
        ("tls: {cert: a.crt, key: a.key, watch_interval: -1}\n", "positive number of seconds"),
        ("tls: {cert: a.crt, key: a.key, watch_interval: '5'}\n", "not '5'"),
        ("tls: {cert: a.crt, key: a.key, watch_interval: true}\n", "not True"),
        ("tls: {cert: a.crt, key: a.key, watch_interval: .nan}\n", "not nan"),
        ("tls: {cert: a.crt, key: a.key, handshake_timeout: 0}\n", "tls.handshake_timeout"),
        ("tls: {admin: {cert: a.crt}}\n", "tls.admin.cert is given without tls.admin.key"),
        ("tls: {admin: {cert: a.crt, key: a.key, ca: c}}\n", "tls.admin takes 'cert' and 'key'"),
        ("tls: {admin: a.crt}\n", "tls.admin takes 'cert' and 'key' only"),
        ("tls: {admin: {}}\n", "tls.admin needs 'cert' and 'key'"),
        (
            "tls: {admin: {cert: a.crt, key: a.key}, client_ca: ca.pem, client_auth: required}\n",
            "tls.client_ca applies to HTTPS on the proxy port, which has no certificate",
        ),
        ("tls: {handshake_timeout: 3}\n", "tls.handshake_timeout applies to HTTPS on the proxy"),
        ("tls: {watch_interval: 3}\n", "tls has no certificate: give tls.cert and tls.key"),
        (
            "tls_cert: a.crt\ntls_key: a.key\ntls: {cert: b.crt, key: b.key}\n",
            "the certificate is given twice",
        ),
    ],
)
def test_bad_tls_sections_say_what_is_wrong(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(SettingsError) as info:
        load(tmp_path, text)
    message = str(info.value)
    assert words in message
    assert message.startswith(f"config file {tmp_path / 'gateway.yaml'}")


def test_top_level_file_keys_are_the_flags_names(tmp_path: Path) -> None:
    # As every setting: the config file takes the flag's name too (paths as given).
    s = load(tmp_path, "tls_cert: a.crt\ntls_key: a.key\n")
    assert s.tls_config().proxy == TlsPair("a.crt", "a.key")


# --- the files behind the settings


def test_files_that_cannot_be_used_are_configuration_errors(tmp_path: Path, pki: Pki) -> None:
    missing = Settings(tls_cert=str(tmp_path / "nope.crt"), tls_key=str(tmp_path / "nope.key"))
    for attempt in (
        lambda: tls_source(missing, Metrics()),
        lambda: tls_listener(missing, Metrics()),
        lambda: check_tls(missing),
    ):
        with pytest.raises(SettingsError) as info:
            attempt()
        assert str(info.value) == (
            f"HTTPS on the proxy port: TLS certificate file {tmp_path / 'nope.crt'} does not "
            "exist: check the path (a symlink must point at an existing file)"
        )
    cert, key = write_pair(tmp_path / "admin", pki.issue("admin.test"), passphrase=b"s3cret")
    admin_only = Settings(tls={"admin": {"cert": cert, "key": key}})
    with pytest.raises(SettingsError) as info:
        admin_tls(admin_only, Metrics(), env={})
    assert str(info.value).startswith(f"HTTPS on the admin port: TLS private key file {key} is")
    assert PASSPHRASE_ENV in str(info.value) and "s3cret" not in str(info.value)
    with pytest.raises(SettingsError, match="HTTPS on the admin port"):
        check_tls(admin_only, env={})
    # The passphrase from the environment (the one variable, for either port's key).
    assert admin_tls(admin_only, Metrics(), env={PASSPHRASE_ENV: "s3cret"}) is not None
    check_tls(admin_only, env={PASSPHRASE_ENV: "s3cret"})


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("gateway_tls_")
    }


def test_reloads_are_counted_and_the_expiry_follows_the_certificate(
    tmp_path: Path, pki: Pki
) -> None:
    first = pki.issue("gateway.test", serial=501)
    cert, key = write_pair(tmp_path / "live", first)
    settings = Settings(
        tls_cert=cert,
        tls_key=key,
        tls={"watch_interval": 0.5, "handshake_timeout": 4},
    )
    metrics = Metrics()
    assert samples(metrics) == {}  # no TLS series until a listener is made
    listener = tls_listener(settings, metrics)
    assert isinstance(listener, TlsListener)
    assert (listener.name, listener.watch_interval, listener.handshake_timeout) == (
        "proxy",
        0.5,
        4.0,
    )
    expiry = ("gateway_tls_certificate_expiry_timestamp_seconds", (("listener", "proxy"),))
    assert samples(metrics)[expiry] == first.cert.not_valid_after_utc.timestamp()

    def reloads(outcome: str) -> float:
        key = ("gateway_tls_reloads_total", (("listener", "proxy"), ("outcome", outcome)))
        return samples(metrics).get(key, 0.0)

    assert not listener.source.reload("test")  # the same files: unchanged
    assert reloads("unchanged") == 1
    # A rotation to a certificate that lives longer.
    lifetime = first.cert.not_valid_after_utc - first.cert.not_valid_before_utc
    longer = pki.issue(
        "gateway.test", serial=503, not_after=first.cert.not_valid_after_utc + lifetime
    )
    write_pair(tmp_path / "live", longer)
    assert listener.source.reload("test")
    assert reloads("ok") == 1
    assert samples(metrics)[expiry] == longer.cert.not_valid_after_utc.timestamp()
    # A key that is not the certificate's: refused, the pair in force kept.
    Path(key).write_bytes(Path(write_pair(tmp_path / "other", pki.issue("x"))[1]).read_bytes())
    assert not listener.source.reload("test")
    assert reloads("refused") == 1
    assert samples(metrics)[expiry] == longer.cert.not_valid_after_utc.timestamp()
    info = listener.info()
    assert info["serial"] == f"{503:x}" and info["reload_failures"] == 1
    assert "does not belong to the certificate" in str(info["last_error"])
    assert info["handshake_timeout"] == 4.0 and info["watch_interval"] == 0.5
    json.dumps(info)  # /info is JSON
    assert not math.isnan(samples(metrics)[expiry])
    line = listener.describe()
    assert line.startswith("TLS on the proxy port: certificate ")
    assert "serial 1f7" in line and f"client certificates none, from {cert}; " in line
    assert line.endswith(
        "reloaded when the files change (looked at every 0.5 s) and on SIGHUP; "
        "plain HTTP is answered 400"
    )


def test_the_serve_command_takes_the_pair(tmp_path: Path) -> None:
    from gateway.cli import build_parser

    args = vars(build_parser().parse_args(["serve", "--tls-cert", "a.crt", "--tls-key", "a.key"]))
    flags = {k: v for k, v in args.items() if k not in ("func", "command", "config")}
    assert load_settings(flags, env={}).tls_config().proxy == TlsPair("a.crt", "a.key")
    args = vars(build_parser().parse_args(["serve"]))
    assert args["tls_cert"] is None and args["tls_key"] is None
