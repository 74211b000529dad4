from __future__ import annotations

import pytest

from gateway.settings import SettingsError, load_settings


def test_precedence_flag_over_env_over_file_over_default(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text("port: 7001\nadmin_port: 7101\nregion: eu\nworkers: 3\n")
    env = {"GATEWAY_PORT": "7002", "GATEWAY_ADMIN_PORT": "7102"}
    s = load_settings({"port": 7003}, env=env, config_file=str(config))
    assert s.port == 7003  # flag
    assert s.admin_port == 7102  # env beats file
    assert s.region == "eu"  # file beats default
    assert s.workers == 3
    assert s.host == "127.0.0.1"  # default
    assert load_settings({}, env={"GATEWAY_CONFIG": str(config)}).port == 7001


def test_lists_and_booleans_from_env():
    s = load_settings(
        {},
        env={
            "GATEWAY_TRUSTED_PROXIES": "10.0.0.0/8, 192.168.0.0/16",
            "GATEWAY_EMBEDDED": "false",
            "GATEWAY_RULES": "a.yaml,b",
        },
    )
    assert s.trusted_proxies == ("10.0.0.0/8", "192.168.0.0/16")
    assert s.embedded is False and not s.embedded_enabled
    assert s.rules == ("a.yaml", "b")
    assert load_settings({}, env={}).embedded_enabled  # no upstream: built-ins on
    assert not load_settings({"upstream": "http://127.0.0.1:1"}, env={}).embedded_enabled


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("prot: 1\n", "unknown key(s) ['prot']"),
        ("port: many\n", "setting 'port' from config file"),
        ("regions: {us: {redis_url: 'redis://x:1', typo: 1}}\n", "regions.us takes"),
        ("region: mars\n", "region must be one of"),
        ("regions: {us: {}}\nregion: eu\n", "default region 'eu' is not in"),
        ("redis_url: 'mysql://x'\n", "counter URL of region us"),
        ("identity_secret: short\n", "at least 16 bytes"),
        ("upstream: 'ftp://x'\n", "http:// or https://"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_bad_config_files_say_what_is_wrong(tmp_path, text, words):
    config = tmp_path / "gw.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError) as info:
        load_settings({}, env={}, config_file=str(config))
    assert words in str(info.value)


def test_bad_env_value_names_the_variable():
    with pytest.raises(SettingsError, match="GATEWAY_WORKERS"):
        load_settings({}, env={"GATEWAY_WORKERS": "lots"})


def test_regions_section_orders_the_default_first(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text(
        "region: eu\nregions:\n  us: {hosts: [API.example.com]}\n"
        "  eu: {redis_url: 'redis://127.0.0.1:6390/0', hosts: eu.example.com}\n"
    )
    s = load_settings({}, env={}, config_file=str(config))
    table = s.region_table()
    assert [r.name for r in table] == ["eu", "us"]
    assert table[0].counter_url == "redis://127.0.0.1:6390/0"
    assert table[1].hosts == ("api.example.com",)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"trusted_proxies": ["10.0.0.0/33"]}, "bad trusted-proxy CIDR"),
        ({"ipv6_prefix": 200}, "ipv6 prefix must be 1..128"),
        ({"log_level": "verbose"}, "log_level must be"),
        ({"workers": 2, "port": 0}, "workers needs a fixed --port"),
    ],
)
def test_bad_flags_are_settings_errors(flags, words):
    with pytest.raises(SettingsError, match=words.split()[0]) as info:
        load_settings(flags, env={})
    assert words in str(info.value)


def test_redis_url_with_regions_section_is_refused(tmp_path):
    config = tmp_path / "gw.yaml"
    config.write_text("regions: {us: {redis_url: 'redis://127.0.0.1:1/0'}}\n")
    with pytest.raises(SettingsError, match="both given"):
        load_settings({"redis_url": "redis://127.0.0.1:2/0"}, env={}, config_file=str(config))


BAD_UPSTREAMS = [
    ("ftp://x", "must be an http:// or https:// URL"),
    ("not a url", "must be an http:// or https:// URL"),
    ("localhost:2024", "must be an http:// or https:// URL"),
    ("http://", "names no host"),
    ("https://:8443/", "names no host"),
    ("http://billing:99999", "not a valid URL"),
    ("http://bill ing:80", "holds whitespace"),
]


@pytest.mark.parametrize(("url", "words"), BAD_UPSTREAMS)
def test_an_unusable_upstream_url_is_refused_at_start_up_wherever_it_is_given(tmp_path, url, words):
    """The class: --upstream, the config file's upstream and each route's URL are
    checked alike (a route's used to be taken whatever it held, and every request on it
    answered 502)."""
    with pytest.raises(SettingsError, match=words):
        load_settings({"upstream": url}, env={})
    for body in (f"upstream: {url!r}\n", f"routes:\n  /billing: {url!r}\n",
                 f"routes:\n  /ws: {{url: {url!r}, upgrade: true}}\n"):  # fmt: skip
        config = tmp_path / "gateway.yaml"
        config.write_text(body)
        with pytest.raises(SettingsError, match=words):
            load_settings({}, env={}, config_file=str(config))


def test_a_password_in_a_refused_upstream_url_is_not_repeated(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("routes:\n  /billing: 'http://svc:s3cret@:80/'\n")
    with pytest.raises(SettingsError) as refused:
        load_settings({}, env={}, config_file=str(config))
    assert "s3cret" not in str(refused.value) and "names no host" in str(refused.value)


def test_good_upstream_urls_are_taken(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "routes:\n  /billing: http://billing.internal:8080/v1\n"
        "  /ws: {url: 'https://[2001:db8::1]:8443', upgrade: true}\n"
    )
    s = load_settings({"upstream": "http://127.0.0.1:2024"}, env={}, config_file=str(config))
    assert dict(s.routes)["/billing"] == "http://billing.internal:8080/v1"


def test_a_data_dir_that_is_a_file_is_said_plainly(tmp_path):
    plain = tmp_path / "notadir"
    plain.write_text("")
    with pytest.raises(SettingsError, match="is a file, not a directory"):
        load_settings({"data_dir": str(plain)}, env={})
    load_settings({"data_dir": str(tmp_path / "new")}, env={})  # missing: created later


def test_an_upstream_url_ending_in_a_newline_is_taken_without_it(tmp_path):
    """A value from a file (a ConfigMap, a CRLF .env, a YAML block) ends in a newline:
    taken without it, as before the URLs were checked (review finding)."""
    for raw in ("http://127.0.0.1:8080\n", "http://127.0.0.1:8080\r", " http://127.0.0.1:8080 "):
        s = load_settings({}, env={"GATEWAY_UPSTREAM": raw})
        assert s.upstream == "http://127.0.0.1:8080"
    config = tmp_path / "gateway.yaml"
    config.write_text("routes:\n  /billing: |\n    http://billing:8080\n")
    s = load_settings({}, env={}, config_file=str(config))
    assert dict(s.routes)["/billing"] == "http://billing:8080"


def test_a_password_with_a_slash_is_not_repeated_either():
    with pytest.raises(SettingsError) as refused:
        load_settings({"upstream": "http://svc:s3cr/et@api.internal:99999"}, env={})
    assert "s3cr" not in str(refused.value) and "et@" not in str(refused.value)
