"""How the control plane's stored rows read as the API's models.

Each tenant-scoped table is described once (:class:`Table`: its name, the column a request
names a row by, and the conversion of a row to the model the API answers with); the
conversions decode the JSON columns and show timestamps as ISO 8601. ``canonical_json`` is
how configurations are written.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

from .models import Deployment, Listener, Provider, Revision, RevisionConfigView

R = TypeVar("R")
Row = dict[str, Any]


def canonical_json(value: object) -> str:
    """``value`` as stored: compact UTF-8 JSON with sorted keys, so the bytes a field is
    measured at (``limits.json_size``) are the bytes it takes."""
    # allow_nan=False: a non-finite number must never be stored (it is not JSON); request
    # validation refuses them first, so this only guards against a bug. ensure_ascii=False
    # is safe: validation refuses lone surrogates, and control characters are still escaped.
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def iso(ts: float) -> str:
    """An epoch timestamp as ISO 8601 UTC."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _revision_config_out(config: Row) -> RevisionConfigView:
    # Both names of the field are shown so clients written against either spelling work.
    return {
        "repo_ref": config.get("repo_ref"),
        "langgraph_config_path": config.get("langgraph_config_path"),
        "graph_config_path": config.get("langgraph_config_path"),
        "image_uri": config.get("image_uri"),
    }


def _deployment_out(row: sqlite3.Row) -> Deployment:
    return deployment_view(row, json.loads(row["source_config"]))


def deployment_view(row: sqlite3.Row, source_config: Any) -> Deployment:
    """A deployment row as answered, with ``source_config`` as given (the decoded column,
    or a placeholder for ``row_json`` to replace with the stored text)."""
    return {
        "id": row["id"],
        "tenant_id": row["tenant_id"],
        "name": row["name"],
        "source": row["source"],
        "source_config": source_config,
        "source_revision_config": _revision_config_out(json.loads(row["source_revision_config"])),
        "secrets": [{"name": name} for name in json.loads(row["secret_names"])],
        "status": row["status"],
        "latest_revision_id": row["latest_revision_id"],
        "active_revision_id": row["active_revision_id"],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def revision_out(row: sqlite3.Row) -> Revision:
    return revision_view(row, json.loads(row["source_config"]))


def revision_view(row: sqlite3.Row, source_config: Any) -> Revision:
    """A revision row as answered; ``source_config`` as in ``deployment_view``."""
    return {
        "id": row["id"],
        "deployment_id": row["deployment_id"],
        "status": row["status"],
        "status_message": row["status_message"],
        "source": row["source"],
        "source_config": source_config,
        "source_revision_config": _revision_config_out(json.loads(row["source_revision_config"])),
        "secrets": [{"name": name} for name in json.loads(row["secret_names"])],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _listener_out(row: sqlite3.Row) -> Listener:
    return {
        "id": row["id"],
        "tenant_id": row["tenant_id"],
        "compute_type": row["compute_type"],
        "compute_id": row["compute_id"],
        "compute_config": json.loads(row["compute_config"]),
        "version": row["version"],
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _provider_out(row: sqlite3.Row) -> Provider:
    return {
        "id": row["id"],
        "organization_id": row["tenant_id"],
        "provider_id": row["provider_id"],
        "name": row["name"],
        "client_id": row["client_id"],
        "auth_url": row["auth_url"],
        "token_url": row["token_url"],
        "uses_pkce": bool(row["uses_pkce"]),
        "code_challenge_method": row["code_challenge_method"],
        "token_endpoint_auth_method": row["token_endpoint_auth_method"],
        "has_client_secret": bool(row["has_client_secret"]),
        "provider_type": None,
        "created_at": iso(row["created_at"]),
        "updated_at": iso(row["updated_at"]),
    }


def _compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def row_json(view: Mapping[str, Any], raw: Mapping[str, str]) -> str:
    """``view`` as compact JSON, the fields named in ``raw`` written as that stored JSON
    text instead of their value (in their place). A list page is built this way, so the
    free-form configurations are copied as text, never decoded into objects and encoded
    again (which costs memory and time many times their size)."""
    fields = (
        f"{_compact(key)}:{raw[key] if key in raw else _compact(value)}"
        for key, value in view.items()
    )
    return "{" + ",".join(fields) + "}"


@dataclass(frozen=True)
class Table(Generic[R]):
    """A tenant-scoped table: its name, the column a request names a row by and how a row is
    shown. Table and column names come from the fixed instances below, never from a request."""

    name: str
    key: str
    out: Callable[[sqlite3.Row], R]


DEPLOYMENTS = Table("deployments", "id", _deployment_out)
LISTENERS = Table("listeners", "id", _listener_out)
PROVIDERS = Table("auth_providers", "provider_id", _provider_out)
