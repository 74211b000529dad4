"""One frozen settings object.

Precedence: command-line flag > ``GATEWAY_*`` environment > config file > default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway.policy.loader import DEFAULT_REGIONS
from gateway.urls import display_url


class SettingsError(ValueError):
    """A setting has a bad value; the message names it and where it came from."""


@dataclass(frozen=True)
class RegionSettings:
    name: str
    counter_url: str | None  # None: in-process counters
    hosts: tuple[str, ...] = ()  # Host header values (no port) served as this region


CLIENT_AUTH_MODES = ("none", "optional", "required")
TLS_SECTION_KEYS = (
    "cert", "key", "client_ca", "client_auth", "watch_interval", "handshake_timeout", "admin",
)  # fmt: skip
DEFAULT_TLS_WATCH_INTERVAL = 5.0  # seconds between looks at the certificate files
DEFAULT_TLS_HANDSHAKE_TIMEOUT = 10.0


@dataclass(frozen=True)
class TlsPair:
    """A PEM certificate chain (leaf first) and its private key."""

    cert: str
    key: str


@dataclass(frozen=True)
class TlsConfig:
    """HTTPS as configured (``Settings.tls_config()``): on the proxy port when ``proxy``
    is set, on the admin port when ``admin`` is. The files themselves are read (and
    refused with a clear error) when the listeners start: gateway/tls_setup.py."""

    proxy: TlsPair | None = None
    client_ca: str | None = None  # the CA whose client certificates the proxy port asks for
    client_auth: str = "none"  # none | optional | required
    watch_interval: float = DEFAULT_TLS_WATCH_INTERVAL
    handshake_timeout: float = DEFAULT_TLS_HANDSHAKE_TIMEOUT
    admin: TlsPair | None = None


def _default_rules() -> tuple[str, ...]:
    # ./rules when run from a checkout or a container workdir; else the rules/ folder of
    # the source tree this package was installed from (editable installs).
    for candidate in (Path("rules"), Path(__file__).resolve().parent.parent / "rules"):
        if candidate.is_dir():
            return (str(candidate),)
    return ("rules",)


@dataclass(frozen=True)
class Settings:
    """Everything ``gateway serve`` needs. Field names are the config-file keys; the
    environment variable is ``GATEWAY_`` + the upper-cased name."""

    rules: tuple[str, ...] = field(default_factory=_default_rules)
    region: str = "us"
    redis_url: str | None = None
    upstream: str | None = None
    embedded: bool | None = None  # None: on when no --upstream is given
    data_dir: str = "data"
    # PostgreSQL for the built-in Store and control plane (several gateways, one Store);
    # None keeps them in SQLite files under data_dir.
    database_url: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9090
    # Needed by the operator console when the admin port is not on loopback (environment
    # GATEWAY_ADMIN_TOKEN or the config file; no flag: flags show in process lists).
    admin_token: str | None = None
    # Host header values the admin port answers without a token, besides loopback names
    # and addresses and admin_host itself (a defence against DNS rebinding).
    admin_allowed_hosts: tuple[str, ...] = ()
    # HTTPS on the proxy port: a PEM certificate chain and its key (--tls-cert/--tls-key,
    # GATEWAY_TLS_CERT/GATEWAY_TLS_KEY, or the config file's tls: {cert:, key:}). An
    # encrypted key's passphrase is read from GATEWAY_TLS_KEY_PASSPHRASE only.
    tls_cert: str | None = None
    tls_key: str | None = None
    workers: int = 1
    trusted_proxies: tuple[str, ...] = ()
    ipv6_prefix: int = 64
    identity_secret: str | None = None
    redis_timeout_ms: float = 50.0
    deny_cache: bool = True
    memory_max_keys: int = 1_000_000  # in-process counters kept at most (~400 bytes each)
    upstream_connect_timeout: float = 5.0
    upstream_timeout: float = 60.0  # until the upstream's response headers
    upstream_read_timeout: float = 300.0  # longest silence inside a streamed body
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 8190
    max_headers: int = 100
    client_idle_timeout: float = 75.0  # keep-alive between requests
    body_read_timeout: float = 60.0  # longest silence while receiving a request body
    header_timeout: float = 10.0  # a request's head must arrive whole within this (408)
    max_connections: int = 10_000  # client connections open at once; more are closed
    # Streamed request bodies (over 64 KiB) holding an upstream connection at once, per
    # client address; all clients together may hold at most half the upstream pool.
    max_uploads_per_client: int = 8
    # Streamed answers holding an upstream connection at once, per client address (a
    # client that asks for large answers and never reads them holds the pool otherwise).
    max_downloads_per_client: int = 8
    # Requests forwarded and not yet answered whole (each holds an upstream connection,
    # or waits for one), per client address; 0: a quarter of upstream_pool_size, and at
    # least max_uploads_per_client + max_downloads_per_client. Long polls and slow
    # answers from one address cannot take the whole pool.
    max_exchanges_per_client: int = 0
    # Client connections open at once from one address; 0: max_connections // 8.
    max_client_connections: int = 0
    # X-HTTP-Method-Override, X-HTTP-Method and X-Method-Override are dropped unless this
    # is on; then the rule is chosen by the overridden method.
    keep_method_override: bool = False
    # Upgraded connections (WebSocket ...): open at once in all and from one client
    # address, closed after this much silence both ways; optional byte and time caps.
    max_tunnels: int = 1024
    max_tunnels_per_client: int = 64
    tunnel_idle_timeout: float = 300.0
    tunnel_max_bytes: int = 0  # 0: unbounded
    tunnel_max_seconds: float = 0.0  # 0: unbounded
    # Rate-limit fields on answers: ietf (RateLimit-Policy, RateLimit), legacy
    # (X-RateLimit-Limit/-Remaining/-Reset), both or none.
    rate_limit_headers: str = "ietf"
    upstream_upgrade: bool = True  # --upstream takes upgrades (WebSocket ...)
    shutdown_timeout: float = 30.0
    upstream_pool_size: int = 256
    access_log: str = "plain"  # plain | json | off
    access_log_file: str = "-"  # where access lines go, and nothing else ("-": stdout)
    log_level: str = "INFO"
    log_format: str = "text"  # the application's own logs on stderr: text | json
    watch_rules: bool = True
    watch_interval: float = 1.0
    # From the config file only: region table, extra routes, upstream sections.
    regions: tuple[RegionSettings, ...] = ()
    routes: tuple[tuple[str, str], ...] = ()  # (path prefix, upstream URL), longest first
    upgrade_routes: tuple[str, ...] = ()  # the route prefixes that take upgrades
    store: Mapping[str, Any] = field(default_factory=dict)
    control_plane: Mapping[str, Any] = field(default_factory=dict)
    # Verified identities (known API keys, JWT users): see gateway/identity/config.py.
    identity: Mapping[str, Any] = field(default_factory=dict)
    # The 'tls' section (client certificates, reload interval, the admin port's own
    # pair...): see tls_config().
    tls: Mapping[str, Any] = field(default_factory=dict)
    config_file: str | None = None

    @property
    def client_connection_cap(self) -> int:
        """Connections one client address may hold open at once."""
        if self.max_client_connections:
            return self.max_client_connections
        return max(1, self.max_connections // 8)

    @property
    def embedded_enabled(self) -> bool:
        return self.upstream is None if self.embedded is None else self.embedded

    def region_table(self) -> tuple[RegionSettings, ...]:
        """Every region served, the default first. Without a 'regions' section there is
        one region, the default, counted in --redis-url."""
        if not self.regions:
            return (RegionSettings(self.region, self.redis_url),)
        ordered = sorted(self.regions, key=lambda r: r.name != self.region)
        return tuple(ordered)

    def tls_config(self) -> TlsConfig:
        """HTTPS as configured: ``tls_cert``/``tls_key`` merged with the 'tls' section
        (``SettingsError`` says what does not fit). Neither port's ``TlsPair`` set: plain
        HTTP on both."""
        return _tls_config(self)


FILE_ONLY = {
    "regions", "routes", "upgrade_routes", "store", "control_plane", "identity", "tls",
    "config_file",
}  # fmt: skip


def load_settings(
    flags: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
    config_file: str | None = None,
) -> Settings:
    """Merge flags (None = not given), environment and config file over the defaults."""
    env = os.environ if env is None else env
    config_file = config_file or env.get("GATEWAY_CONFIG")
    file_values: dict[str, Any] = {}
    if config_file:
        file_values = _read_config(config_file)
        tls_section = file_values.get("tls")
        if (
            isinstance(tls_section, dict)
            and {"cert", "key"} & set(tls_section)
            and {"tls_cert", "tls_key"} & set(file_values)
        ):
            raise SettingsError(
                f"config file {config_file}: the certificate is given twice (tls_cert/tls_key "
                "and tls: {cert:, key:}): keep the tls: section's"
            )
    values: dict[str, Any] = {}
    defaults = Settings()
    for f in fields(Settings):
        name = f.name
        if name in FILE_ONLY:
            continue
        source, raw = "default", getattr(defaults, name)
        if name in file_values:
            source, raw = f"config file {config_file}", file_values.pop(name)
        env_name = f"GATEWAY_{name.upper()}"
        if env.get(env_name) not in (None, ""):
            source, raw = f"environment {env_name}", env[env_name]
        if flags.get(name) not in (None, [], ()):
            source, raw = f"--{name.replace('_', '-')}", flags[name]
        values[name] = _coerce(name, raw, getattr(defaults, name), source)
        if name == "upstream" and isinstance(values[name], str):
            # A value from a file often ends in a newline (a ConfigMap, a CRLF .env).
            values[name] = values[name].strip()
    extra_region = file_values.pop("regions", None)
    routes = file_values.pop("routes", None)
    store = file_values.pop("store", None) or {}
    control_plane = file_values.pop("control_plane", None) or {}
    identity = file_values.pop("identity", None) or {}
    tls = file_values.pop("tls", None) or {}
    if file_values:
        raise SettingsError(
            f"config file {config_file}: unknown key(s) {sorted(file_values)}; "
            "see 'gateway serve --help' for the names"
        )
    if not all(isinstance(x, dict) for x in (store, control_plane, identity)):
        raise SettingsError(
            f"config file {config_file}: 'store', 'control_plane' and 'identity' are mappings"
        )
    if not isinstance(tls, dict):
        raise SettingsError(
            f"config file {config_file}: 'tls' is a mapping (tls: {{cert: FILE, key: FILE}})"
        )
    route_table, upgrade_routes = _routes(routes, config_file)
    settings = Settings(
        **values,
        regions=_regions(extra_region, config_file),
        routes=route_table,
        upgrade_routes=upgrade_routes,
        store=store,
        control_plane=control_plane,
        identity=identity,
        tls={str(k).replace("-", "_"): v for k, v in tls.items()},
        config_file=config_file,
    )
    _validate(settings)
    return settings


def _read_config(path: str) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from exc
    # Bounded like rule files (depth, aliases, size): a config file is operator input too.
    from gateway.policy.loader import RuleLoadError, load_yaml_bounded

    try:
        data = load_yaml_bounded(text, path) or {}
    except RuleLoadError as exc:
        shown = exc.problems[0].message if exc.problems else str(exc)
        raise SettingsError(f"config file {path} is not valid YAML: {shown}") from exc
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path}: expected a mapping of setting names")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


TRUE = {"1", "true", "yes", "on"}
FALSE = {"0", "false", "no", "off"}


def _coerce(name: str, raw: Any, default: Any, source: str) -> Any:
    try:
        if name in ("rules", "trusted_proxies", "admin_allowed_hosts"):
            if isinstance(raw, str):
                parts = [p.strip() for p in raw.split(",")]
                return tuple(p for p in parts if p)
            return tuple(str(p) for p in raw)
        if name == "embedded" or isinstance(default, bool):
            if isinstance(raw, bool) or raw is None:
                return raw
            text = str(raw).strip().lower()
            if text in TRUE:
                return True
            if text in FALSE:
                return False
            raise ValueError("expected true or false")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        return None if raw is None else str(raw)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"setting {name!r} from {source}: bad value {raw!r} ({exc})") from exc


def _regions(raw: Any, source: str | None) -> tuple[RegionSettings, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw:
        raise SettingsError(f"config file {source}: 'regions' maps a region name to its settings")
    regions = []
    for name, spec in raw.items():
        spec = spec or {}
        if not isinstance(spec, dict) or set(spec) - {"redis_url", "hosts"}:
            raise SettingsError(
                f"config file {source}: regions.{name} takes 'redis_url' and 'hosts' only"
            )
        hosts = spec.get("hosts") or []
        if isinstance(hosts, str):
            hosts = [hosts]
        regions.append(
            RegionSettings(
                str(name),
                spec.get("redis_url"),
                tuple(str(h).lower() for h in hosts),
            )
        )
    return tuple(regions)


def default_exchanges_per_client(s: Settings) -> int:
    """``max_exchanges_per_client`` when it is 0: a quarter of the upstream pool, but
    room for an address's full share of uploads and of downloads besides (those are
    exchanges too, and ordinary requests must still pass beside them)."""
    return max(s.upstream_pool_size // 4, s.max_uploads_per_client + s.max_downloads_per_client)


def upstream_url_problem(url: str) -> str | None:
    """What is wrong with an upstream URL (None: nothing): it must be http:// or https://
    with a host and, if given, a valid port. Checked at start-up: such a URL used to be
    taken, and every request on its route answered 502 at run time."""
    shown = display_url(url)
    if not url.startswith(("http://", "https://")):
        return f"must be an http:// or https:// URL, not {shown!r}"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a port that is not 0-65535)
    except ValueError:  # (its text may quote part of a password)
        return (
            f"{shown!r} is not a valid URL (is its port a number from 0 to 65535? a "
            "password holding '/', '?', '#', '[' or ']' must be percent-encoded)"
        )
    if not parts.hostname:
        return f"{shown!r} names no host; write it as http://HOST:PORT"
    if any(c.isspace() for c in url):
        return f"{shown!r} holds whitespace"
    return None


def _routes(raw: Any, source: str | None) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The config file's ``routes:``: prefix -> URL, or prefix -> {url:, upgrade: true}
    (the route takes upgrades: WebSocket ...). (routes longest first, upgrade prefixes)."""
    if raw is None:
        return (), ()
    if not isinstance(raw, dict):
        raise SettingsError(f"config file {source}: 'routes' maps a path prefix to an upstream URL")
    routes = []
    upgrades = []
    for prefix, target in raw.items():
        url, upgrade = target, False
        if isinstance(target, dict):
            url, upgrade = target.get("url"), target.get("upgrade", False)
            if set(target) - {"url", "upgrade"} or not isinstance(upgrade, bool):
                raise SettingsError(
                    f"config file {source}: route {prefix!r} takes 'url' and 'upgrade' "
                    "(true or false)"
                )
        if not str(prefix).startswith("/") or not isinstance(url, str):
            shown = display_url(url) if isinstance(url, str) else repr(url)
            raise SettingsError(f"config file {source}: route {prefix!r} -> {shown} is not valid")
        url = url.strip()  # (a YAML block scalar ends in a newline)
        problem = upstream_url_problem(url)
        if problem is not None:
            raise SettingsError(f"config file {source}: route {prefix!r}: {problem}")
        name = str(prefix).rstrip("/") or "/"
        routes.append((name, url))
        if upgrade:
            upgrades.append(name)
    return tuple(sorted(routes, key=lambda r: -len(r[0]))), tuple(upgrades)


def _validate(s: Settings) -> None:
    def bad(message: str) -> None:
        raise SettingsError(message)

    for port_name in ("port", "admin_port"):
        port = getattr(s, port_name)
        if not 0 <= port <= 65535:
            bad(f"{port_name} must be 0..65535, not {port}")
    if s.memory_max_keys < 1000:
        bad(f"memory_max_keys must be at least 1000, not {s.memory_max_keys}")
    if s.workers < 1 or s.workers > 64:
        bad(f"workers must be 1..64, not {s.workers}")
    if s.workers > 1 and s.port == 0:
        bad("--workers needs a fixed --port: with port 0 every worker would get its own")
    if s.log_format not in ("text", "json"):
        bad(f"log_format must be text or json, not {s.log_format!r}")
    if not s.access_log_file:
        bad("access_log_file must be a path, or - for stdout")
    if s.access_log not in ("plain", "json", "off"):
        bad(f"access_log must be plain, json or off, not {s.access_log!r}")
    data_dir = Path(s.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        bad(
            f"data_dir {s.data_dir} is a file, not a directory: give a directory (it is "
            "created if missing) for the identity secret and the built-in upstreams' data"
        )
    if s.upstream is not None:
        problem = upstream_url_problem(s.upstream)
        if problem is not None:
            bad(f"upstream: {problem}")
    for name in ("redis_timeout_ms", "upstream_connect_timeout", "upstream_timeout",
                 "upstream_read_timeout", "client_idle_timeout", "body_read_timeout",
                 "header_timeout", "watch_interval"):  # fmt: skip
        if getattr(s, name) <= 0:
            bad(f"{name} must be positive")
    if s.max_connections < 1:
        bad(f"max_connections must be at least 1, not {s.max_connections}")
    if s.max_uploads_per_client < 1:
        bad(f"max_uploads_per_client must be at least 1, not {s.max_uploads_per_client}")
    if s.max_downloads_per_client < 1:
        bad(f"max_downloads_per_client must be at least 1, not {s.max_downloads_per_client}")
    if s.max_exchanges_per_client < 0:
        bad(
            "max_exchanges_per_client must be 0 (a quarter of upstream_pool_size) or more, "
            f"not {s.max_exchanges_per_client}"
        )
    if s.max_tunnels < 1 or s.max_tunnels_per_client < 1:
        bad("max_tunnels and max_tunnels_per_client must be at least 1")
    if s.tunnel_idle_timeout <= 0 or s.tunnel_max_bytes < 0 or s.tunnel_max_seconds < 0:
        bad("tunnel_idle_timeout must be positive; tunnel_max_bytes and tunnel_max_seconds "
            "0 (unbounded) or more")  # fmt: skip
    if s.rate_limit_headers not in ("ietf", "legacy", "both", "none"):
        bad(f"rate_limit_headers must be ietf, legacy, both or none, "
            f"not {s.rate_limit_headers!r}")  # fmt: skip
    if s.max_client_connections < 0:
        bad(f"max_client_connections must be 0 (max_connections // 8) or more, "
            f"not {s.max_client_connections}")  # fmt: skip
    if s.upstream_pool_size < 1:
        bad(f"upstream_pool_size must be at least 1, not {s.upstream_pool_size}")
    if s.max_body_bytes < 0 or s.max_header_bytes < 256:
        bad("max_body_bytes must be >= 0 and max_header_bytes >= 256")
    if s.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        bad(f"log_level must be DEBUG, INFO, WARNING or ERROR, not {s.log_level!r}")
    from gateway.ratelimit.identity import ClientAddressPolicy

    try:
        ClientAddressPolicy.parse(s.trusted_proxies, s.ipv6_prefix)
    except ValueError as exc:
        bad(str(exc))
    if s.regions and s.redis_url:
        bad("redis_url (--redis-url) and a 'regions' section were both given: with regions, "
            "give each region its redis_url in the config file")  # fmt: skip
    if s.database_url is not None:
        from gateway.upstreams.postgres.url import check_url

        try:
            check_url(s.database_url)
        except ValueError as exc:
            bad(str(exc))
    if s.identity:
        from gateway.identity.config import IdentityConfigError, parse_identity_config

        base = Path(s.config_file).parent if s.config_file else Path.cwd()
        try:
            parse_identity_config(s.identity, base)
        except IdentityConfigError as exc:
            bad(f"config file {s.config_file}: {exc}")
    s.tls_config()  # raises SettingsError
    if s.admin_token is not None and len(s.admin_token.encode()) < 16:
        bad("admin_token must be at least 16 bytes (use a long random string)")
    if s.identity_secret is not None and len(s.identity_secret.encode()) < 16:
        bad("identity_secret must be at least 16 bytes (use a long random string)")
    from gateway.counters.factory import parse_counter_url

    for region in s.region_table():
        if region.counter_url is not None and not region.counter_url.startswith("memory:"):
            try:
                parse_counter_url(region.counter_url)
            except ValueError as exc:
                bad(f"counter URL of region {region.name}: {exc}")
    names = [r.name for r in s.region_table()]
    if s.regions and s.region not in names:
        bad(f"default region {s.region!r} is not in the 'regions' section ({', '.join(names)})")
    if not s.regions and s.region not in DEFAULT_REGIONS:
        bad(f"region must be one of {sorted(DEFAULT_REGIONS)} (or configure 'regions'), "
            f"not {s.region!r}")  # fmt: skip


def _tls_config(s: Settings) -> TlsConfig:
    # Messages name the key as written in the config file ("tls.client_auth").
    where = f"config file {s.config_file}: tls" if s.config_file else "tls"
    section = s.tls
    if not isinstance(section, Mapping):
        raise SettingsError(f"{where} is a mapping (tls: {{cert: FILE, key: FILE}})")
    unknown = sorted(str(k) for k in section if k not in TLS_SECTION_KEYS)
    if any("passphrase" in key or "password" in key for key in unknown):
        raise SettingsError(
            f"{where}: a key's passphrase is never read from the config file: give it in "
            "the environment variable GATEWAY_TLS_KEY_PASSPHRASE"
        )
    if unknown:
        raise SettingsError(
            f"{where}: unknown key(s) {unknown}; it takes {', '.join(TLS_SECTION_KEYS)}"
        )
    # Files named in the config file are found beside it (as the identity section's),
    # wherever the gateway is started from; flag and environment paths are as given.
    base = Path(s.config_file).parent if s.config_file else None

    def path(value: object, key: str) -> str:
        if not isinstance(value, str) or not value.strip():
            raise SettingsError(f"{where}{key} must be a file path, not {value!r}")
        found = Path(value)
        return str(found if base is None or found.is_absolute() else base / found)

    def pair(raw: Mapping[str, Any], prefix: str) -> TlsPair | None:
        cert, key = raw.get("cert"), raw.get("key")
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            given, missing = ("cert", "key") if key is None else ("key", "cert")
            raise SettingsError(
                f"{where}{prefix}.{given} is given without tls{prefix}.{missing}: give the "
                "certificate and its key together"
            )
        return TlsPair(path(cert, f"{prefix}.cert"), path(key, f"{prefix}.key"))

    proxy = pair(section, "")
    if s.tls_cert is not None or s.tls_key is not None:
        # Flag or environment (or the file's top level): the pair as a whole, over the
        # section's (a certificate from one place and a key from another never pair).
        if not s.tls_cert or not s.tls_key:
            given, missing = ("cert", "key") if s.tls_cert else ("key", "cert")
            raise SettingsError(
                f"tls_{given} (--tls-{given}, GATEWAY_TLS_{given.upper()}) is set but "
                f"tls_{missing} is not: give the certificate and its key together "
                f"(--tls-{missing} or GATEWAY_TLS_{missing.upper()})"
            )
        proxy = TlsPair(s.tls_cert, s.tls_key)

    admin = None
    admin_raw = section.get("admin")
    if admin_raw is not None:
        if not isinstance(admin_raw, Mapping) or set(admin_raw) - {"cert", "key"}:
            raise SettingsError(
                f"{where}.admin takes 'cert' and 'key' only (the admin port's own pair)"
            )
        admin = pair(admin_raw, ".admin")
        if admin is None:
            raise SettingsError(f"{where}.admin needs 'cert' and 'key' (the admin port's own pair)")

    client_ca_raw = section.get("client_ca")
    client_ca = None if client_ca_raw is None else path(client_ca_raw, ".client_ca")
    client_auth = section.get("client_auth")
    if client_auth is not None and client_auth not in CLIENT_AUTH_MODES:
        # (YAML reads a bare off/no as false: hence the quotes in the message)
        raise SettingsError(
            f"{where}.client_auth must be 'none', 'optional' or 'required', not {client_auth!r}"
        )
    if client_auth in ("optional", "required") and client_ca is None:
        raise SettingsError(
            f"{where}.client_auth is {client_auth!r} but there is no tls.client_ca: give the "
            "CA (PEM) that issues the client certificates"
        )
    if client_ca is not None and client_auth in (None, "none"):
        # A CA with no certificate asked for would look like client authentication
        # while authenticating nobody.
        raise SettingsError(
            f"{where}.client_ca is given but client certificates are not asked for: set "
            "tls.client_auth to 'optional' or 'required', or drop tls.client_ca"
        )

    def seconds(name: str, default: float) -> float:
        value = section.get(name, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value <= 0
        ):
            raise SettingsError(
                f"{where}.{name} must be a positive number of seconds, not {value!r}"
            )
        return float(value)

    watch_interval = seconds("watch_interval", DEFAULT_TLS_WATCH_INTERVAL)
    handshake_timeout = seconds("handshake_timeout", DEFAULT_TLS_HANDSHAKE_TIMEOUT)
    if proxy is None:
        only_proxy = [k for k in ("client_ca", "client_auth", "handshake_timeout") if k in section]
        if only_proxy:
            raise SettingsError(
                f"{where}.{only_proxy[0]} applies to HTTPS on the proxy port, which has no "
                "certificate: give tls.cert and tls.key (or --tls-cert and --tls-key)"
            )
        if admin is None and section:
            raise SettingsError(
                f"{where} has no certificate: give tls.cert and tls.key (or --tls-cert and "
                "--tls-key), or tls.admin"
            )
    return TlsConfig(
        proxy=proxy,
        client_ca=client_ca,
        client_auth=str(client_auth or "none"),
        watch_interval=watch_interval,
        handshake_timeout=handshake_timeout,
        admin=admin,
    )


def region_names(settings: Settings) -> Sequence[str]:
    return [r.name for r in settings.region_table()]
