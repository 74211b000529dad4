"""Integrations (v1): code-host installations and their repositories, from configuration."""

from __future__ import annotations

from aiohttp import web

from gateway.upstreams.http_api.openapi import Operation, Response
from gateway.upstreams.http_api.routes import Route

from .api_doc import AUTHENTICATED, errors
from .http_helpers import not_found, path_id, runtime, tenant
from .models import GithubInstall, GithubRepository, PathId
from .rules import visible_to

TAG = "Integrations"  # the group of these operations in the OpenAPI document


async def github_install(request: web.Request) -> web.Response:
    config = runtime(request).config
    tenant_id = tenant(request)
    answer: GithubInstall = {
        "url": config.github_install_url,
        "installations": [
            {"id": item.id, "name": item.name}
            for item in config.github_integrations
            if visible_to(item, tenant_id)
        ],
    }
    return web.json_response(answer)


async def github_repos(request: web.Request) -> web.Response:
    config = runtime(request).config
    integration_id = path_id(request, "integration_id")
    tenant_id = tenant(request)
    for item in config.github_integrations:
        if item.id == integration_id and visible_to(item, tenant_id):
            repos: list[GithubRepository] = [
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
            return web.json_response(repos)
    not_found(f"Integration ID {integration_id} not found.")


_BASE = "/v1/integrations/github"

ROUTES = (
    Route(
        Operation(
            "get",
            _BASE + "/install",
            "github_install",
            "The code-host app's install URL and the installations this tenant can use",
            {200: Response("Installations", GithubInstall), **errors(*AUTHENTICATED)},
            tag=TAG,
        ),
        github_install,
    ),
    Route(
        Operation(
            "get",
            _BASE + "/{integration_id}/repos",
            "github_repositories",
            "The repositories of an installation",
            {
                200: Response("Repositories", list[GithubRepository]),
                **errors(*AUTHENTICATED, 404, 422),
            },
            path_parameter=PathId,
            tag=TAG,
        ),
        github_repos,
    ),
)
