"""``name_contains`` matches case-insensitively in every script, the same on SQLite and on
PostgreSQL (every test here runs on both: see conftest.py).

SQLite's lower() folds ASCII only, so the filter once missed "Ågent-ÉCOLE" for "école" on
SQLite while PostgreSQL's locale-dependent lower() could find it.
"""

from __future__ import annotations

import unicodedata
from urllib.parse import quote

from .support import KEY_B, TENANT_B, deployment_body, headers

H = headers()


async def _names(http, needle: str, **paging: int) -> list[str]:
    query = "".join(f"&{k}={v}" for k, v in paging.items())
    r = await http.get(f"/v2/deployments?name_contains={quote(needle)}{query}", headers=H)
    assert r.status == 200, await r.text()
    return [d["name"] for d in (await r.json())["resources"]]


async def test_name_contains_folds_case_beyond_ascii(http):
    names = ["Ågent-ÉCOLE", "straße-bot", "ΣΟΦΙΑ", "plain-api", "other"]
    for name in names:
        r = await http.post("/v2/deployments", json=deployment_body(name), headers=H)
        assert r.status == 201, await r.text()
    assert await _names(http, "école") == ["Ågent-ÉCOLE"]
    assert await _names(http, "ÉCOLE") == ["Ågent-ÉCOLE"]
    assert await _names(http, "ågent") == ["Ågent-ÉCOLE"]
    # Typed decomposed (e + combining acute) it is the same text.
    assert await _names(http, unicodedata.normalize("NFD", "école")) == ["Ågent-ÉCOLE"]
    assert await _names(http, "STRASSE") == ["straße-bot"]
    assert await _names(http, "σοφια") == ["ΣΟΦΙΑ"]
    assert await _names(http, "API") == ["plain-api"]
    assert await _names(http, "zzz") == []
    # Newest first, paged after matching: limit and offset count matches only.
    assert await _names(http, "-") == ["plain-api", "straße-bot", "Ågent-ÉCOLE"]
    assert await _names(http, "-", limit=1, offset=1) == ["straße-bot"]
    assert await _names(http, "-", limit=2, offset=2) == ["Ågent-ÉCOLE"]
    assert await _names(http, "-", limit=5, offset=3) == []


async def test_name_contains_stays_within_the_tenant(http):
    r = await http.post("/v2/deployments", json=deployment_body("École-A"), headers=H)
    assert r.status == 201
    r = await http.get("/v2/deployments?name_contains=%C3%A9cole", headers=headers(KEY_B, TENANT_B))
    assert r.status == 200, await r.text()
    assert (await r.json())["resources"] == []
    assert await _names(http, "école") == ["École-A"]
