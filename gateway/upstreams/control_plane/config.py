"""Configuration of the built-in control plane (the ``control_plane:`` section) and the
start-up credential bootstrap."""

from __future__ import annotations

import json
import math
import os
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .credentials import (
    MAX_API_KEY_BYTES,
    Credential,
    hash_api_key,
    is_hex_digest,
    is_valid_tenant_id,
)
from .limits import RANGES as LIMIT_RANGES
from .limits import Limits

DEFAULT_GITHUB_INSTALL_URL = "https://github.com/apps/agent-deployments/installations/new"
CREDENTIAL_FILE_NAME = "control-plane-credential.json"
DATABASE_FILE_NAME = "control-plane.sqlite3"
MAX_REVISION_STEP_SECONDS = 3600.0

_SECTION_KEYS = frozenset(
    {
        "revision_step_seconds",
        "credentials",
        "integrations",
        "max_body_bytes",
        "auth_wait_max_seconds",
        "auth_flow_ttl_seconds",
        *LIMIT_RANGES,
    }
)


@dataclass(frozen=True)
class GithubRepo:
    """A repository listed by an emulated code-host integration."""

    owner: str
    name: str
    url: str
    default_branch: str = "main"
    private: bool = False


@dataclass(frozen=True)
class GithubIntegration:
    """An emulated code-host integration; ``tenant_ids`` None means every tenant sees it."""

    id: str
    name: str
    tenant_ids: frozenset[str] | None
    repos: tuple[GithubRepo, ...]


@dataclass(frozen=True)
class ControlPlaneConfig:
    """Everything the control-plane app needs; built by :meth:`from_mapping`."""

    data_dir: Path
    revision_step_seconds: float = 2.0
    credentials: tuple[Credential, ...] = ()
    github_install_url: str = DEFAULT_GITHUB_INSTALL_URL
    github_integrations: tuple[GithubIntegration, ...] = ()
    max_body_bytes: int = 1024 * 1024
    auth_wait_max_seconds: float = 30.0
    auth_flow_ttl_seconds: float = 600.0
    # PostgreSQL instead of the SQLite file (set from --database-url, not from the
    # control_plane: section), and the longest a request waits for it.
    database_url: str | None = None
    database_timeout_seconds: float = 5.0
    # While PostgreSQL is away, requests are answered 503 at once and one probe connection
    # is tried this often (the breaker's cool-down).
    database_retry_seconds: float = 1.0
    # Sizes and quotas (limits.py; documented in docs/control-plane.md).
    limits: Limits = field(default_factory=Limits)

    @property
    def database_path(self) -> Path:
        """The SQLite file holding deployments, revisions, listeners and auth state."""
        return self.data_dir / DATABASE_FILE_NAME

    @property
    def credential_file(self) -> Path:
        """Where a generated credential is kept between starts."""
        return self.data_dir / CREDENTIAL_FILE_NAME

    @classmethod
    def from_mapping(
        cls, section: Mapping[str, Any], data_dir: Path, env: Mapping[str, str]
    ) -> ControlPlaneConfig:
        """Build the config from the YAML ``control_plane:`` section and the environment.

        ``GATEWAY_REVISION_STEP_SECONDS`` overrides the file; ``GATEWAY_API_KEY`` together
        with ``GATEWAY_TENANT_ID`` adds one credential. Raises ``ValueError`` naming the
        offending field.
        """
        if not isinstance(section, Mapping):
            raise ValueError("control_plane: must be a mapping")
        unknown = sorted(set(section) - _SECTION_KEYS)
        if unknown:
            raise ValueError(f"control_plane: unknown key(s) {', '.join(map(str, unknown))}")

        step: object = section.get("revision_step_seconds", 2.0)
        if env.get("GATEWAY_REVISION_STEP_SECONDS", "").strip():
            step = env["GATEWAY_REVISION_STEP_SECONDS"].strip()
        step_seconds = _number(
            step, "revision_step_seconds (or GATEWAY_REVISION_STEP_SECONDS)", 0.0
        )
        if step_seconds > MAX_REVISION_STEP_SECONDS:
            raise ValueError(
                "revision_step_seconds (or GATEWAY_REVISION_STEP_SECONDS) must be at most "
                f"{MAX_REVISION_STEP_SECONDS:g}"
            )

        credentials = list(_parse_credentials(section.get("credentials", [])))
        env_key = env.get("GATEWAY_API_KEY", "")
        env_tenant = env.get("GATEWAY_TENANT_ID", "")
        if bool(env_key) != bool(env_tenant):
            raise ValueError("GATEWAY_API_KEY and GATEWAY_TENANT_ID must be set together")
        if env_key:
            _check_api_key(env_key, "GATEWAY_API_KEY")
            _check_tenant(env_tenant, "GATEWAY_TENANT_ID")
            credentials.append(
                Credential(hash_api_key(env_key), frozenset({env_tenant}), "environment")
            )
        _refuse_repeated_keys(credentials, from_environment=bool(env_key))

        install_url, integrations = _parse_integrations(section.get("integrations", {}))
        max_body = _number(section.get("max_body_bytes", 1024 * 1024), "max_body_bytes", 1024)
        wait_max = _number(section.get("auth_wait_max_seconds", 30.0), "auth_wait_max_seconds", 0.0)
        flow_ttl = _number(
            section.get("auth_flow_ttl_seconds", 600.0), "auth_flow_ttl_seconds", 1.0
        )
        limits = Limits(
            **{
                name: _whole_number(section[name], name, *LIMIT_RANGES[name])
                for name in LIMIT_RANGES
                if name in section
            }
        )
        return cls(
            limits=limits,
            data_dir=Path(data_dir),
            revision_step_seconds=step_seconds,
            credentials=tuple(credentials),
            github_install_url=install_url,
            github_integrations=integrations,
            max_body_bytes=min(int(max_body), 64 * 1024 * 1024),
            auth_wait_max_seconds=min(wait_max, 300.0),
            auth_flow_ttl_seconds=min(flow_ttl, 86400.0),
        )


def bootstrap_credentials(config: ControlPlaneConfig) -> tuple[ControlPlaneConfig, str | None]:
    """Ensure at least one credential exists.

    With none configured, load the credential kept in the data dir, or create one there
    (file mode 0600). Returns the config with that credential added and a start-up message
    for the operator, which names the file and the tenant id, never the key.
    Returns ``(config, None)`` when credentials were configured.
    """
    if config.credentials:
        return config, None
    path = config.credential_file
    config.data_dir.mkdir(parents=True, exist_ok=True)
    api_key = "gwk_" + secrets.token_urlsafe(32)
    tenant_id = str(uuid.uuid4())
    if _write_credential_file(path, api_key, tenant_id):
        # Never the key itself: logs are read by more people and tools than the data
        # directory (SECURITY.md: a raw key is never logged, at any level).
        message = (
            f"Control plane: no credential configured, generated one for tenant {tenant_id}: "
            f"its API key is in {path} (mode 0600; read it with: cat {path}). Configure a "
            "credential (GATEWAY_API_KEY and GATEWAY_TENANT_ID) to use your own."
        )
    else:
        api_key, tenant_id = _read_credential_file(path)
        message = (
            f"Control plane: using the generated API key kept in {path} "
            f"for tenant {tenant_id} (read the file to see the key)."
        )
    credential = Credential(hash_api_key(api_key), frozenset({tenant_id}), "generated")
    return replace(config, credentials=(credential,)), message


def _read_credential_file(path: Path) -> tuple[str, str]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the generated credential: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    api_key, tenant_id = data.get("api_key"), data.get("tenant_id")
    if not isinstance(api_key, str) or not isinstance(tenant_id, str):
        raise ValueError(f"{path}: expected string fields api_key and tenant_id")
    _check_api_key(api_key, f"{path}: api_key")
    _check_tenant(tenant_id, f"{path}: tenant_id")
    return api_key, tenant_id


def _write_credential_file(path: Path, api_key: str, tenant_id: str) -> bool:
    """Create the file; False when it already exists (another start made it first)."""
    payload = json.dumps({"api_key": api_key, "tenant_id": tenant_id}, indent=2) + "\n"
    # Written whole to a private temporary name, then hard-linked into place: the link
    # fails if the file exists, so concurrent workers agree on one key and never read a
    # half-written file.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        tmp.unlink(missing_ok=True)


def _number(value: object, field: str, minimum: float) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{field}: expected a number, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{field}: expected a number, got {value!r}") from None
    if not math.isfinite(number) or number < minimum:
        raise ValueError(f"{field}: must be a finite number >= {minimum:g}, got {value!r}")
    return number


def _whole_number(value: object, field: str, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"control_plane.{field}: expected a whole number, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"control_plane.{field}: expected a whole number, got {value!r}")
    if not minimum <= value <= maximum:
        raise ValueError(
            f"control_plane.{field}: must be between {minimum} and {maximum}, got {value!r}"
        )
    return int(value)


def _check_api_key(value: str, field: str) -> None:
    if not value or len(value.encode("utf-8")) > MAX_API_KEY_BYTES or not value.isprintable():
        raise ValueError(f"{field}: must be 1..{MAX_API_KEY_BYTES} printable characters")


def _check_tenant(value: str, field: str) -> None:
    if not is_valid_tenant_id(value):
        raise ValueError(
            f"{field}: must be 1..128 characters of letters, digits, '.', '_', ':' or '-'"
        )


def _parse_credentials(raw: object) -> list[Credential]:
    if not isinstance(raw, list):
        raise ValueError("control_plane.credentials: expected a list")
    out: list[Credential] = []
    for index, item in enumerate(raw):
        where = f"control_plane.credentials[{index}]"
        if not isinstance(item, Mapping):
            raise ValueError(f"{where}: expected a mapping")
        unknown = sorted(set(item) - {"api_key_sha256", "tenant_ids", "label"})
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
        digest = item.get("api_key_sha256")
        if not isinstance(digest, str) or not is_hex_digest(digest.lower()):
            raise ValueError(f"{where}.api_key_sha256: expected 64 hex characters")
        tenants = item.get("tenant_ids")
        if not isinstance(tenants, list) or not tenants:
            raise ValueError(f"{where}.tenant_ids: expected a non-empty list")
        for t_index, tenant in enumerate(tenants):
            if not isinstance(tenant, str):
                raise ValueError(f"{where}.tenant_ids[{t_index}]: expected a string")
            _check_tenant(tenant, f"{where}.tenant_ids[{t_index}]")
        label = item.get("label", "")
        if not isinstance(label, str):
            raise ValueError(f"{where}.label: expected a string")
        out.append(Credential(digest.lower(), frozenset(tenants), label))
    return out


def _refuse_repeated_keys(credentials: list[Credential], *, from_environment: bool) -> None:
    """One credential per key: a key listed twice (or given in GATEWAY_API_KEY and in the
    file) would act on the tenants of whichever entry the lookup met last, not the union
    an operator may expect, and dropping an entry to revoke access would leave the other.
    The message names the entries, never the key or its digest."""
    first: dict[str, int] = {}
    for index, credential in enumerate(credentials):
        where = (
            "GATEWAY_API_KEY"
            if from_environment and index == len(credentials) - 1  # appended last
            else f"control_plane.credentials[{index}]"
        )
        seen = first.setdefault(credential.key_sha256, index)
        if seen != index:
            raise ValueError(
                f"{where}: the same API key as control_plane.credentials[{seen}]; list a "
                "key once, with every tenant it may act on in its tenant_ids"
            )


def _tenant_url(value: object, where: str) -> str:
    """An http(s) URL that every tenant allowed to see it is answered with, as written:
    so it may carry no credential anywhere a URL can (a user or password before the host,
    a query such as ``?access_token=``, a fragment), only printable ASCII (a host in
    punycode), and the error never quotes it (it may hold one)."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected an http(s) URL (a string)")
    if not all(0x21 <= ord(c) < 0x7F for c in value):
        raise ValueError(
            f"{where}: expected an http(s) URL of printable ASCII, without spaces (a host "
            "in punycode)"
        )
    netloc = value.partition("//")[2].partition("/")[0]
    if "@" in netloc or "%" in netloc or "?" in value or "#" in value:
        raise ValueError(
            f"{where}: must not carry credentials (a user or password before the host, an "
            "encoded one, a query or a fragment): tenants are answered with this URL as "
            "written; give the code host's credentials elsewhere (the URL is not shown here)"
        )
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"{where}: not a URL that parses (it is not shown here)") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{where}: expected an http(s) URL with a host")
    return value


def _parse_integrations(raw: object) -> tuple[str, tuple[GithubIntegration, ...]]:
    if not isinstance(raw, Mapping):
        raise ValueError("control_plane.integrations: expected a mapping")
    unknown = sorted(set(raw) - {"github"})
    if unknown:
        raise ValueError(
            f"control_plane.integrations: unknown key(s) {', '.join(map(str, unknown))}"
        )
    github = raw.get("github", {})
    where = "control_plane.integrations.github"
    if not isinstance(github, Mapping):
        raise ValueError(f"{where}: expected a mapping")
    unknown = sorted(set(github) - {"install_url", "installations"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
    install_url = _tenant_url(
        github.get("install_url", DEFAULT_GITHUB_INSTALL_URL), f"{where}.install_url"
    )
    installations = github.get("installations", [])
    if not isinstance(installations, list):
        raise ValueError(f"{where}.installations: expected a list")
    integrations: list[GithubIntegration] = []
    seen: set[str] = set()
    for index, item in enumerate(installations):
        item_where = f"{where}.installations[{index}]"
        integrations.append(_parse_integration(item, item_where))
        if integrations[-1].id in seen:
            raise ValueError(f"{item_where}.id: duplicate id {integrations[-1].id!r}")
        seen.add(integrations[-1].id)
    return install_url, tuple(integrations)


def _parse_integration(item: object, where: str) -> GithubIntegration:
    if not isinstance(item, Mapping):
        raise ValueError(f"{where}: expected a mapping")
    unknown = sorted(set(item) - {"id", "name", "tenant_ids", "repos"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}")
    ident = item.get("id")
    if not isinstance(ident, str) or not ident:
        raise ValueError(f"{where}.id: expected a non-empty string")
    name = item.get("name", ident)
    if not isinstance(name, str):
        raise ValueError(f"{where}.name: expected a string")
    tenants = item.get("tenant_ids")
    tenant_set: frozenset[str] | None = None
    if tenants is not None:
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise ValueError(f"{where}.tenant_ids: expected a list of strings")
        tenant_set = frozenset(tenants)
    repos_raw = item.get("repos", [])
    if not isinstance(repos_raw, list):
        raise ValueError(f"{where}.repos: expected a list")
    repos: list[GithubRepo] = []
    for r_index, repo in enumerate(repos_raw):
        r_where = f"{where}.repos[{r_index}]"
        if not isinstance(repo, Mapping):
            raise ValueError(f"{r_where}: expected a mapping")
        unknown = sorted(set(repo) - {"owner", "name", "url", "default_branch", "private"})
        if unknown:
            raise ValueError(f"{r_where}: unknown key(s) {', '.join(map(str, unknown))}")
        owner, repo_name = repo.get("owner"), repo.get("name")
        if (
            not isinstance(owner, str)
            or not owner
            or not isinstance(repo_name, str)
            or not repo_name
        ):
            raise ValueError(f"{r_where}: owner and name must be non-empty strings")
        url = _tenant_url(
            repo.get("url", f"https://github.com/{owner}/{repo_name}"), f"{r_where}.url"
        )
        branch = repo.get("default_branch", "main")
        private = repo.get("private", False)
        if not isinstance(branch, str) or not isinstance(private, bool):
            raise ValueError(f"{r_where}: default_branch must be a string, private a boolean")
        repos.append(GithubRepo(owner, repo_name, url, branch, private))
    return GithubIntegration(ident, name, tenant_set, tuple(repos))
