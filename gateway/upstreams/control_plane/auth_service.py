"""Auth Service (v2): OAuth provider configuration and an emulated authentication flow.

Nothing here talks to a real identity provider. ``authenticate`` returns the provider's
authorisation URL with a fresh ``state``; whoever completes the flow calls the callback with
that ``state`` (as the provider's redirect would), and the flow then holds an emulated token
that ``wait`` and later ``authenticate`` calls return. Only the SHA-256 of ``state`` is
stored; client secrets are never stored at all.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from typing import Any, NoReturn
from urllib.parse import urlencode

from aiohttp import web

from gateway.upstreams.http_api.openapi import Operation, Response
from gateway.upstreams.http_api.routes import Route

from .api_doc import AUTHENTICATED, Resource, ResourceHandlers, errors, resource_routes
from .http_helpers import (
    READ,
    create_resource,
    delete_resource,
    get_resource,
    list_resources,
    not_found,
    path_id,
    read_body,
    runtime,
    tenant,
)
from .models import (
    AuthenticateRequest,
    AuthenticateResponse,
    CallbackRequest,
    CallbackResponse,
    PathId,
    Provider,
    ProviderCreate,
    ProviderList,
    ProviderPatch,
    WaitResponse,
    wait_query,
)
from .storage import ControlPlaneStore as Store

TAG = "Auth Service"  # the group of these operations in the OpenAPI document
log = logging.getLogger("gateway.control_plane")
WAIT_POLL_SECONDS = 0.05


def _missing(provider_id: str) -> NoReturn:
    not_found(f"OAuth provider {provider_id} not found.")


def _state_digest(state: str) -> str:
    return hashlib.sha256(state.encode("utf-8")).hexdigest()


def _provider_row(given: dict[str, Any]) -> dict[str, Any]:
    # The client secret is never kept: only whether one was given.
    if "client_secret" in given:
        given["has_client_secret"] = bool(given.pop("client_secret"))
    return given


async def create_provider(request: web.Request) -> web.Response:
    body = await read_body(request, ProviderCreate)
    data = _provider_row(body.model_dump())
    return await create_resource(request, data, Store.create_provider)


async def list_providers(request: web.Request) -> web.Response:
    return await list_resources(request, Store.list_providers)


async def get_provider(request: web.Request) -> web.Response:
    return await get_resource(request, "provider_id", Store.get_provider, _missing)


async def patch_provider(request: web.Request) -> web.Response:
    rt = runtime(request)
    provider_id = path_id(request, "provider_id")
    patch = _provider_row((await read_body(request, ProviderPatch)).model_dump(exclude_unset=True))
    db = rt.database()
    provider = await db.run(
        db.store.patch_provider, tenant(request), provider_id, patch, rt.clock()
    )
    if provider is None:
        _missing(provider_id)
    return web.json_response(provider)


async def delete_provider(request: web.Request) -> web.Response:
    return await delete_resource(request, "provider_id", Store.delete_provider, _missing)


def _callback_url(request: web.Request, provider_id: str) -> str:
    prefix = "/api-host" if request.path.startswith("/api-host/") else ""
    return f"{request.scheme}://{request.host}{prefix}/v2/auth/callback/{provider_id}"


async def authenticate(request: web.Request) -> web.Response:
    rt = runtime(request)
    body = await read_body(request, AuthenticateRequest)
    scopes = sorted(set(body.scopes))
    user_id = body.user_id or body.ls_user_id or ""
    tenant_id = tenant(request)
    db = rt.database()
    provider = await db.run(db.store.get_provider, tenant_id, body.provider)
    if provider is None:
        _missing(body.provider)
    now = rt.clock()
    if not body.force_new:
        done = await db.run(
            db.store.completed_token, tenant_id, body.provider, user_id, scopes, now
        )
        if done is not None:
            return web.json_response(
                {
                    "status": "completed",
                    "url": None,
                    "auth_id": done["auth_id"],
                    "token": done["token"],
                }
            )
    if body.check_only:
        return web.json_response(
            {"status": "connection_required", "url": None, "auth_id": None, "token": None}
        )
    state = secrets.token_urlsafe(32)
    auth_id = await db.run(
        db.store.create_flow,
        tenant_id,
        body.provider,
        user_id,
        scopes,
        _state_digest(state),
        now,
        now + rt.config.auth_flow_ttl_seconds,
    )
    query: dict[str, str] = {
        "response_type": "code",
        "client_id": provider["client_id"],
        "redirect_uri": body.redirect_uri or _callback_url(request, body.provider),
        "scope": " ".join(scopes),
        "state": state,
    }
    if provider["uses_pkce"]:
        # The emulation never exchanges the code, so the verifier is not kept.
        verifier = secrets.token_urlsafe(48)
        query["code_challenge"] = hashlib.sha256(verifier.encode()).hexdigest()
        query["code_challenge_method"] = provider["code_challenge_method"] or "S256"
    separator = "&" if "?" in provider["auth_url"] else "?"
    url = provider["auth_url"] + separator + urlencode(query)
    return web.json_response({"status": "pending", "url": url, "auth_id": auth_id, "token": None})


async def wait_for_auth(request: web.Request) -> web.Response:
    rt = runtime(request)
    auth_id = path_id(request, "auth_id")
    query = READ.query(wait_query(rt.config.auth_wait_max_seconds), request.query)
    timeout = rt.config.auth_wait_max_seconds if query.timeout is None else query.timeout
    db = rt.database()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        flow: dict[str, Any] | None = await db.run(db.store.get_flow, tenant(request), auth_id)
        if flow is None or (flow["status"] == "pending" and flow["expires_at"] < rt.clock()):
            not_found(f"Auth ID {auth_id} not found or expired.")
        if flow["status"] == "completed" or loop.time() >= deadline:
            return web.json_response(
                {"status": flow["status"], "auth_id": auth_id, "token": flow["token"], "url": None}
            )
        await asyncio.sleep(min(WAIT_POLL_SECONDS, max(0.0, deadline - loop.time())))


async def oauth_callback(request: web.Request) -> web.Response:
    """Public: a browser redirect carries no API key; the unguessable ``state`` is the proof."""
    rt = runtime(request)
    provider_id = path_id(request, "provider_id")
    if request.method == "GET":
        callback = READ.query(CallbackRequest, request.query)
    else:
        callback = await read_body(request, CallbackRequest)
    state = callback.state
    token = "emulated-" + secrets.token_urlsafe(32)
    db = rt.database()
    auth_id = await db.run(
        db.store.complete_flow, provider_id, _state_digest(state), token, rt.clock()
    )
    if auth_id is None:
        not_found("No pending authentication matches this state.")
    log.info("oauth flow completed: auth_id=%s provider=%s", auth_id, provider_id)
    return web.json_response({"status": "completed", "auth_id": auth_id})


_BY_PROVIDER = {"provider_id": "provider_id"}
PROVIDERS = Resource(
    noun="provider",
    plural="providers",
    base="/v2/auth/providers",
    key="provider_id",
    view=Provider,
    page=ProviderList,
    create_body=ProviderCreate,
    update_body=ProviderPatch,
    tag=TAG,
    id_field="provider_id",
    conflicts=True,
    summaries={
        "create": "Configure an OAuth provider",
        "delete": "Delete an OAuth provider and its flows",
    },
    created_links={"complete_auth": _BY_PROVIDER, "complete_auth_post": _BY_PROVIDER},
)
_CALLBACK = "/v2/auth/callback/{provider_id}"


def routes(wait_max_seconds: float) -> tuple[Route, ...]:
    """The auth service's routes; ``wait_max_seconds`` bounds ``timeout`` of the wait."""
    callback_answers = {
        200: Response("The flow is complete", CallbackResponse),
        **errors(404, 413, 422, 429),
    }
    return (
        *resource_routes(
            PROVIDERS,
            ResourceHandlers(
                create_provider, list_providers, get_provider, patch_provider, delete_provider
            ),
        ),
        Route(
            Operation(
                "post",
                "/v2/auth/authenticate",
                "authenticate",
                "Start an OAuth flow, or answer the token of a completed one",
                {
                    200: Response(
                        "Pending (with the URL to visit), or completed", AuthenticateResponse
                    ),
                    **errors(*AUTHENTICATED, 404, 413, 422, 429),
                },
                body=AuthenticateRequest,
                tag=TAG,
            ),
            authenticate,
        ),
        Route(
            Operation(
                "get",
                "/v2/auth/wait/{auth_id}",
                "wait_for_auth",
                "Wait for a flow to complete",
                {
                    200: Response("The flow's status", WaitResponse),
                    **errors(*AUTHENTICATED, 404, 422),
                },
                query=wait_query(wait_max_seconds),
                path_parameter=PathId,
                tag=TAG,
            ),
            wait_for_auth,
        ),
        Route(
            Operation(
                "post",
                _CALLBACK,
                "complete_auth_post",
                "Complete a flow (the provider's redirect; no credentials, the state is one)",
                callback_answers,
                body=CallbackRequest,
                path_parameter=PathId,
                public=True,
                tag=TAG,
            ),
            oauth_callback,
        ),
        Route(
            Operation(
                "get",
                _CALLBACK,
                "complete_auth",
                "Complete a flow (the provider's redirect; no credentials, the state is one)",
                callback_answers,
                query=CallbackRequest,
                path_parameter=PathId,
                public=True,
                tag=TAG,
            ),
            oauth_callback,
        ),
    )
