"""The config file's ``identity:`` section, validated into frozen settings.

Every problem raises ``IdentityConfigError`` naming the key path, so an operator reading
"identity.user.jwt.algorithms: ..." knows which line to fix. Nothing here reads files:
paths are only resolved against the config file's folder.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal
from urllib.parse import urlsplit

from gateway.urls import display_url

# Asymmetric algorithms only: with a symmetric one (HS*) the verification key is a shared
# secret, and a gateway holding a public key as an HMAC secret is the classic algorithm
# confusion (an HS256 token "signed" with the RSA public key's bytes).
ASYMMETRIC_ALGORITHMS: Final = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
DEFAULT_ALGORITHMS: Final = ("RS256", "ES256", "EdDSA")
MAX_LEEWAY_SECONDS: Final = 300.0
MIN_REFRESH_SECONDS: Final = 1.0
MAX_REFRESH_SECONDS: Final = 86_400.0
MAX_CLAIM_NAME_CHARS: Final = 128
# CPU milliseconds a second that verifying tokens that fail may take (VerifyBudget), per
# client address and in all: a fresh random token is verified before its request is
# counted, so without these one client could keep the worker busy. 1000 is a whole core.
DEFAULT_VERIFY_MS_PER_CLIENT: Final = 10.0
DEFAULT_VERIFY_MS: Final = 100.0
MAX_VERIFY_MS: Final = 1000.0
# An RFC 9110 field name (token), lower-cased when stored: the data plane matches
# header names case-insensitively.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
MAX_HEADER_DASHES: Final = 8
_LOOPBACK_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})


class IdentityConfigError(ValueError):
    """The ``identity:`` section is wrong; the message starts with the key path."""


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    header: str = "x-api-key"
    # None: no key file, every key is counted as its own identity (the unverified mode).
    keys: Path | None = None
    unknown: Literal["anonymous", "reject"] = "anonymous"


@dataclass(frozen=True, slots=True)
class JwtConfig:
    issuer: str
    audience: tuple[str, ...]
    header: str = "authorization"
    # Exactly one of the three key sources is set.
    jwks_url: str | None = None
    jwks_file: Path | None = None
    public_key_file: Path | None = None
    claim: str = "sub"
    tier_claim: str | None = None
    algorithms: tuple[str, ...] = DEFAULT_ALGORITHMS
    leeway_seconds: float = 30.0
    jwks_refresh_seconds: float = 300.0
    max_failed_verify_ms_per_client: float = DEFAULT_VERIFY_MS_PER_CLIENT  # a second
    max_failed_verify_ms: float = DEFAULT_VERIFY_MS  # a second, all clients together


@dataclass(frozen=True, slots=True)
class UserConfig:
    # "trusted": x-user-id is believed only from trusted proxies. Always so with jwt.
    header_from: Literal["any", "trusted"] = "any"
    jwt: JwtConfig | None = None
    invalid: Literal["reject", "anonymous"] = "reject"


@dataclass(frozen=True, slots=True)
class IdentityConfig:
    api_key: ApiKeyConfig = ApiKeyConfig()
    user: UserConfig = UserConfig()


def parse_identity_config(raw: Mapping[str, Any], base_dir: Path) -> IdentityConfig:
    """Validate the ``identity:`` mapping; relative file paths resolve against
    ``base_dir`` (the config file's folder)."""
    section = _mapping(raw, "identity")
    _only(section, "identity", {"api_key", "user"})
    api_key = _api_key(section.get("api_key"), base_dir)
    user = _user(section.get("user"), base_dir)
    if user.jwt is not None and user.jwt.header == api_key.header:
        raise IdentityConfigError(
            f"identity.user.jwt.header: {user.jwt.header!r} is also identity.api_key.header"
        )
    return IdentityConfig(api_key=api_key, user=user)


def _api_key(raw: Any, base_dir: Path) -> ApiKeyConfig:
    where = "identity.api_key"
    if raw is None:
        return ApiKeyConfig()
    section = _mapping(raw, where)
    _only(section, where, {"header", "keys", "unknown"})
    keys = _path(section, where, "keys", base_dir)
    unknown = _choice(section, where, "unknown", ("anonymous", "reject"), "anonymous")
    if unknown == "reject" and keys is None:
        # Without a key file nothing is known, so 'reject' would be silently meaningless:
        # the operator believes unknown keys are refused while every key is counted.
        raise IdentityConfigError(f"{where}.unknown: 'reject' needs {where}.keys (a key file)")
    return ApiKeyConfig(
        header=_header(section, where, "x-api-key"),
        keys=keys,
        unknown="reject" if unknown == "reject" else "anonymous",
    )


def _user(raw: Any, base_dir: Path) -> UserConfig:
    where = "identity.user"
    if raw is None:
        return UserConfig()
    section = _mapping(raw, where)
    _only(section, where, {"header_from", "jwt", "invalid"})
    jwt = None if section.get("jwt") is None else _jwt(section["jwt"], base_dir)
    header_from = _choice(section, where, "header_from", ("any", "trusted"), None)
    if jwt is not None and header_from == "any":
        raise IdentityConfigError(
            f"{where}.header_from: 'any' contradicts {where}.jwt (with jwt, x-user-id is "
            "believed only from trusted proxies)"
        )
    if jwt is None and "invalid" in section:
        # Same reasoning as api_key.unknown: without jwt no token is ever verified.
        raise IdentityConfigError(f"{where}.invalid: has no effect without {where}.jwt")
    invalid = _choice(section, where, "invalid", ("reject", "anonymous"), "reject")
    trusted = header_from == "trusted" or jwt is not None
    return UserConfig(
        header_from="trusted" if trusted else "any",
        jwt=jwt,
        invalid="anonymous" if invalid == "anonymous" else "reject",
    )


_JWT_KEYS: Final = frozenset(
    {
        "header",
        "jwks_url",
        "jwks_file",
        "public_key_file",
        "issuer",
        "audience",
        "claim",
        "tier_claim",
        "algorithms",
        "leeway_seconds",
        "jwks_refresh_seconds",
        "max_failed_verify_ms_per_client",
        "max_failed_verify_ms",
    }
)


def _jwt(raw: Any, base_dir: Path) -> JwtConfig:
    where = "identity.user.jwt"
    section = _mapping(raw, where)
    _only(section, where, _JWT_KEYS)
    sources = [
        k for k in ("jwks_url", "jwks_file", "public_key_file") if section.get(k) is not None
    ]
    if len(sources) != 1:
        raise IdentityConfigError(
            f"{where}: exactly one of jwks_url, jwks_file, public_key_file is needed "
            f"(got {', '.join(sources) or 'none'})"
        )
    jwks_url = _jwks_url(section, where) if "jwks_url" in sources else None
    tier_claim = section.get("tier_claim")
    return JwtConfig(
        header=_header(section, where, "authorization"),
        jwks_url=jwks_url,
        jwks_file=_path(section, where, "jwks_file", base_dir),
        public_key_file=_path(section, where, "public_key_file", base_dir),
        issuer=_string(section.get("issuer"), f"{where}.issuer", required=True),
        audience=_audience(section.get("audience"), f"{where}.audience"),
        claim=_claim_name(section.get("claim", "sub"), f"{where}.claim"),
        tier_claim=None if tier_claim is None else _claim_name(tier_claim, f"{where}.tier_claim"),
        algorithms=_algorithms(section.get("algorithms"), f"{where}.algorithms"),
        leeway_seconds=_number(section, where, "leeway_seconds", 30.0, 0.0, MAX_LEEWAY_SECONDS),
        jwks_refresh_seconds=_number(
            section, where, "jwks_refresh_seconds", 300.0, MIN_REFRESH_SECONDS, MAX_REFRESH_SECONDS
        ),
        max_failed_verify_ms_per_client=_milliseconds(
            section, where, "max_failed_verify_ms_per_client", DEFAULT_VERIFY_MS_PER_CLIENT
        ),
        max_failed_verify_ms=_milliseconds(
            section, where, "max_failed_verify_ms", DEFAULT_VERIFY_MS
        ),
    )


def _jwks_url(section: Mapping[str, Any], where: str) -> str:
    url = _string(section["jwks_url"], f"{where}.jwks_url", required=True)
    try:
        parts = urlsplit(url)
    except ValueError:  # (its text may quote part of a password)
        raise IdentityConfigError(
            f"{where}.jwks_url: does not parse: {display_url(url)!r}"
        ) from None
    # Keys fetched over plain HTTP could be swapped by anyone on the path, which would let
    # them mint any user's token; a loopback IdP (a sidecar, a test) is the one exception.
    if parts.scheme == "https" and parts.hostname:
        return url
    if parts.scheme == "http" and parts.hostname in _LOOPBACK_HOSTS:
        return url
    raise IdentityConfigError(
        f"{where}.jwks_url: must be an https:// URL (http:// only to a loopback host), "
        f"got {display_url(url)!r}"
    )


def _algorithms(raw: Any, where: str) -> tuple[str, ...]:
    if raw is None:
        return DEFAULT_ALGORITHMS
    if not isinstance(raw, list) or not raw:
        raise IdentityConfigError(f"{where}: expected a non-empty list, e.g. [RS256, ES256]")
    out: list[str] = []
    for item in raw:
        if not isinstance(item, str):
            raise IdentityConfigError(f"{where}: {item!r} is not an algorithm name")
        if item.upper().startswith("HS") or item.lower() == "none":
            raise IdentityConfigError(
                f"{where}: {item!r} is refused: only asymmetric algorithms are verified "
                f"({', '.join(sorted(ASYMMETRIC_ALGORITHMS))})"
            )
        if item not in ASYMMETRIC_ALGORITHMS:
            raise IdentityConfigError(
                f"{where}: unknown algorithm {item!r} (one of "
                f"{', '.join(sorted(ASYMMETRIC_ALGORITHMS))})"
            )
        if item in out:
            raise IdentityConfigError(f"{where}: {item!r} is listed twice")
        out.append(item)
    return tuple(out)


def _audience(raw: Any, where: str) -> tuple[str, ...]:
    # Required: without an audience check, a token the same IdP issued for another API
    # would be accepted here.
    if isinstance(raw, str):
        return (_string(raw, where, required=True),)
    if isinstance(raw, list) and raw and all(isinstance(x, str) and x for x in raw):
        return tuple(raw)
    raise IdentityConfigError(f"{where}: required, a non-empty string or list of strings")


def _claim_name(raw: Any, where: str) -> str:
    name = _string(raw, where, required=True)
    if len(name) > MAX_CLAIM_NAME_CHARS or not name.isprintable():
        raise IdentityConfigError(f"{where}: {name!r} is not a claim name")
    return name


# Headers the gateway reads or sets for itself (framing, routing, forwarding, the other
# identity): an identity read from one of them would change what they mean to it.
_RESERVED_HEADERS: Final = frozenset(
    {
        "host", "content-length", "transfer-encoding", "connection", "upgrade", "te",
        "trailer", "keep-alive", "expect", "proxy-connection", "proxy-authorization",
        "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-forwarded-port",
        "forwarded", "x-real-ip", "via", "x-request-id", "x-user-id",
        "x-http-method-override", "x-http-method", "x-method-override",
    }
)  # fmt: skip


def _header(section: Mapping[str, Any], where: str, default: str) -> str:
    raw = section.get("header", default)
    if not isinstance(raw, str) or not _TOKEN.fullmatch(raw):
        raise IdentityConfigError(f"{where}.header: {raw!r} is not a header name")
    if raw.lower().replace("_", "-") in _RESERVED_HEADERS:
        raise IdentityConfigError(
            f"{where}.header: {raw!r} is a header the gateway reads for itself; choose another"
        )
    if "_" in raw:
        # CGI/WSGI upstreams read '_' and '-' alike: a client's 'x-my-key' would reach them
        # as this header without being the one the gateway verified. The data plane
        # refuses a '_' spelling of every header it reads; it can only when those use '-'.
        raise IdentityConfigError(
            f"{where}.header: {raw!r} has '_', which upstreams read as '-'; write it with '-'"
        )
    if raw.count("-") > MAX_HEADER_DASHES:
        # The data plane looks up every '_' spelling of it (2 ** dashes) in one dict.
        raise IdentityConfigError(
            f"{where}.header: {raw!r} has over {MAX_HEADER_DASHES} '-'; choose a shorter name"
        )
    return raw.lower()


def _path(section: Mapping[str, Any], where: str, key: str, base_dir: Path) -> Path | None:
    raw = section.get(key)
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw.strip() or "\0" in raw:
        raise IdentityConfigError(f"{where}.{key}: expected a file path")
    path = Path(raw).expanduser()
    return path if path.is_absolute() else base_dir / path


def _choice(
    section: Mapping[str, Any], where: str, key: str, allowed: tuple[str, ...], default: str | None
) -> str | None:
    raw = section.get(key, default)
    if raw is not None and raw not in allowed:
        raise IdentityConfigError(f"{where}.{key}: {raw!r} is not one of {', '.join(allowed)}")
    return raw if isinstance(raw, str) else None


def _number(
    section: Mapping[str, Any], where: str, key: str, default: float, low: float, high: float
) -> float:
    raw = section.get(key, default)
    # bool is an int to Python, but 'leeway_seconds: yes' is a mistake, not 1 second.
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise IdentityConfigError(f"{where}.{key}: expected a number of seconds")
    if not low <= raw <= high:
        raise IdentityConfigError(f"{where}.{key}: must be between {low:g} and {high:g}")
    return float(raw)


def _milliseconds(section: Mapping[str, Any], where: str, key: str, default: float) -> float:
    raw = section.get(key, default)
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or not math.isfinite(raw)
        or not 0 < raw <= MAX_VERIFY_MS
    ):
        raise IdentityConfigError(
            f"{where}.{key}: expected milliseconds of CPU a second, more than 0 and at most "
            f"{MAX_VERIFY_MS:g} (a whole core; default {default:g})"
        )
    return float(raw)


def _string(raw: Any, where: str, *, required: bool) -> str:
    if not isinstance(raw, str) or (required and not raw):
        raise IdentityConfigError(f"{where}: required, a non-empty string")
    return raw


def _mapping(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise IdentityConfigError(f"{where}: expected a mapping")
    return raw


def _only(section: Mapping[str, Any], where: str, allowed: set[str] | frozenset[str]) -> None:
    unknown = sorted(str(k) for k in section if k not in allowed)
    if unknown:
        raise IdentityConfigError(
            f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})"
        )
