"""The layering of ARCHITECTURE.md, checked on the source (imports of each package)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"

FORBIDDEN = {
    "policy": ("aiohttp", "redis", "gateway.proxy", "gateway.counters"),
    "ratelimit": ("aiohttp", "redis", "gateway.proxy"),
    "counters": ("aiohttp", "gateway.proxy"),
    "upstreams": ("gateway.proxy",),
    # replays run offline: no network client, no server, nothing of the data plane
    "replay": ("aiohttp", "redis", "gateway.proxy"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_forbidden_layers(package):
    files = list((PACKAGE / package).rglob("*.py"))
    assert files
    for file in files:
        for name in _imports(file):
            for banned in FORBIDDEN[package]:
                assert not (name == banned or name.startswith(banned + ".")), (
                    f"{file.relative_to(PACKAGE)} imports {name}"
                )
