"""Deployments and revisions over raw HTTP: the quick-start, shapes and every status code."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from .support import (
    KEY_A,
    KEY_B,
    SECRET_VALUE,
    TENANT_A,
    TENANT_B,
    deployment_body,
    headers,
)

H = headers()


async def wait_status(http, deployment_id, revision_id, prefix="", h=H):
    """Poll a revision until it leaves the in-flight statuses; returns every status seen."""
    seen: list[str] = []
    for _ in range(2000):
        r = await http.get(
            f"{prefix}/v2/deployments/{deployment_id}/revisions/{revision_id}", headers=h
        )
        assert r.status == 200, await r.text()
        status = (await r.json())["status"]
        if not seen or seen[-1] != status:
            seen.append(status)
        if status == "DEPLOYED" or "FAILED" in status or status == "INTERRUPTED":
            return seen
        await asyncio.sleep(0.01)
    raise AssertionError(f"revision stuck: {seen}")


@pytest.mark.parametrize("prefix", ["", "/api-host"])
async def test_quickstart_over_raw_http(http, prefix):
    r = await http.post(f"{prefix}/v2/deployments", json=deployment_body(), headers=H)
    assert r.status == 201, await r.text()
    created = await r.json()
    assert created["latest_revision_id"]
    assert created["status"] == "AWAITING_DATABASE"
    assert created["active_revision_id"] is None
    assert created["tenant_id"] == TENANT_A
    for key in ("id", "created_at", "updated_at", "name", "source_config", "secrets"):
        assert key in created
    dep_id, first = created["id"], created["latest_revision_id"]

    r = await http.get(f"{prefix}/v2/deployments/{dep_id}", headers=H)
    assert r.status == 200
    assert (await r.json())["latest_revision_id"] == first

    seen = await wait_status(http, dep_id, first, prefix)
    assert seen[-1] == "DEPLOYED"
    order = [
        "CREATING",
        "QUEUED",
        "AWAITING_BUILD",
        "BUILDING",
        "AWAITING_DEPLOY",
        "DEPLOYING",
        "DEPLOYED",
    ]
    assert [order.index(s) for s in seen] == sorted(order.index(s) for s in seen)

    r = await http.get(f"{prefix}/v2/deployments/{dep_id}", headers=H)
    dep = await r.json()
    assert dep["status"] == "READY"
    assert dep["active_revision_id"] == first

    r = await http.patch(
        f"{prefix}/v2/deployments/{dep_id}",
        json={"source_revision_config": {"repo_ref": "release"}},
        headers=H,
    )
    assert r.status == 200
    patched = await r.json()
    second = patched["latest_revision_id"]
    assert second != first
    assert patched["source_revision_config"]["repo_ref"] == "release"

    r = await http.get(f"{prefix}/v2/deployments/{dep_id}/revisions", headers=H)
    assert r.status == 200
    listing = await r.json()
    assert [rev["id"] for rev in listing["resources"]] == [second, first]
    assert listing["offset"] == 2

    assert (await wait_status(http, dep_id, second, prefix))[-1] == "DEPLOYED"
    r = await http.get(f"{prefix}/v2/deployments/{dep_id}", headers=H)
    assert (await r.json())["active_revision_id"] == second

    r = await http.delete(f"{prefix}/v2/deployments/{dep_id}", headers=H)
    assert r.status == 204
    assert await r.read() == b""
    r = await http.get(f"{prefix}/v2/deployments/{dep_id}", headers=H)
    assert r.status == 404
    assert await r.json() == {"detail": f"Deployment ID {dep_id} not found."}


async def test_patch_with_only_source_config_makes_no_revision(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    created = await r.json()
    r = await http.patch(
        f"/v2/deployments/{created['id']}",
        json={"source_config": {"build_on_push": False}},
        headers=H,
    )
    assert r.status == 200
    patched = await r.json()
    assert patched["source_config"]["build_on_push"] is False
    assert patched["source_config"]["repo_url"] == "https://github.com/acme/agent"
    assert patched["latest_revision_id"] == created["latest_revision_id"]
    r = await http.get(f"/v2/deployments/{created['id']}/revisions", headers=H)
    assert len((await r.json())["resources"]) == 1


async def test_patch_with_secrets_makes_a_revision_and_keeps_names_only(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    created = await r.json()
    r = await http.patch(
        f"/v2/deployments/{created['id']}",
        json={"secrets": [{"name": "ANTHROPIC_API_KEY", "value": SECRET_VALUE + "-2"}]},
        headers=H,
    )
    patched = await r.json()
    assert patched["secrets"] == [{"name": "ANTHROPIC_API_KEY"}]
    assert patched["latest_revision_id"] != created["latest_revision_id"]


async def test_secrets_never_in_responses_or_logs(http, caplog):
    caplog.set_level(logging.DEBUG)
    texts: list[str] = []

    async def keep(r):
        texts.append(await r.text())
        return r

    r = await keep(await http.post("/v2/deployments", json=deployment_body(), headers=H))
    created = json.loads(texts[-1])
    assert created["secrets"] == [{"name": "OPENAI_API_KEY"}]
    dep_id = created["id"]
    await keep(
        await http.patch(
            f"/v2/deployments/{dep_id}",
            json={
                "secrets": [{"name": "OPENAI_API_KEY", "value": SECRET_VALUE}],
                "source_revision_config": {"repo_ref": "v2"},
            },
            headers=H,
        )
    )
    await wait_status(http, dep_id, json.loads(texts[-1])["latest_revision_id"])
    await keep(await http.get(f"/v2/deployments/{dep_id}", headers=H))
    await keep(await http.get("/v2/deployments", headers=H))
    r = await keep(await http.get(f"/v2/deployments/{dep_id}/revisions", headers=H))
    for rev in json.loads(texts[-1])["resources"]:
        await keep(await http.get(f"/v2/deployments/{dep_id}/revisions/{rev['id']}", headers=H))
    # Error paths must not echo the body either.
    bad = deployment_body()
    bad["secrets"] = [{"name": "1BAD", "value": SECRET_VALUE}]
    r = await keep(await http.post("/v2/deployments", json=bad, headers=H))
    assert r.status == 422
    bad["secrets"] = [{"name": "OK", "value": SECRET_VALUE, "extra": SECRET_VALUE}]
    r = await keep(await http.post("/v2/deployments", json=bad, headers=H))
    assert r.status == 422
    await keep(await http.delete(f"/v2/deployments/{dep_id}", headers=H))
    assert len(texts) >= 8
    for text in texts:
        assert SECRET_VALUE not in text
    assert SECRET_VALUE not in caplog.text
    assert KEY_A not in caplog.text
    assert "deployment created" in caplog.text  # logging did run


async def test_auth_status_codes(http):
    r = await http.get("/v2/deployments")
    assert r.status == 401
    assert (await r.json())["detail"]
    r = await http.get("/v2/deployments", headers={"X-Api-Key": "wrong", "X-Tenant-Id": TENANT_A})
    assert r.status == 401
    r = await http.get(
        "/v2/deployments", headers={"X-Api-Key": "x" * 5000, "X-Tenant-Id": TENANT_A}
    )
    assert r.status == 401
    r = await http.get("/v2/deployments", headers={"X-Api-Key": KEY_A})
    assert r.status == 403
    r = await http.get("/v2/deployments", headers=headers(KEY_A, TENANT_B))
    assert r.status == 403
    assert r.content_type == "application/json"
    r = await http.get("/v2/deployments", headers=headers(KEY_A, "bad tenant!"))
    assert r.status == 403
    r = await http.get("/api-host/v2/listeners", headers=headers(KEY_B, TENANT_A))
    assert r.status == 403


async def test_other_tenants_resources_are_404(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    created = await r.json()
    dep_id, rev_id = created["id"], created["latest_revision_id"]
    hb = headers(KEY_B, TENANT_B)
    for method, path, body in [
        ("GET", f"/v2/deployments/{dep_id}", None),
        ("PATCH", f"/v2/deployments/{dep_id}", {"source_config": {"build_on_push": False}}),
        ("DELETE", f"/v2/deployments/{dep_id}", None),
        ("GET", f"/v2/deployments/{dep_id}/revisions", None),
        ("GET", f"/v2/deployments/{dep_id}/revisions/{rev_id}", None),
        ("POST", f"/v2/deployments/{dep_id}/revisions/{rev_id}/redeploy", None),
    ]:
        r = await http.request(method, path, json=body, headers=hb)
        assert r.status == 404, (method, path)
        assert await r.json() == {"detail": f"Deployment ID {dep_id} not found."}
    r = await http.get("/v2/deployments", headers=hb)
    assert (await r.json())["resources"] == []
    r = await http.get(f"/v2/deployments/{dep_id}", headers=H)
    assert r.status == 200
    r = await http.get(f"/v2/deployments/{dep_id}/revisions/nope", headers=H)
    assert r.status == 404
    assert await r.json() == {"detail": "Revision ID nope not found."}


@pytest.mark.parametrize(
    "mutate",
    [
        lambda b: b.pop("name"),
        lambda b: b.update(name=""),
        lambda b: b.update(name=7),
        lambda b: b.update(source="gitlab"),
        lambda b: b.update(unknown_field=1),
        lambda b: b["source_config"].update(deployment_type="huge"),
        lambda b: b["source_config"].update(build_on_push="yes"),
        lambda b: b["source_config"].pop("repo_url"),
        lambda b: b["source_revision_config"].pop("langgraph_config_path"),
        lambda b: b["source_revision_config"].update(graph_config_path="other.json"),
        lambda b: b.update(secrets={"A": "b"}),
        lambda b: b.update(secrets=[{"name": "A", "value": 1}]),
        lambda b: b.update(source_config=[]),
    ],
)
async def test_invalid_create_bodies_are_422(http, mutate):
    body = deployment_body()
    mutate(body)
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 422, await r.text()
    assert isinstance((await r.json())["detail"], str)


async def test_a_secret_named_twice_is_one_secret(http):
    body = deployment_body()
    body["secrets"] = [
        {"name": "A", "value": "1"},
        {"name": "B", "value": "2"},
        {"name": "A", "value": "3"},
    ]
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 201, await r.text()
    assert (await r.json())["secrets"] == [{"name": "A"}, {"name": "B"}]


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 50000])
async def test_malformed_bodies_are_422(http, raw):
    r = await http.post(
        "/v2/deployments", data=raw, headers={**H, "Content-Type": "application/json"}
    )
    assert r.status == 422
    assert "detail" in await r.json()


async def test_invalid_patch_and_query_params_are_422(http):
    r = await http.post("/v2/deployments", json=deployment_body(), headers=H)
    dep_id = (await r.json())["id"]
    for body in [
        {"name": "renamed"},
        {"source_config": {"repo_url": 5}},
        {"source_revision_config": {"langgraph_config_path": None}},
        {"secrets": "x"},
    ]:
        r = await http.patch(f"/v2/deployments/{dep_id}", json=body, headers=H)
        assert r.status == 422, body
    for query in ["limit=0", "limit=101", "limit=abc", "offset=-1"]:
        r = await http.get(f"/v2/deployments?{query}", headers=H)
        assert r.status == 422, query
        r = await http.get(f"/v2/deployments/{dep_id}/revisions?{query}", headers=H)
        assert r.status == 422, query


async def test_oversized_body_unknown_route_and_method_are_json(http):
    r = await http.post(
        "/v2/deployments",
        data=b'{"name": "' + b"x" * 70000 + b'"}',
        headers={**H, "Content-Type": "application/json"},
    )
    assert r.status == 413
    assert "detail" in await r.json()
    r = await http.get("/v2/nothing-here", headers=H)
    assert r.status == 404
    assert await r.json() == {"detail": "Not Found"}
    r = await http.put("/v2/deployments", headers=H)
    assert r.status == 405
    assert "detail" in await r.json()


async def test_list_pagination_and_name_filter(http):
    for name in ["alpha-api", "beta-worker", "Gamma-API"]:
        r = await http.post("/v2/deployments", json=deployment_body(name), headers=H)
        assert r.status == 201
    r = await http.get("/v2/deployments?limit=2", headers=H)
    page1 = await r.json()
    assert [d["name"] for d in page1["resources"]] == ["Gamma-API", "beta-worker"]
    assert page1["offset"] == 2
    r = await http.get("/v2/deployments?limit=2&offset=2", headers=H)
    page2 = await r.json()
    assert [d["name"] for d in page2["resources"]] == ["alpha-api"]
    assert page2["offset"] == 3
    r = await http.get("/v2/deployments?name_contains=api", headers=H)
    assert sorted(d["name"] for d in (await r.json())["resources"]) == ["Gamma-API", "alpha-api"]
    r = await http.get("/v2/deployments", headers=H)
    assert len((await r.json())["resources"]) == 3


async def test_graph_config_path_is_an_alias(http):
    body = deployment_body()
    body["source_revision_config"].pop("langgraph_config_path")
    body["source_revision_config"]["graph_config_path"] = "graphs/agent.json"
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 201
    config = (await r.json())["source_revision_config"]
    assert config["langgraph_config_path"] == "graphs/agent.json"
    assert config["graph_config_path"] == "graphs/agent.json"


async def test_external_docker_source(http):
    body = {
        "name": "image-based",
        "source": "external_docker",
        "source_revision_config": {"image_uri": "registry.example/agent:1.2"},
    }
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 201, await r.text()
    created = await r.json()
    seen = await wait_status(http, created["id"], created["latest_revision_id"])
    assert seen[-1] == "DEPLOYED"
    body["source_revision_config"] = {}
    r = await http.post("/v2/deployments", json=body, headers=H)
    assert r.status == 422
