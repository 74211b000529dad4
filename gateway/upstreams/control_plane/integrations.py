"""Integrations (v1): code-host installations and their repositories, from configuration."""

from __future__ import annotations

from aiohttp import web

from .config import ControlPlaneConfig, GithubIntegration
from .http_helpers import not_found, path_id, runtime, tenant


def _visible(integration: GithubIntegration, tenant_id: str) -> bool:
    return integration.tenant_ids is None or tenant_id in integration.tenant_ids


def integration_visible(config: ControlPlaneConfig, tenant_id: str, integration_id: str) -> bool:
    """True when ``integration_id`` is configured and ``tenant_id`` may use it."""
    return any(
        item.id == integration_id and _visible(item, tenant_id)
        for item in config.github_integrations
    )


async def github_install(request: web.Request) -> web.Response:
    config = runtime(request).config
    tenant_id = tenant(request)
    installations = [
        {"id": item.id, "name": item.name}
        for item in config.github_integrations
        if _visible(item, tenant_id)
    ]
    return web.json_response({"url": config.github_install_url, "installations": installations})


async def github_repos(request: web.Request) -> web.Response:
    config = runtime(request).config
    integration_id = path_id(request, "integration_id")
    tenant_id = tenant(request)
    for item in config.github_integrations:
        if item.id == integration_id and _visible(item, tenant_id):
            return web.json_response(
                [
                    {
                        "owner": repo.owner,
                        "name": repo.name,
                        "full_name": f"{repo.owner}/{repo.name}",
                        "url": repo.url,
                        "default_branch": repo.default_branch,
                        "private": repo.private,
                    }
                    for repo in item.repos
                ]
            )
    not_found(f"Integration ID {integration_id} not found.")


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    base = f"{prefix}/v1/integrations/github"
    router.add_get(base + "/install", github_install, allow_head=False)
    router.add_get(base + "/{integration_id}/repos", github_repos, allow_head=False)
