"""Listeners (v2), Auth Service (v2) and Integrations (v1)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from .support import KEY_B, TENANT_A, TENANT_B, headers

H = headers()
HB = headers(KEY_B, TENANT_B)
LISTENER = {
    "compute_type": "k8s",
    "compute_id": "cluster-1",
    "compute_config": {"k8s_namespaces": ["agents"]},
    "version": "0.1",
}
PROVIDER = {
    "provider_id": "github-oauth",
    "name": "GitHub",
    "client_id": "client-123",
    "client_secret": "client-SECRET-value",
    "auth_url": "https://github.example/login/oauth/authorize",
    "token_url": "https://github.example/login/oauth/access_token",
}


async def test_listener_crud_and_conflicts(http):
    r = await http.post("/v2/listeners", json=LISTENER, headers=H)
    assert r.status == 201
    listener = await r.json()
    assert listener["compute_id"] == "cluster-1"
    assert listener["tenant_id"] == TENANT_A
    lid = listener["id"]

    r = await http.post("/v2/listeners", json=LISTENER, headers=H)
    assert r.status == 409
    assert "cluster-1" in (await r.json())["detail"]
    r = await http.post("/v2/listeners", json=LISTENER, headers=HB)
    assert r.status == 201  # the same compute id in another tenant is fine

    r = await http.get("/api-host/v2/listeners", headers=H)
    listing = await r.json()
    assert [item["id"] for item in listing["resources"]] == [lid]
    assert listing["offset"] == 1

    r = await http.patch(f"/v2/listeners/{lid}", json={"version": "0.2"}, headers=H)
    assert r.status == 200
    assert (await r.json())["version"] == "0.2"
    r = await http.patch(f"/v2/listeners/{lid}", json={"compute_id": "other"}, headers=H)
    assert r.status == 422
    r = await http.patch(
        f"/v2/listeners/{lid}", json={"compute_config": {"k8s_namespaces": ["a", "b"]}}, headers=H
    )
    assert (await r.json())["compute_config"] == {"k8s_namespaces": ["a", "b"]}

    r = await http.get(f"/v2/listeners/{lid}", headers=HB)
    assert r.status == 404
    assert await r.json() == {"detail": f"Listener ID {lid} not found."}
    r = await http.delete(f"/v2/listeners/{lid}", headers=H)
    assert r.status == 204
    r = await http.get(f"/v2/listeners/{lid}", headers=H)
    assert r.status == 404


async def test_listener_validation(http):
    for body in [
        {**LISTENER, "compute_type": "vm"},
        {**LISTENER, "compute_id": ""},
        {k: v for k, v in LISTENER.items() if k != "compute_config"},
        {**LISTENER, "compute_config": {"k8s_namespaces": "agents"}},
        {**LISTENER, "extra": 1},
    ]:
        r = await http.post("/v2/listeners", json=body, headers=H)
        assert r.status == 422, body


async def test_provider_crud_never_returns_client_secret(http):
    r = await http.post("/v2/auth/providers", json=PROVIDER, headers=H)
    assert r.status == 201
    text = await r.text()
    assert "client-SECRET-value" not in text
    provider = await r.json()
    assert provider["organization_id"] == TENANT_A
    assert provider["has_client_secret"] is True
    assert provider["uses_pkce"] is False
    assert provider["code_challenge_method"] == "S256"

    r = await http.post("/v2/auth/providers", json=PROVIDER, headers=H)
    assert r.status == 409
    r = await http.get("/v2/auth/providers", headers=H)
    assert [p["provider_id"] for p in (await r.json())["resources"]] == ["github-oauth"]
    r = await http.get("/v2/auth/providers/github-oauth", headers=HB)
    assert r.status == 404
    r = await http.patch(
        "/v2/auth/providers/github-oauth", json={"name": "GitHub 2", "uses_pkce": True}, headers=H
    )
    assert r.status == 200
    patched = await r.json()
    assert patched["name"] == "GitHub 2" and patched["uses_pkce"] is True
    r = await http.patch("/v2/auth/providers/github-oauth", json={"auth_url": "ftp://x"}, headers=H)
    assert r.status == 422
    # A fragment would hide the flow's parameters appended after it (RFC 6749 3.1).
    for body, send in [
        ({"auth_url": "https://a.example/x?y=1#frag"}, http.patch),
        ({**PROVIDER, "provider_id": "other", "auth_url": "https://a.example/#"}, http.post),
    ]:
        path = "/v2/auth/providers" + ("" if send == http.post else "/github-oauth")
        r = await send(path, json=body, headers=H)
        assert r.status == 422, await r.text()
        assert (await r.json())["detail"].startswith("auth_url:")
    r = await http.patch("/v2/auth/providers/github-oauth", json={"provider_id": "x"}, headers=H)
    assert r.status == 422
    r = await http.delete("/v2/auth/providers/github-oauth", headers=H)
    assert r.status == 204
    r = await http.get("/v2/auth/providers/github-oauth", headers=H)
    assert r.status == 404


async def test_authenticate_wait_callback_flow(http):
    r = await http.post("/v2/auth/providers", json=PROVIDER, headers=H)
    assert r.status == 201
    request = {"provider": "github-oauth", "scopes": ["repo", "read:user"], "user_id": "u1"}
    r = await http.post("/v2/auth/authenticate", json={**request, "provider": "nope"}, headers=H)
    assert r.status == 404
    r = await http.post("/v2/auth/authenticate", json={"provider": "github-oauth"}, headers=H)
    assert r.status == 422

    r = await http.post("/v2/auth/authenticate", json=request, headers=H)
    assert r.status == 200
    started = await r.json()
    assert started["status"] == "pending" and started["token"] is None
    auth_id = started["auth_id"]
    query = parse_qs(urlsplit(started["url"]).query)
    assert started["url"].startswith(PROVIDER["auth_url"] + "?")
    assert query["client_id"] == ["client-123"]
    assert query["redirect_uri"][0].endswith("/v2/auth/callback/github-oauth")
    state = query["state"][0]

    r = await http.get(f"/v2/auth/wait/{auth_id}?timeout=0", headers=H)
    assert (await r.json())["status"] == "pending"
    r = await http.get(f"/v2/auth/wait/{auth_id}?timeout=0", headers=HB)
    assert r.status == 404
    r = await http.get(f"/v2/auth/wait/{auth_id}?timeout=9999", headers=H)
    assert r.status == 422

    # The callback is what the provider's browser redirect reaches: no API key.
    r = await http.post("/v2/auth/callback/github-oauth", json={"code": "c", "state": "wrong"})
    assert r.status == 404
    r = await http.post("/v2/auth/callback/github-oauth", json={"code": "c"})
    assert r.status == 422
    r = await http.get(f"/v2/auth/callback/github-oauth?code=abc&state={state}")
    assert r.status == 200
    assert await r.json() == {"status": "completed", "auth_id": auth_id}
    r = await http.get(f"/v2/auth/callback/github-oauth?code=abc&state={state}")
    assert r.status == 404  # single use

    r = await http.get(f"/v2/auth/wait/{auth_id}?timeout=2", headers=H)
    done = await r.json()
    assert done["status"] == "completed" and done["token"]

    r = await http.post("/v2/auth/authenticate", json={**request, "scopes": ["repo"]}, headers=H)
    again = await r.json()
    assert again == {"status": "completed", "url": None, "auth_id": auth_id, "token": done["token"]}
    r = await http.post("/v2/auth/authenticate", json={**request, "force_new": True}, headers=H)
    assert (await r.json())["status"] == "pending"
    r = await http.post(
        "/v2/auth/authenticate", json={**request, "user_id": "u2", "check_only": True}, headers=H
    )
    assert (await r.json())["status"] == "connection_required"


async def test_github_integrations_from_configuration(http):
    r = await http.get("/v1/integrations/github/install", headers=H)
    assert r.status == 200
    body = await r.json()
    assert body["url"] == "https://github.example/apps/test/installations/new"
    assert [i["id"] for i in body["installations"]] == ["int-shared"]
    r = await http.get("/api-host/v1/integrations/github/install", headers=HB)
    assert [i["id"] for i in (await r.json())["installations"]] == ["int-shared", "int-b-only"]

    r = await http.get("/v1/integrations/github/int-shared/repos", headers=H)
    assert r.status == 200
    repos = await r.json()
    assert repos[0]["full_name"] == "acme/agent"
    assert repos[0]["url"] == "https://github.com/acme/agent"
    r = await http.get("/v1/integrations/github/int-b-only/repos", headers=H)
    assert r.status == 404
    r = await http.get("/v1/integrations/github/int-b-only/repos", headers=HB)
    assert (await r.json())[0]["default_branch"] == "dev"
    r = await http.get("/v1/integrations/github/int-shared/repos")
    assert r.status == 401
