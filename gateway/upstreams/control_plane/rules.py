"""What a request model cannot check: whether an integration is one the tenant can see
(configuration), and the emulated build's verdict on input that is well-formed but cannot
build (accepted, then the revision fails).

Everything a body can be judged on alone is in ``models.py`` (and so in the OpenAPI
document). The rules here are named in the document's operation descriptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from gateway.upstreams.http_api.problems import InvalidRequest

from .config import ControlPlaneConfig, GithubIntegration


def integration_visible(config: ControlPlaneConfig, tenant_id: str, integration_id: str) -> bool:
    """True when ``integration_id`` is configured and ``tenant_id`` may use it."""
    return any(
        item.id == integration_id and visible_to(item, tenant_id)
        for item in config.github_integrations
    )


def visible_to(integration: GithubIntegration, tenant_id: str) -> bool:
    """Whether a tenant sees an integration (None: every tenant does)."""
    return integration.tenant_ids is None or tenant_id in integration.tenant_ids


def check_integration(
    config: ControlPlaneConfig, tenant_id: str, source_config: Mapping[str, Any]
) -> None:
    """A named ``integration_id`` must be one this tenant can see, when integrations are
    configured at all. Another tenant's integration and a non-existent one get the same
    422, so the answer reveals nothing about other tenants. With no integrations configured
    (the default embedded setup) any id is accepted, so the quick-start works as is."""
    integration_id = source_config.get("integration_id")
    if integration_id is None or not config.github_integrations:
        return
    if not integration_visible(config, tenant_id, str(integration_id)):
        raise InvalidRequest(
            f"source_config.integration_id: no integration {integration_id} is available "
            "to this tenant (see GET /v1/integrations/github/install)"
        )


def build_problem(
    source: str, source_config: Mapping[str, Any], revision_config: Mapping[str, Any]
) -> str | None:
    """Why the emulated build of this revision fails, or None when it would build.

    Such input is accepted (201) and fails the revision at its build step with
    ``BUILD_FAILED``, as the hosted service does."""
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
