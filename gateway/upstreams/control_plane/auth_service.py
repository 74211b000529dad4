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

from . import validation
from .http_helpers import (
    PUBLIC_ROUTE_PREFIX,
    create_resource,
    delete_resource,
    get_resource,
    list_resources,
    not_found,
    path_id,
    read_json,
    runtime,
    tenant,
)
from .storage import ControlPlaneStore as Store

log = logging.getLogger("gateway.control_plane")
WAIT_POLL_SECONDS = 0.05


def _missing(provider_id: str) -> NoReturn:
    not_found(f"OAuth provider {provider_id} not found.")


def _state_digest(state: str) -> str:
    return hashlib.sha256(state.encode("utf-8")).hexdigest()


def _provider_create(raw: object) -> dict[str, Any]:
    return validation.provider_fields(raw, create=True)


async def create_provider(request: web.Request) -> web.Response:
    return await create_resource(request, _provider_create, Store.create_provider)


async def list_providers(request: web.Request) -> web.Response:
    return await list_resources(request, Store.list_providers)


async def get_provider(request: web.Request) -> web.Response:
    return await get_resource(request, "provider_id", Store.get_provider, _missing)


async def patch_provider(request: web.Request) -> web.Response:
    rt = runtime(request)
    provider_id = path_id(request, "provider_id")
    patch = validation.provider_fields(await read_json(request), create=False)
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
    body = validation.authenticate_request(await read_json(request))
    tenant_id = tenant(request)
    db = rt.database()
    provider = await db.run(db.store.get_provider, tenant_id, body["provider"])
    if provider is None:
        _missing(body["provider"])
    now = rt.clock()
    if not body["force_new"]:
        done = await db.run(
            db.store.completed_token,
            tenant_id,
            body["provider"],
            body["user_id"],
            body["scopes"],
            now,
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
    if body["check_only"]:
        return web.json_response(
            {"status": "connection_required", "url": None, "auth_id": None, "token": None}
        )
    state = secrets.token_urlsafe(32)
    auth_id = await db.run(
        db.store.create_flow,
        tenant_id,
        body["provider"],
        body["user_id"],
        body["scopes"],
        _state_digest(state),
        now,
        now + rt.config.auth_flow_ttl_seconds,
    )
    query: dict[str, str] = {
        "response_type": "code",
        "client_id": provider["client_id"],
        "redirect_uri": body["redirect_uri"] or _callback_url(request, body["provider"]),
        "scope": " ".join(body["scopes"]),
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
    raw_timeout = request.query.get("timeout")
    timeout = rt.config.auth_wait_max_seconds
    if raw_timeout is not None:
        try:
            timeout = float(raw_timeout)
        except ValueError:
            raise validation.ValidationFailed("timeout: expected a number of seconds") from None
        if not 0 <= timeout <= rt.config.auth_wait_max_seconds:
            raise validation.ValidationFailed(
                f"timeout: must be between 0 and {rt.config.auth_wait_max_seconds:g}"
            )
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
        params: dict[str, Any] = dict(request.query)
    else:
        body = await read_json(request)
        if not isinstance(body, dict):
            raise validation.ValidationFailed("body: expected a JSON object")
        params = body
    _code, state = validation.callback_request(params)
    token = "emulated-" + secrets.token_urlsafe(32)
    db = rt.database()
    auth_id = await db.run(
        db.store.complete_flow, provider_id, _state_digest(state), token, rt.clock()
    )
    if auth_id is None:
        not_found("No pending authentication matches this state.")
    log.info("oauth flow completed: auth_id=%s provider=%s", auth_id, provider_id)
    return web.json_response({"status": "completed", "auth_id": auth_id})


def add_routes(router: web.UrlDispatcher, prefix: str) -> None:
    base = f"{prefix}/v2/auth"
    router.add_post(base + "/providers", create_provider)
    router.add_get(base + "/providers", list_providers, allow_head=False)
    router.add_get(base + "/providers/{provider_id}", get_provider, allow_head=False)
    router.add_patch(base + "/providers/{provider_id}", patch_provider)
    router.add_delete(base + "/providers/{provider_id}", delete_provider)
    router.add_post(base + "/authenticate", authenticate)
    router.add_get(base + "/wait/{auth_id}", wait_for_auth, allow_head=False)
    name = f"{PUBLIC_ROUTE_PREFIX}oauth-callback{prefix.replace('/', '-')}"
    router.add_post(base + "/callback/{provider_id}", oauth_callback, name=name + "-post")
    router.add_get(
        base + "/callback/{provider_id}", oauth_callback, name=name + "-get", allow_head=False
    )
