"""The control plane's bounds on what one tenant may store and read back (limits.py):
free-form JSON field sizes (422), quotas per tenant (409; 429 for pending auth flows),
revision retention per deployment, list answers bounded in bytes (422), all on both
backends (conftest.py runs each test on SQLite and on PostgreSQL); and no raw API key in
any log line, at DEBUG too, for a request aiohttp's parser refuses.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest
from aiohttp import web

from gateway.upstreams.control_plane import ControlPlaneConfig, create_control_plane_app
from gateway.upstreams.control_plane.storage import ControlPlaneStore
from gateway.upstreams.http_api.log_safety import exception_summary
from gateway.upstreams.http_api.parse_budget import ParseBudget, ParseShare
from gateway.upstreams.http_api.serving import ApiAppRunner, runner_for

from . import support
from .support import (
    KEY_A,
    KEY_B,
    TENANT_B,
    deployment_body,
    headers,
    make_config,
    running_control_plane,
)
from .test_deployments_http import wait_status

H = headers()
HB = headers(KEY_B, TENANT_B)
PROVIDER = {
    "name": "GitHub",
    "client_id": "cid",
    "auth_url": "https://github.example/authorize",
    "token_url": "https://github.example/token",
}


@asynccontextmanager
async def served(tmp_path: Path, **section: Any) -> AsyncIterator[aiohttp.ClientSession]:
    """A control plane with ``section``'s settings and a session on it."""
    config = make_config(tmp_path / "data", **section)
    # Bodies that take long to parse, back to back from one address: more than the parse
    # budget lets one address take (tests/integration/test_body_parse_fairness.py).
    unbounded = ParseBudget(ParseShare(per_address=1.0, total=1.0, burst_seconds=3600.0))
    async with (
        running_control_plane(config, parse_budget=unbounded) as running,
        aiohttp.ClientSession(running.url) as http,
    ):
        yield http


async def status_and_detail(response: aiohttp.ClientResponse) -> tuple[int, str]:
    body = await response.json()
    return response.status, body.get("detail", "") if isinstance(body, dict) else ""


def spec_of(size: int) -> dict[str, Any]:
    """A resource_spec of exactly ``size`` bytes of compact JSON (at least 10)."""
    return {"a": "x" * (size - len('{"a":""}'))}


# ---- 1. free-form JSON fields --------------------------------------------------------------


async def test_an_oversize_resource_spec_is_refused_with_the_field_and_the_bound(
    tmp_path: Path,
) -> None:
    # The default bound (64 KiB) with a body limit that lets much more through, as the
    # shipped default of 1 MiB does: the repro's shape, a long array of empty arrays.
    async with served(tmp_path, max_body_bytes=1 << 20) as http:
        body = deployment_body()
        body["source_config"]["resource_spec"] = {"a": [[]] * 30000}
        async with http.post("/v2/deployments", json=body, headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 422, detail
        assert detail.startswith("source_config.resource_spec: must be at most 65536 bytes")
        assert "max_json_field_bytes" in detail

        # Exactly the bound is accepted; one byte more is not.
        body["source_config"]["resource_spec"] = spec_of(65536)
        async with http.post("/v2/deployments", json=body, headers=H) as r:
            assert r.status == 201, await r.text()
            created = await r.json()
        assert created["source_config"]["resource_spec"] == spec_of(65536)
        body["source_config"]["resource_spec"] = spec_of(65537)
        async with http.post("/v2/deployments", json=body, headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 422 and "source_config.resource_spec" in detail, detail


async def test_an_oversize_listener_config_is_refused_on_patch_too(tmp_path: Path) -> None:
    async with served(tmp_path, max_json_field_bytes=1024) as http:
        async with http.post("/v2/deployments", json=deployment_body(), headers=H) as r:
            assert r.status == 201
            deployment = await r.json()
        one = f"/v2/deployments/{deployment['id']}"
        patch = {"source_config": {"listener_config": spec_of(1025)}}
        async with http.patch(one, json=patch, headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 422, detail
        assert detail.startswith("source_config.listener_config: must be at most 1024 bytes")
        # Nothing was stored, and no revision made.
        async with http.get(one, headers=H) as r:
            assert (await r.json())["source_config"].get("listener_config") is None
        async with http.get(one + "/revisions", headers=H) as r:
            assert len((await r.json())["resources"]) == 1
        # Multi-byte text counts in UTF-8 bytes: 400 "é" are 800 bytes, 600 are 1200.
        for text, expected in (("é" * 400, 200), ("é" * 600, 422)):
            patch = {"source_config": {"resource_spec": {"t": text}}}
            async with http.patch(one, json=patch, headers=H) as r:
                assert r.status == expected, await r.text()


# ---- 2. quotas per tenant --------------------------------------------------------------------


async def test_the_deployment_quota_is_409_and_per_tenant(tmp_path: Path) -> None:
    async with served(tmp_path, max_deployments_per_tenant=2) as http:
        ids = []
        for n in range(2):
            async with http.post("/v2/deployments", json=deployment_body(f"d{n}"), headers=H) as r:
                assert r.status == 201
                ids.append((await r.json())["id"])
        async with http.post("/v2/deployments", json=deployment_body("d2"), headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 409, detail
        assert "max_deployments_per_tenant" in detail and "delete a deployment" in detail
        # Another tenant has its own quota.
        async with http.post("/v2/deployments", json=deployment_body("b"), headers=HB) as r:
            assert r.status == 201
        # Deleting one makes room.
        async with http.delete(f"/v2/deployments/{ids[0]}", headers=H) as r:
            assert r.status == 204
        async with http.post("/v2/deployments", json=deployment_body("d3"), headers=H) as r:
            assert r.status == 201


async def test_parallel_creates_on_two_instances_never_exceed_the_quota(tmp_path: Path) -> None:
    """Two control planes on one database (one SQLite file, or one PostgreSQL database),
    each with its own database thread: 24 creates at once, split between them."""
    config = make_config(tmp_path / "data", max_deployments_per_tenant=5)
    async with (
        running_control_plane(config) as one,
        running_control_plane(config) as two,
        aiohttp.ClientSession() as http,
    ):

        async def create(n: int) -> int:
            url = (one if n % 2 else two).url + "/v2/deployments"
            async with http.post(url, json=deployment_body(f"p{n}"), headers=H) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(create(n) for n in range(24)))
        assert sorted(statuses) == [201] * 5 + [409] * 19
        async with http.get(one.url + "/v2/deployments?limit=100", headers=H) as r:
            assert len((await r.json())["resources"]) == 5


async def test_parallel_listener_creates_never_exceed_the_quota(tmp_path: Path) -> None:
    async with served(tmp_path, max_listeners_per_tenant=3) as http:

        async def create(n: int) -> int:
            body = {"compute_type": "k8s", "compute_id": f"c{n}", "compute_config": {}}
            async with http.post("/v2/listeners", json=body, headers=H) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(create(n) for n in range(12)))
        assert sorted(statuses) == [201] * 3 + [409] * 9
        body = {"compute_type": "k8s", "compute_id": "more", "compute_config": {}}
        async with http.post("/v2/listeners", json=body, headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 409 and "max_listeners_per_tenant" in detail, detail


async def test_the_auth_provider_quota_is_409(tmp_path: Path) -> None:
    async with served(tmp_path, max_auth_providers_per_tenant=2) as http:
        for n in range(2):
            body = {**PROVIDER, "provider_id": f"p{n}"}
            async with http.post("/v2/auth/providers", json=body, headers=H) as r:
                assert r.status == 201
        body = {**PROVIDER, "provider_id": "p2"}
        async with http.post("/v2/auth/providers", json=body, headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 409 and "max_auth_providers_per_tenant" in detail, detail
        async with http.post("/v2/auth/providers", json=body, headers=HB) as r:
            assert r.status == 201


async def _authenticate(http: aiohttp.ClientSession, user: str, **more: Any) -> Any:
    body = {"provider": "p0", "scopes": ["repo"], "user_id": user, **more}
    async with http.post("/v2/auth/authenticate", json=body, headers=H) as r:
        return r.status, r.headers.get("Retry-After"), await r.json()


async def test_the_pending_auth_flow_quota_is_429_with_retry_after(tmp_path: Path) -> None:
    async with served(tmp_path, max_pending_auth_flows_per_tenant=2) as http:
        async with http.post(
            "/v2/auth/providers", json={**PROVIDER, "provider_id": "p0"}, headers=H
        ) as r:
            assert r.status == 201
        pending = []
        for n in range(2):
            status, _, answer = await _authenticate(http, f"u{n}")
            assert status == 200 and answer["status"] == "pending"
            pending.append(answer)
        status, retry, answer = await _authenticate(http, "u2")
        assert status == 429, answer
        assert "max_pending_auth_flows_per_tenant" in answer["detail"]
        assert retry is not None and 1 <= int(retry) <= 600
        # Completing a flow frees its place.
        state = parse_qs(urlsplit(pending[0]["url"]).query)["state"][0]
        async with http.get(f"/v2/auth/callback/p0?code=c&state={state}") as r:
            assert r.status == 200
        status, _, answer = await _authenticate(http, "u2")
        assert status == 200 and answer["status"] == "pending"


async def test_completed_auth_flows_are_kept_up_to_the_retention(tmp_path: Path) -> None:
    async with served(tmp_path, max_completed_auth_flows_per_tenant=2) as http:
        async with http.post(
            "/v2/auth/providers", json={**PROVIDER, "provider_id": "p0"}, headers=H
        ) as r:
            assert r.status == 201
        for user in ("u0", "u1", "u2"):
            _, _, answer = await _authenticate(http, user)
            state = parse_qs(urlsplit(answer["url"]).query)["state"][0]
            async with http.get(f"/v2/auth/callback/p0?code=c&state={state}") as r:
                assert r.status == 200
        # The oldest completed flow was forgotten; the newest two still answer.
        statuses = [
            (await _authenticate(http, u, check_only=True))[2]["status"] for u in ("u0", "u1", "u2")
        ]
        assert statuses == ["connection_required", "completed", "completed"]


# ---- revisions per deployment ----------------------------------------------------------------


async def test_old_revisions_are_pruned_but_never_the_active_one(tmp_path: Path) -> None:
    async with served(tmp_path, max_revisions_per_deployment=3) as http:
        async with http.post("/v2/deployments", json=deployment_body(), headers=H) as r:
            created = await r.json()
        one = f"/v2/deployments/{created['id']}"
        first = created["latest_revision_id"]
        assert (await wait_status(http, created["id"], first))[-1] == "DEPLOYED"
        for n in range(6):
            patch = {"source_revision_config": {"repo_ref": f"r{n}"}}
            async with http.patch(one, json=patch, headers=H) as r:
                assert r.status == 200
                latest = (await r.json())["latest_revision_id"]
        async with http.get(one + "/revisions?limit=100", headers=H) as r:
            revisions = (await r.json())["resources"]
        # The newest three, and the active (deployed) one, older than them.
        assert [rev["source_revision_config"]["repo_ref"] for rev in revisions] == [
            "r5",
            "r4",
            "r3",
            "main",
        ]
        assert revisions[0]["id"] == latest and revisions[-1]["id"] == first
        async with http.get(one, headers=H) as r:
            assert (await r.json())["active_revision_id"] == first
        # The active revision can still be redeployed; a pruned one is gone (404).
        async with http.post(f"{one}/revisions/{first}/redeploy", headers=H) as r:
            assert r.status == 200
            newest = (await r.json())["latest_revision_id"]
        assert (await wait_status(http, created["id"], newest))[-1] == "DEPLOYED"
        async with http.get(one + "/revisions?limit=100", headers=H) as r:
            revisions = (await r.json())["resources"]
        # Pruning happens when a revision is made: the one active then (first) was kept.
        assert [rev["id"] for rev in revisions][::3] == [newest, first]
        assert len(revisions) == 4 and revisions[0]["status"] == "DEPLOYED"
        async with http.patch(one, json={"secrets": []}, headers=H) as r:
            assert r.status == 200
        async with http.get(one + "/revisions?limit=100", headers=H) as r:
            revisions = (await r.json())["resources"]
        assert len(revisions) == 3 and revisions[1]["id"] == newest


# ---- 3. list answers bounded in bytes ---------------------------------------------------------


async def test_a_page_over_the_answer_bound_is_422_and_pages_are_exact(tmp_path: Path) -> None:
    async with served(
        tmp_path, max_json_field_bytes=16384, max_answer_bytes=65536, max_body_bytes=1 << 20
    ) as http:
        body = deployment_body()
        # Text that JSON escapes, and text it need not, copied as stored into list pages.
        spec = {"t": 'é☃𝄞"\\\u0001</script>' + "x" * 16000, "n": [1.5, None, True, {}]}
        body["source_config"]["resource_spec"] = spec
        async with http.post("/v2/deployments", json=body, headers=H) as r:
            assert r.status == 201, await r.text()
            created = await r.json()
        one = f"/v2/deployments/{created['id']}"
        for n in range(5):
            patch = {"source_revision_config": {"repo_ref": f"r{n}"}}
            async with http.patch(one, json=patch, headers=H) as r:
                assert r.status == 200
        async with http.get(one + "/revisions?limit=100", headers=H) as r:
            status, detail = await status_and_detail(r)
        assert status == 422, detail
        assert detail.startswith("limit: ") and "max_answer_bytes" in detail
        # A page that fits is answered; each entry reads exactly as the single resource.
        async with http.get(one + "/revisions?limit=3&offset=1", headers=H) as r:
            assert r.status == 200
            assert r.content_type == "application/json"
            page = await r.json()
        assert page["offset"] == 4 and len(page["resources"]) == 3
        for revision in page["resources"]:
            async with http.get(f"{one}/revisions/{revision['id']}", headers=H) as r:
                assert await r.json() == revision
            assert revision["source_config"]["resource_spec"] == spec
        async with http.get("/v2/deployments?limit=100", headers=H) as r:
            listed = (await r.json())["resources"]
        async with http.get(one, headers=H) as r:
            assert listed == [await r.json()]
        # name_contains pages the same way; an empty page is still a page.
        async with http.get("/v2/deployments?name_contains=AGENT", headers=H) as r:
            assert (await r.json())["resources"] == listed
        async with http.get("/v2/deployments?name_contains=none&offset=3", headers=H) as r:
            assert await r.json() == {"resources": [], "offset": 3}


async def test_one_resource_is_always_answered_whatever_its_size(tmp_path: Path) -> None:
    async with served(
        tmp_path, max_json_field_bytes=65536, max_answer_bytes=65536, max_body_bytes=1 << 20
    ) as http:
        body = deployment_body()
        body["source_config"]["resource_spec"] = spec_of(65536)
        body["source_config"]["listener_config"] = spec_of(65536)
        async with http.post("/v2/deployments", json=body, headers=H) as r:
            assert r.status == 201
        async with http.get("/v2/deployments?limit=1", headers=H) as r:
            assert r.status == 200
            assert len((await r.json())["resources"]) == 1


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("max_json_field_bytes", 10),
        ("max_answer_bytes", 1.5),
        ("max_deployments_per_tenant", 0),
        ("max_revisions_per_deployment", True),
        ("max_pending_auth_flows_per_tenant", "many"),
    ],
)
def test_a_bad_bound_stops_start_up_naming_the_setting(
    tmp_path: Path, key: str, value: Any
) -> None:
    with pytest.raises(ValueError, match=key):
        make_config(tmp_path, **{key: value})


def test_the_documented_defaults(tmp_path: Path) -> None:
    limits = ControlPlaneConfig.from_mapping({}, tmp_path, {}).limits
    assert (
        limits.max_json_field_bytes,
        limits.max_answer_bytes,
        limits.max_deployments_per_tenant,
        limits.max_revisions_per_deployment,
        limits.max_listeners_per_tenant,
        limits.max_auth_providers_per_tenant,
        limits.max_pending_auth_flows_per_tenant,
        limits.max_completed_auth_flows_per_tenant,
    ) == (65536, 8 << 20, 100, 50, 100, 100, 1000, 1000)
    # A store opened without a config (as tools and tests do) has the same bounds.
    store = ControlPlaneStore(tmp_path / "cp.sqlite3")
    try:
        assert store.limits == limits
    finally:
        store.close()


# ---- no raw key in the logs ------------------------------------------------------------------


async def test_a_malformed_request_never_logs_the_api_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """aiohttp's parser refuses a header value with a control character, and its error
    quotes the header line: served as the gateway serves it (``runner_for``), with every
    logger at DEBUG, neither the answer nor any log line holds the key."""
    config = make_config(tmp_path / "data")
    if support.DATABASE["url"] is not None:
        config = replace(config, database_url=support.DATABASE["url"])
    caplog.set_level(logging.DEBUG)
    runner = runner_for(create_control_plane_app(config), access_log=None)
    assert isinstance(runner, ApiAppRunner)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    answers = []
    try:
        for request in (
            b"GET /v2/deployments HTTP/1.1\r\nHost: x\r\nX-Api-Key: "
            + KEY_A.encode()
            + b"\x01\r\nX-Tenant-Id: t\r\n\r\n",
            b"GET /v2/deployments HTTP/1.1\r\nHost: x\r\nX-Api-Key: "
            + KEY_A.encode()
            + b"\r\nX-Bad\x01: "
            + KEY_A.encode()
            + b"\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            await writer.drain()
            answers.append(await asyncio.wait_for(reader.read(), timeout=30))
            writer.close()
    finally:
        await runner.cleanup()
    for answer in answers:
        assert answer.split(b" ", 2)[1] == b"400", answer[:200]
        assert KEY_A.encode() not in answer
    refused = [rec for rec in caplog.records if "refused a malformed request" in rec.message]
    assert refused, "the refusal is logged at DEBUG"
    logged = "\n".join(
        rec.getMessage() + (caplog.text if rec.exc_info else "") for rec in caplog.records
    )
    assert KEY_A not in logged
    assert KEY_A not in caplog.text
    assert json.dumps(KEY_A)[1:-1] not in caplog.text


def test_a_logged_exception_names_its_type_and_frames_never_its_message() -> None:
    def fail() -> None:
        try:
            raise KeyError(KEY_A)
        except KeyError as exc:
            raise ValueError(f"bad header {KEY_A}") from exc

    try:
        fail()
    except ValueError as exc:
        summary = exception_summary(exc)
    assert KEY_A not in summary
    assert summary.startswith("builtins.ValueError at ") and "in fail" in summary
    assert "caused by builtins.KeyError" in summary
