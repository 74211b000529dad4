"""The package's layers point one way (README, "Layout"): a test over the source's imports,
so the structure stays as drawn. It fails when an import crosses a layer the wrong way or
closes a cycle between packages (imports inside functions and under TYPE_CHECKING count
too: a cycle dodged at run time is still a cycle in the design)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gateway"

# Each part of the package, and the parts it may import. Top to bottom: the command line
# chooses what runs; the wiring builds it; the data plane, the tools and the built-in
# services use the core; the core (the limiter, its port, the rule table, identities)
# imports nothing above it; the counter backends implement the limiter's port.
ALLOWED: dict[str, set[str]] = {
    "__main__": {"cli"},
    "health": {"settings"},
    "urls": set(),
    "cli": {"launch", "settings", "client", "data_cli", "store_cli", "explain", "identity",
            "policy", "ratelimit", "replay", "upstreams", "native", "secrets", "metrics",
            "app", "health"},
    "launch": {"app", "workers", "settings"},
    "logs": set(),
    "data_cli": {"upstreams", "settings", "urls"},
    "store_cli": {"upstreams", "settings"},
    "workers": {"app", "logs", "settings", "proxy", "counters", "metrics", "secrets", "native",
                "ratelimit", "policy", "upstreams", "identity", "tls_setup"},
    "app": {"logs", "settings", "proxy", "counters", "metrics", "secrets", "native", "ratelimit",
            "policy", "upstreams", "identity", "explain", "replay", "tls_setup", "urls"},
    "tls_setup": {"settings", "proxy", "metrics"},
    "settings": {"counters", "identity", "policy", "ratelimit", "upstreams", "urls"},
    "explain": {"policy", "ratelimit", "identity"},
    "proxy": {"ratelimit", "policy", "identity", "metrics", "counters", "replay", "explain",
              "native", "upstreams", "urls"},
    "replay": {"ratelimit", "policy", "counters"},
    "client": {"urls"},
    "upstreams": {"metrics", "urls", "ratelimit"},
    "identity": {"policy", "urls"},
    "counters": {"ratelimit", "metrics"},
    "ratelimit": {"policy"},
    "policy": set(),
    "metrics": set(),
    "secrets": set(),
    "native": set(),
}  # fmt: skip


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports() -> dict[tuple[str, str], set[str]]:
    """(importing part, imported part) -> the modules doing it."""
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        source = _part(module)
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                if name == "gateway" or name.startswith("gateway."):
                    target = _part(name)
                    if target not in ("__init__", source):
                        edges[(source, target)].add(module)
    return edges


def test_every_part_is_drawn():
    parts = {_part(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts))
             for p in PACKAGE.rglob("*.py")} - {"__init__"}  # fmt: skip
    assert parts == set(ALLOWED), "a new part of the package: give it its layer in ALLOWED"


def test_imports_follow_the_layers():
    wrong = sorted(
        f"{source} -> {target} ({', '.join(sorted(modules))})"
        for (source, target), modules in _imports().items()
        if target not in ALLOWED.get(source, set())
    )
    assert wrong == []


def test_no_cycles_between_parts():
    graph: dict[str, set[str]] = defaultdict(set)
    for source, target in _imports():
        graph[source].add(target)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    cycles = sorted(
        f"{a} <-> {b}" for a in list(graph) for b in graph[a] if a < b and reaches(b, a)
    )
    assert cycles == []
