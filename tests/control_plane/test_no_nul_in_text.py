"""No text of a control-plane request may hold a NUL: PostgreSQL's text columns refuse it,
and the control plane answered 500 (``psycopg.DataError``) for a NUL in a deployment's
name, a listener's version, a provider's name or client id, an auth flow's user id or a
path id (review, seventeenth session). By class: every field of every request model that
takes a plain string refuses one with a NUL (422 naming the field, on every backend)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from gateway.upstreams.control_plane import models
from gateway.upstreams.http_api.json_values import NUL_IN_TEXT

from .support import deployment_body, headers, make_config, running_control_plane

H = headers()


def _string_fields() -> list[tuple[str, Any]]:
    found = []
    for name, cls in inspect.getmembers(models, inspect.isclass):
        if not issubclass(cls, BaseModel) or cls is BaseModel:
            continue
        for field_name, field in cls.model_fields.items():
            if field.metadata:
                adapter: TypeAdapter[Any] = TypeAdapter(
                    Annotated[(field.annotation, *field.metadata)]  # type: ignore[valid-type]
                )
            else:
                adapter = TypeAdapter(field.annotation)
            try:
                adapter.validate_python("ab", strict=True)
            except ValidationError:
                continue  # (not a free string: an enum, a pattern "ab" misses, an object)
            found.append((f"{name}.{field_name}", adapter))
    found.append(("PathId", TypeAdapter(models.PathId)))
    return found


FIELDS = _string_fields()


def test_there_are_text_fields_to_check() -> None:
    assert len(FIELDS) >= 10, [n for n, _ in FIELDS]


@pytest.mark.parametrize(("where", "adapter"), FIELDS, ids=[n for n, _ in FIELDS])
def test_every_text_field_refuses_a_nul(where: str, adapter: TypeAdapter[Any]) -> None:
    with pytest.raises(ValidationError) as caught:
        adapter.validate_python("a\x00b", strict=True)
    # Refused as a NUL, or by the field's own pattern (ids, names of a fixed alphabet).
    text = str(caught.value)
    assert NUL_IN_TEXT in text or "string_pattern_mismatch" in text, (where, text)


async def test_a_nul_in_a_deployment_name_is_a_422_naming_it(tmp_path: Path) -> None:
    config = make_config(tmp_path / "data")
    async with running_control_plane(config) as cp, aiohttp.ClientSession(cp.url) as http:
        r = await http.post("/v2/deployments", json=deployment_body("a\x00b"), headers=H)
        assert r.status == 422, await r.text()
        detail = (await r.json())["detail"]
        assert detail.startswith("name:") and "NUL" in detail, detail
        r = await http.get("/v2/deployments/a%00b", headers=H)
        assert r.status == 422, await r.text()
        assert "NUL" in (await r.json())["detail"]
