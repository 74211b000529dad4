"""Regression tests for review findings: hostile input (non-finite numbers, lone surrogates,
non-UTF-8 keys), revision order across processes, redeploy, body types, integrations."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from gateway.client import ControlPlaneClient, run_quickstart
from gateway.upstreams.control_plane.http_helpers import READ
from gateway.upstreams.control_plane.models import CallbackRequest
from gateway.upstreams.control_plane.storage import ControlPlaneStore
from gateway.upstreams.http_api.problems import InvalidRequest

from .support import (
    KEY_A,
    KEY_B,
    TENANT_A,
    TENANT_B,
    FakeClock,
    deployment_body,
    headers,
    make_config,
    running_control_plane,
    sha,
)
from .test_deployments_http import wait_status

H = headers()
HB = headers(KEY_B, TENANT_B)
JSON_H = {**H, "Content-Type": "application/json"}
LISTENER = {"compute_type": "k8s", "compute_id": "c1", "compute_config": {"k8s_namespaces": []}}
PROVIDER = {
    "provider_id": "gh",
    "name": "GitHub",
    "client_id": "cid",
    "auth_url": "https://github.example/authorize",
    "token_url": "https://github.example/token",
}


def raw_json(template: Any, marker: str, replacement: str) -> bytes:
    """``template`` as JSON with the quoted string ``marker`` replaced by raw JSON text."""
    return json.dumps(template).replace(json.dumps(marker), replacement).encode()


async def assert_422(response: Any, *names: str) -> str:
    text = await response.text()
    assert response.status == 422, text
    assert response.content_type == "application/json"
    detail = json.loads(text)["detail"]
    for name in names:
        assert name in detail, detail
    return detail


# ---- 1. non-finite numbers ---------------------------------------------------------------


@pytest.mark.parametrize("number", ["1e400", "-1e400", "NaN", "Infinity", "-Infinity"])
async def test_non_finite_numbers_are_422(http, number):
    body = deployment_body()
    body["source_config"]["resource_spec"] = {"cpu": "@NUM@"}
    r = await http.post("/v2/deployments", data=raw_json(body, "@NUM@", number), headers=JSON_H)
    detail = await assert_422(r, "resource_spec", "cpu")
    assert "finite" in detail
    r = await http.get("/v2/deployments", headers=H)
    assert (await r.json())["resources"] == []


async def test_non_finite_number_in_a_patch_and_a_list_is_422(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    dep_id = (await r.json())["id"]
    body = {"source_config": {"listener_config": {"limits": [1, "@NUM@"]}}}
    r = await http.patch(
        f"/v2/deployments/{dep_id}", data=raw_json(body, "@NUM@", "1e999"), headers=JSON_H
    )
    await assert_422(r, "listener_config.limits[1]")
    r = await http.get(f"/v2/deployments/{dep_id}", headers=H)
    assert "Infinity" not in await r.text()


# ---- 2. lone surrogates ------------------------------------------------------------------

SURROGATE = '"bad\\ud800name"'


async def test_lone_surrogate_in_deployment_name_is_422(http):
    body = deployment_body(name="@S@")
    r = await http.post("/v2/deployments", data=raw_json(body, "@S@", SURROGATE), headers=JSON_H)
    await assert_422(r, "name", "UTF-8")


async def test_lone_surrogate_in_nested_values_and_keys_is_422(http):
    body = deployment_body()
    body["source_config"]["resource_spec"] = {"@S@": 1}
    r = await http.post("/v2/deployments", data=raw_json(body, "@S@", SURROGATE), headers=JSON_H)
    await assert_422(r, "resource_spec", "UTF-8")
    body = deployment_body()
    body["secrets"] = [{"name": "TOKEN", "value": "@S@"}]
    r = await http.post("/v2/deployments", data=raw_json(body, "@S@", SURROGATE), headers=JSON_H)
    detail = await assert_422(r, "secrets[0].value")
    assert "bad" not in detail  # the (secret) value itself is never echoed


async def test_lone_surrogate_in_listener_provider_and_auth_fields_is_422(http):
    r = await http.post(
        "/v2/listeners",
        data=raw_json({**LISTENER, "compute_id": "@S@"}, "@S@", SURROGATE),
        headers=JSON_H,
    )
    await assert_422(r, "compute_id")
    r = await http.post(
        "/v2/auth/providers",
        data=raw_json({**PROVIDER, "name": "@S@"}, "@S@", SURROGATE),
        headers=JSON_H,
    )
    await assert_422(r, "name")
    r = await http.post(
        "/v2/auth/authenticate",
        data=raw_json({"provider": "@S@", "scopes": []}, "@S@", SURROGATE),
        headers=JSON_H,
    )
    await assert_422(r, "provider")
    r = await http.post(
        "/v2/auth/callback/gh",
        data=raw_json({"code": "c", "state": "@S@"}, "@S@", SURROGATE),
        headers={"Content-Type": "application/json"},
    )
    await assert_422(r, "state")


def test_the_callback_model_refuses_lone_surrogates():
    with pytest.raises(InvalidRequest, match=r"^state: .*surrogate"):
        READ.json(CallbackRequest, {"code": "c", "state": "x\ud800"})


# ---- 3. non-UTF-8 API keys ---------------------------------------------------------------


async def raw_get(url: str, header_lines: list[bytes]) -> tuple[int, Any]:
    """A GET with header bytes sent exactly as given; returns status and JSON body."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        request = b"GET /v2/deployments HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
        request += b"".join(line + b"\r\n" for line in header_lines) + b"\r\n"
        writer.write(request)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"application/json" in head.lower(), raw
    return status, json.loads(body)


async def test_non_utf8_api_key_is_401(control_plane_url):
    tenant = b"X-Tenant-Id: " + TENANT_A.encode()
    status, body = await raw_get(control_plane_url, [b"X-Api-Key: \xff\xfe\xfd", tenant])
    assert status == 401, body
    assert body == {"detail": "Invalid API key."}
    status, _ = await raw_get(control_plane_url, [b"X-Api-Key: " + KEY_A.encode(), tenant])
    assert status == 200


async def test_api_key_length_counts_bytes(tmp_path):
    long_key = "\u00e9" * 300  # 300 characters, 600 UTF-8 bytes: over the 512-byte limit
    config = make_config(
        tmp_path / "data",
        credentials=[{"api_key_sha256": sha(long_key), "tenant_ids": [TENANT_A]}],
    )
    async with running_control_plane(config) as cp:
        status, body = await raw_get(
            cp.url,
            [b"X-Api-Key: " + long_key.encode(), b"X-Tenant-Id: " + TENANT_A.encode()],
        )
    assert status == 401, body


# ---- 4. revision order follows commit order ----------------------------------------------


class _Stamp(float):
    """A time that is also a clock returning it (the store takes either shape)."""

    def __call__(self) -> float:
        return float(self)


async def test_revision_list_follows_commit_order_across_processes(tmp_path):
    """Another process (a second connection to the file) commits a revision while this one
    waits for the write lock with its PATCH: the PATCH committed last, so it is first."""
    clock = FakeClock(1000.0)
    config = make_config(tmp_path / "data", step=3600)
    async with running_control_plane(config, clock=clock) as cp:
        async with aiohttp.ClientSession(cp.url) as http:
            r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
            dep_id = (await r.json())["id"]
            other = ControlPlaneStore(config.database_path)
            try:
                other._conn.execute("BEGIN IMMEDIATE")  # the other process holds the lock
                mine = asyncio.create_task(
                    http.patch(
                        f"/v2/deployments/{dep_id}",
                        json={"source_revision_config": {"repo_ref": "mine"}},
                        headers=H,
                    )
                )
                await asyncio.sleep(0.3)  # this PATCH is now waiting for the lock
                clock.now = 2000.0
                other.patch_deployment(
                    TENANT_A,
                    dep_id,
                    {"source_revision_config": {"repo_ref": "theirs"}},
                    _Stamp(2000.0),
                )
                other._conn.execute("COMMIT")
                r = await mine
                assert r.status == 200, await r.text()
                mine_id = (await r.json())["latest_revision_id"]
            finally:
                if other._conn.in_transaction:
                    other._conn.execute("ROLLBACK")
                other.close()
            r = await http.get(f"/v2/deployments/{dep_id}/revisions", headers=H)
            revisions = (await r.json())["resources"]
    assert revisions[0]["id"] == mine_id
    assert revisions[0]["status"] == "CREATING"
    assert revisions[0]["source_revision_config"]["repo_ref"] == "mine"
    assert revisions[1]["status"] == "INTERRUPTED"
    stamps = [rev["created_at"] for rev in revisions]
    assert stamps == sorted(stamps, reverse=True)


class _MisleadingListClient(ControlPlaneClient):
    """A revision list whose first entry is not the PATCH's new revision (as after a race)."""

    async def list_revisions(
        self, deployment_id: str, *, limit: int = 20, offset: int = 0
    ) -> dict[str, Any]:
        page = await super().list_revisions(deployment_id, limit=limit, offset=offset)
        page["resources"] = list(reversed(page["resources"]))
        return page


class _PatchWithoutLatestClient(ControlPlaneClient):
    async def update_deployment(self, deployment_id: str, body: Any) -> dict[str, Any]:
        patched = await super().update_deployment(deployment_id, body)
        patched.pop("latest_revision_id")
        return patched


@pytest.mark.parametrize(
    ("client_class", "expect_list"),
    [(_MisleadingListClient, False), (_PatchWithoutLatestClient, True)],
)
async def test_quickstart_takes_the_new_revision_from_the_patch(
    control_plane_url, client_class, expect_list
):
    async with client_class(control_plane_url, KEY_A, TENANT_A) as client:
        result = await run_quickstart(
            client,
            deployment_body(),
            {"source_revision_config": {"repo_ref": "v2"}},
            poll_interval=0.02,
            timeout=60,
        )
    assert result.second_revision["id"] != result.first_revision["id"]
    assert result.second_revision["source_revision_config"]["repo_ref"] == "v2"


# ---- 5. redeploy updates the deployment --------------------------------------------------


async def test_redeploy_restores_the_past_configuration_on_the_deployment(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    created = await r.json()
    dep_id, first = created["id"], created["latest_revision_id"]
    assert (await wait_status(http, dep_id, first))[-1] == "DEPLOYED"
    r = await http.patch(
        f"/v2/deployments/{dep_id}",
        json={
            "source_revision_config": {"repo_ref": "v2"},
            "secrets": [{"name": "NEWER", "value": "x"}],
        },
        headers=H,
    )
    second = (await r.json())["latest_revision_id"]
    assert (await wait_status(http, dep_id, second))[-1] == "DEPLOYED"

    r = await http.post(f"/v2/deployments/{dep_id}/revisions/{first}/redeploy", headers=H)
    assert r.status == 200
    redeployed = await r.json()
    assert redeployed["source_revision_config"]["repo_ref"] == "main"
    assert redeployed["secrets"] == [{"name": "OPENAI_API_KEY"}]
    r = await http.get(f"/v2/deployments/{dep_id}", headers=H)
    assert (await r.json())["source_revision_config"]["repo_ref"] == "main"

    r = await http.patch(
        f"/v2/deployments/{dep_id}",
        json={"secrets": [{"name": "OPENAI_API_KEY", "value": "rotated"}]},
        headers=H,
    )
    latest = (await r.json())["latest_revision_id"]
    r = await http.get(f"/v2/deployments/{dep_id}/revisions/{latest}", headers=H)
    assert (await r.json())["source_revision_config"]["repo_ref"] == "main"


# ---- 6. wrong types are not silently treated as empty ------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("secrets", {}),
        ("secrets", ""),
        ("secrets", 0),
        ("source_config", 0),
        ("source_config", ""),
        ("source_config", []),
        ("source_revision_config", 0),
        ("source_revision_config", False),
    ],
)
async def test_wrongly_typed_falsy_parts_are_422(http, field, value):
    # external_docker needs no source_config, so only the wrong type can make this a 422.
    body: dict[str, Any] = {
        "name": "image",
        "source": "external_docker",
        "source_config": {},
        "source_revision_config": {"image_uri": "registry.example/a:1"},
        "secrets": [],
    }
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 201, await r.text()
    body[field] = value
    r = await http.post("/v2/deployments", json=body, headers=H)
    await assert_422(r, field, "expected")


async def test_null_parts_mean_absent(http):
    body = {
        "name": "image",
        "source": "external_docker",
        "source_config": None,
        "source_revision_config": {"image_uri": "registry.example/a:1"},
        "secrets": None,
    }
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 201, await r.text()
    assert (await r.json())["secrets"] == []


# ---- 7. integrations the tenant cannot see -----------------------------------------------


@pytest.mark.parametrize("integration_id", ["int-b-only", "int-does-not-exist"])
async def test_deployment_with_an_invisible_integration_is_422(http, integration_id):
    body = deployment_body()
    body["source_config"]["integration_id"] = integration_id
    r = await http.post("/v2/deployments", json=body, headers=H)
    detail = await assert_422(r, "source_config.integration_id", integration_id)
    assert "int-b-only" not in detail.replace(integration_id, "")
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    dep_id = (await r.json())["id"]
    r = await http.patch(
        f"/v2/deployments/{dep_id}",
        json={"source_config": {"integration_id": integration_id}},
        headers=H,
    )
    await assert_422(r, "source_config.integration_id")


async def test_details_for_other_tenant_and_unknown_integrations_are_alike(http):
    details = []
    for integration_id in ("int-b-only", "int-zzzzzzzz"):
        body = deployment_body()
        body["source_config"]["integration_id"] = integration_id
        r = await http.post("/v2/deployments", json=body, headers=H)
        details.append((await r.json())["detail"].replace(integration_id, "<id>"))
    assert details[0] == details[1]


async def test_visible_integration_is_accepted(http):
    body = deployment_body()
    body["source_config"]["integration_id"] = "int-b-only"
    r = await http.post("/v2/deployments", json=body, headers=HB)
    assert r.status == 201, await r.text()


async def test_without_configured_integrations_any_id_is_accepted(tmp_path):
    config = make_config(tmp_path / "data", integrations={})
    assert config.github_integrations == ()
    async with running_control_plane(config) as cp:
        body = deployment_body()
        body["source_config"]["integration_id"] = "anything-at-all"
        async with aiohttp.ClientSession(cp.url) as http:
            r = await http.post("/v2/deployments", json=body, headers=H)
            assert r.status == 201, await r.text()
