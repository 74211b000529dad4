"""Validation of control-plane request bodies.

Shape errors (wrong type, missing field, unknown key) are 422 at the door. Values that are
well-typed but cannot build (a config path that is not ``.json``, a repo URL that is not a
URL) are accepted and fail the revision later with ``BUILD_FAILED``, as the hosted service
does; see :func:`build_problem`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

MAX_NAME = 128
MAX_TEXT = 2048
MAX_SECRET_VALUE = 64 * 1024
MAX_SECRETS = 100
MAX_LIST = 100

SOURCES = ("github", "external_docker")
DEPLOYMENT_TYPES = ("dev", "prod")
SECRET_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
PROVIDER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

SOURCE_CONFIG_FIELDS = (
    "integration_id",
    "repo_url",
    "deployment_type",
    "build_on_push",
    "custom_url",
    "resource_spec",
    "listener_id",
    "listener_config",
)
REVISION_CONFIG_FIELDS = ("repo_ref", "langgraph_config_path", "image_uri")


class ValidationFailed(Exception):
    """A request body that does not have the expected shape (answered with 422)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


JSONObject = dict[str, Any]


MAX_PATH_KEY = 64


def check_text(value: str, where: str) -> str:
    """``value`` when it can be encoded as UTF-8; a lone surrogate (which JSON's ``\\ud800``
    escape can produce) is refused, because nothing downstream could store or send it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationFailed(f"{where}: not valid UTF-8 text (lone surrogate)") from None
    return value


def _path_key(key: str) -> str:
    return key if len(key) <= MAX_PATH_KEY else key[:MAX_PATH_KEY] + "..."


def check_json_values(document: object, where: str = "body") -> None:
    """Refuse what JSON parsing lets through but no JSON answer can carry: non-finite
    numbers (``1e400``, ``NaN``, ``Infinity``) and strings, object keys included, that are
    not encodable UTF-8. The message names the field, never the value (it may be secret).
    The walk is iterative, so nesting depth is bounded only by the parser."""
    stack: list[tuple[object, str]] = [(document, where)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValidationFailed(f"{path}: expected a finite number")
        elif isinstance(value, str):
            check_text(value, path)
        elif isinstance(value, dict):
            children: list[tuple[object, str]] = []
            for key, child in value.items():
                check_text(key, f"{path}: a field name")
                children.append((child, f"{path}.{_path_key(key)}"))
            stack.extend(reversed(children))
        elif isinstance(value, list):
            stack.extend((value[i], f"{path}[{i}]") for i in reversed(range(len(value))))


def _object(value: object, where: str) -> JSONObject:
    if not isinstance(value, dict):
        raise ValidationFailed(f"{where}: expected a JSON object")
    return value


def _no_unknown(body: Mapping[str, Any], allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ValidationFailed(f"{where}: unknown field(s) {', '.join(unknown)}")


def _string(
    value: object, where: str, *, nullable: bool = False, max_len: int = MAX_TEXT
) -> str | None:
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        kind = "a string or null" if nullable else "a string"
        raise ValidationFailed(f"{where}: expected {kind}")
    check_text(value, where)
    if len(value) > max_len:
        raise ValidationFailed(f"{where}: at most {max_len} characters")
    return value


def _required_string(body: Mapping[str, Any], key: str, where: str, max_len: int = MAX_TEXT) -> str:
    if key not in body or body[key] is None:
        raise ValidationFailed(f"{where}.{key}: field required")
    value = _string(body[key], f"{where}.{key}", max_len=max_len)
    assert value is not None
    if not value.strip():
        raise ValidationFailed(f"{where}.{key}: must not be empty")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValidationFailed(f"{where}: expected true or false")
    return value


def _http_url(value: str, where: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValidationFailed(f"{where}: expected an http(s) URL")
    return value


# ---- deployments -------------------------------------------------------------------------


def source_config_patch(raw: object) -> JSONObject:
    """Validate a (partial) ``source_config`` object; returns only the fields given."""
    body = _object(raw, "source_config")
    _no_unknown(body, SOURCE_CONFIG_FIELDS, "source_config")
    out: JSONObject = {}
    for key in ("integration_id", "repo_url", "custom_url", "listener_id"):
        if key in body:
            out[key] = _string(body[key], f"source_config.{key}", nullable=True)
    if "deployment_type" in body:
        value = body["deployment_type"]
        if value not in DEPLOYMENT_TYPES:
            raise ValidationFailed(
                f"source_config.deployment_type: expected one of {', '.join(DEPLOYMENT_TYPES)}"
            )
        out["deployment_type"] = value
    if "build_on_push" in body:
        out["build_on_push"] = _bool(body["build_on_push"], "source_config.build_on_push")
    for key in ("resource_spec", "listener_config"):
        if key in body:
            if body[key] is not None:
                _object(body[key], f"source_config.{key}")
            out[key] = body[key]
    return out


def revision_config_patch(raw: object) -> JSONObject:
    """Validate a (partial) ``source_revision_config``; ``graph_config_path`` is accepted as
    another name of ``langgraph_config_path``."""
    body = _object(raw, "source_revision_config")
    _no_unknown(body, (*REVISION_CONFIG_FIELDS, "graph_config_path"), "source_revision_config")
    out: JSONObject = {}
    for key in ("repo_ref", "image_uri"):
        if key in body:
            out[key] = _string(body[key], f"source_revision_config.{key}", nullable=True)
    paths = {
        key: _string(body[key], f"source_revision_config.{key}", nullable=True)
        for key in ("langgraph_config_path", "graph_config_path")
        if key in body
    }
    if len(paths) == 2 and paths["langgraph_config_path"] != paths["graph_config_path"]:
        raise ValidationFailed(
            "source_revision_config: langgraph_config_path and graph_config_path name the "
            "same field and differ"
        )
    if paths:
        out["langgraph_config_path"] = next(iter(paths.values()))
    return out


def secrets_list(raw: object) -> list[tuple[str, str]]:
    """Validate ``secrets``: a list of ``{name, value}`` with unique names."""
    if not isinstance(raw, list):
        raise ValidationFailed("secrets: expected a list of {name, value} objects")
    if len(raw) > MAX_SECRETS:
        raise ValidationFailed(f"secrets: at most {MAX_SECRETS} entries")
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        where = f"secrets[{index}]"
        body = _object(item, where)
        _no_unknown(body, ("name", "value"), where)
        name = _required_string(body, "name", where, MAX_NAME)
        if not SECRET_NAME.match(name):
            raise ValidationFailed(
                f"{where}.name: letters, digits and '_', not starting with a digit"
            )
        if name in seen:
            raise ValidationFailed(f"{where}.name: duplicate secret name {name}")
        seen.add(name)
        if "value" not in body:
            raise ValidationFailed(f"{where}.value: field required")
        value = _string(body["value"], f"{where}.value", max_len=MAX_SECRET_VALUE)
        assert value is not None
        out.append((name, value))
    return out


def check_complete(source: str, source_config: JSONObject, revision_config: JSONObject) -> None:
    """Fields a deployment of ``source`` cannot do without (422 when absent)."""
    if source == "github":
        for key in ("integration_id", "repo_url"):
            if not source_config.get(key):
                raise ValidationFailed(f"source_config.{key}: field required for source github")
        for key in ("repo_ref", "langgraph_config_path"):
            if not revision_config.get(key):
                raise ValidationFailed(
                    f"source_revision_config.{key}: field required for source github"
                )
    elif not revision_config.get("image_uri"):
        raise ValidationFailed(
            "source_revision_config.image_uri: field required for source external_docker"
        )


def deployment_create(raw: object) -> JSONObject:
    """Validate a create body; returns normalised parts (secrets as name/value pairs)."""
    body = _object(raw, "body")
    _no_unknown(
        body, ("name", "source", "source_config", "source_revision_config", "secrets"), "body"
    )
    name = _required_string(body, "name", "body", MAX_NAME).strip()
    source = body.get("source")
    if source not in SOURCES:
        raise ValidationFailed(f"body.source: expected one of {', '.join(SOURCES)}")
    source_config: JSONObject = {
        "integration_id": None,
        "repo_url": None,
        "deployment_type": "dev",
        "build_on_push": False,
        "custom_url": None,
        "resource_spec": None,
    }
    # null means "not given"; any other value must have the right type (``0``, ``""`` or
    # ``{}`` for a list are 422, not silently empty).
    if body.get("source_config") is not None:
        source_config.update(source_config_patch(body["source_config"]))
    revision_config: JSONObject = {
        "repo_ref": None,
        "langgraph_config_path": None,
        "image_uri": None,
    }
    if body.get("source_revision_config") is not None:
        revision_config.update(revision_config_patch(body["source_revision_config"]))
    secrets = secrets_list(body["secrets"]) if body.get("secrets") is not None else []
    check_complete(str(source), source_config, revision_config)
    return {
        "name": name,
        "source": source,
        "source_config": source_config,
        "source_revision_config": revision_config,
        "secrets": secrets,
    }


def deployment_patch(raw: object) -> JSONObject:
    """Validate a PATCH body; returns only the parts given."""
    body = _object(raw, "body")
    _no_unknown(body, ("source_config", "source_revision_config", "secrets"), "body")
    out: JSONObject = {}
    if "source_config" in body:
        out["source_config"] = source_config_patch(body["source_config"])
    if "source_revision_config" in body:
        out["source_revision_config"] = revision_config_patch(body["source_revision_config"])
    if "secrets" in body:
        out["secrets"] = secrets_list(body["secrets"])
    return out


def build_problem(
    source: str, source_config: Mapping[str, Any], revision_config: Mapping[str, Any]
) -> str | None:
    """Why the emulated build of this revision fails, or None when it would build."""
    if source == "github":
        repo_url = str(source_config.get("repo_url") or "")
        parts = urlsplit(repo_url)
        if parts.scheme not in ("http", "https") or not parts.netloc or " " in repo_url:
            return f"repo_url is not a repository URL: {repo_url[:200]!r}"
        path = str(revision_config.get("langgraph_config_path") or "")
        if not path.endswith(".json") or path.endswith("/.json") or path == ".json":
            return f"langgraph_config_path must name a .json file, got {path[:200]!r}"
        if path.startswith("/") or ".." in path.split("/"):
            return f"langgraph_config_path must be relative to the repository: {path[:200]!r}"
    else:
        image = str(revision_config.get("image_uri") or "")
        if any(ch.isspace() for ch in image) or image.startswith(("/", ":")):
            return f"image_uri is not an image reference: {image[:200]!r}"
    return None


# ---- listeners ---------------------------------------------------------------------------


def _compute_config(raw: object) -> JSONObject:
    body = _object(raw, "compute_config")
    _no_unknown(body, ("k8s_namespaces",), "compute_config")
    namespaces = body.get("k8s_namespaces")
    if namespaces is not None:
        if not isinstance(namespaces, list) or len(namespaces) > MAX_LIST:
            raise ValidationFailed(f"compute_config.k8s_namespaces: a list of at most {MAX_LIST}")
        for index, item in enumerate(namespaces):
            _string(item, f"compute_config.k8s_namespaces[{index}]", max_len=MAX_NAME)
    return {"k8s_namespaces": namespaces}


def listener_create(raw: object) -> JSONObject:
    """Validate a listener create body."""
    body = _object(raw, "body")
    _no_unknown(body, ("compute_type", "compute_id", "compute_config", "version"), "body")
    if body.get("compute_type") != "k8s":
        raise ValidationFailed("body.compute_type: expected k8s")
    compute_id = _required_string(body, "compute_id", "body", MAX_NAME)
    if "compute_config" not in body:
        raise ValidationFailed("body.compute_config: field required")
    return {
        "compute_type": "k8s",
        "compute_id": compute_id,
        "compute_config": _compute_config(body["compute_config"]),
        "version": _string(body.get("version"), "body.version", nullable=True, max_len=MAX_NAME),
    }


def listener_patch(raw: object, current: Mapping[str, Any]) -> JSONObject:
    """Validate a listener PATCH; compute type and id are immutable."""
    body = _object(raw, "body")
    _no_unknown(body, ("compute_type", "compute_id", "compute_config", "version"), "body")
    for key in ("compute_type", "compute_id"):
        if key in body and body[key] != current[key]:
            raise ValidationFailed(f"body.{key}: cannot be changed once the listener exists")
    out: JSONObject = {}
    if "compute_config" in body:
        out["compute_config"] = _compute_config(body["compute_config"])
    if "version" in body:
        out["version"] = _string(body["version"], "body.version", nullable=True, max_len=MAX_NAME)
    return out


# ---- auth service ------------------------------------------------------------------------

PROVIDER_FIELDS = (
    "provider_id",
    "name",
    "client_id",
    "client_secret",
    "auth_url",
    "token_url",
    "uses_pkce",
    "code_challenge_method",
    "token_endpoint_auth_method",
)
TOKEN_AUTH_METHODS = ("none", "client_secret_basic", "client_secret_post")


def provider_fields(raw: object, *, create: bool) -> JSONObject:
    """Validate an OAuth provider body (all required fields on create, any subset on PATCH).

    ``client_secret`` is returned as ``has_client_secret``: the value is never kept.
    """
    body = _object(raw, "body")
    _no_unknown(body, PROVIDER_FIELDS, "body")
    out: JSONObject = {}
    if create:
        provider_id = _required_string(body, "provider_id", "body", MAX_NAME)
        if not PROVIDER_ID.match(provider_id):
            raise ValidationFailed("body.provider_id: letters, digits, '.', '_' or '-'")
        out["provider_id"] = provider_id
    elif "provider_id" in body:
        raise ValidationFailed("body.provider_id: cannot be changed")
    for key in ("name", "client_id", "auth_url", "token_url"):
        if create or key in body:
            out[key] = _required_string(body, key, "body", MAX_NAME if key == "name" else MAX_TEXT)
    for key in ("auth_url", "token_url"):
        if key in out:
            _http_url(out[key], f"body.{key}")
    if "client_secret" in body:
        secret = _string(body["client_secret"], "body.client_secret", nullable=True)
        out["has_client_secret"] = bool(secret)
    elif create:
        out["has_client_secret"] = False
    if create or "uses_pkce" in body:
        out["uses_pkce"] = _bool(body.get("uses_pkce", False), "body.uses_pkce")
    if create or "code_challenge_method" in body:
        method = body.get("code_challenge_method", "S256")
        if method not in ("S256", "plain"):
            raise ValidationFailed("body.code_challenge_method: expected S256 or plain")
        out["code_challenge_method"] = method
    if create or "token_endpoint_auth_method" in body:
        method = body.get("token_endpoint_auth_method", "client_secret_post")
        if method not in TOKEN_AUTH_METHODS:
            raise ValidationFailed(
                f"body.token_endpoint_auth_method: expected one of {', '.join(TOKEN_AUTH_METHODS)}"
            )
        out["token_endpoint_auth_method"] = method
    return out


def authenticate_request(raw: object) -> JSONObject:
    """Validate ``POST /v2/auth/authenticate``."""
    body = _object(raw, "body")
    _no_unknown(
        body,
        (
            "provider",
            "scopes",
            "user_id",
            "ls_user_id",
            "agent_id",
            "use_agent_builder_public_oauth",
            "force_new",
            "token_id",
            "redirect_uri",
            "is_default",
            "check_only",
        ),
        "body",
    )
    provider = _required_string(body, "provider", "body", MAX_NAME)
    scopes = body.get("scopes")
    if not isinstance(scopes, list) or len(scopes) > MAX_LIST:
        raise ValidationFailed(f"body.scopes: expected a list of at most {MAX_LIST} strings")
    for index, scope in enumerate(scopes):
        _string(scope, f"body.scopes[{index}]", max_len=MAX_NAME)
    user_id = _string(body.get("user_id"), "body.user_id", nullable=True, max_len=MAX_NAME)
    ls_user_id = _string(body.get("ls_user_id"), "body.ls_user_id", nullable=True, max_len=MAX_NAME)
    redirect_uri = _string(body.get("redirect_uri"), "body.redirect_uri", nullable=True)
    if redirect_uri:
        _http_url(redirect_uri, "body.redirect_uri")
    for key in ("force_new", "check_only", "is_default", "use_agent_builder_public_oauth"):
        if key in body:
            _bool(body[key], f"body.{key}")
    _string(body.get("agent_id"), "body.agent_id", nullable=True, max_len=MAX_NAME)
    _string(body.get("token_id"), "body.token_id", nullable=True, max_len=MAX_NAME)
    return {
        "provider": provider,
        "scopes": sorted(set(scopes)),
        "user_id": user_id or ls_user_id or "",
        "force_new": bool(body.get("force_new", False)),
        "check_only": bool(body.get("check_only", False)),
        "redirect_uri": redirect_uri,
    }


def callback_request(raw: Mapping[str, Any]) -> tuple[str, str]:
    """Validate an OAuth callback's ``code`` and ``state``."""
    code = _required_string(raw, "code", "body", MAX_TEXT)
    state = _required_string(raw, "state", "body", MAX_TEXT)
    return code, state
