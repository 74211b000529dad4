"""Readers for the shipping files: Dockerfile, compose, Kubernetes, docs, metric names."""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from gateway.metrics import Metrics
from gateway.settings import FILE_ONLY, Settings
from gateway.upstreams.http_api.parse_budget import ParseBudget
from gateway.upstreams.http_api.parse_metrics import ParseBudgetCollector

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "deploy" / "docker-compose.yml"
SIDECAR = ROOT / "deploy" / "kubernetes" / "sidecar.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "gateway-dashboard.json"
DOCS = [ROOT / "docs" / name for name in ("deployment.md", "rules.md", "troubleshooting.md")]

# Variables read outside Settings: the config file, the control plane's credential and
# pacing (gateway/upstreams/control_plane/config.py), and the identity secret.
EXTRA_ENV = {
    "GATEWAY_CONFIG",
    "GATEWAY_API_KEY",
    "GATEWAY_TENANT_ID",
    "GATEWAY_REVISION_STEP_SECONDS",
    "GATEWAY_IDENTITY_SECRET",
    "GATEWAY_TLS_KEY_PASSPHRASE",
}
# Read by the control-plane client (gateway deployments ...), named in the docs only.
CLIENT_ENV = {"GATEWAY_CONTROL_PLANE_URL"}
ENV_NAME = re.compile(r"\bGATEWAY_[A-Z0-9_]+\b")


def build_env_names() -> set[str]:
    """The GATEWAY_* variables the build reads (setup.py: GATEWAY_COMPILE)."""
    return set(ENV_NAME.findall((ROOT / "setup.py").read_text()))


def setting_env_names() -> set[str]:
    """Every GATEWAY_* variable the gateway reads (config-file-only fields excluded:
    the environment cannot set them)."""
    names = {f"GATEWAY_{f.name.upper()}" for f in fields(Settings) if f.name not in FILE_ONLY}
    return names | EXTRA_ENV


# --- Dockerfile --------------------------------------------------------------------------


@dataclass
class Dockerfile:
    stages: list[str] = field(default_factory=list)  # FROM lines
    instructions: list[tuple[str, str]] = field(default_factory=list)  # final stage only

    def all(self, name: str) -> list[str]:
        return [rest for instr, rest in self.instructions if instr == name]

    def one(self, name: str) -> str:
        found = self.all(name)
        assert len(found) == 1, f"expected one {name} in the final stage, found {found}"
        return found[0]

    @property
    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for token in shlex.split(rest):
                name, sep, value = token.partition("=")
                assert sep, f"ENV uses the key=value form: {rest!r}"
                out[name] = value
        return out

    @property
    def cmd(self) -> list[str]:
        value = json.loads(self.one("CMD"))
        assert isinstance(value, list), "CMD is in exec (JSON) form"
        return [str(v) for v in value]

    @property
    def entrypoint(self) -> list[str]:
        found = self.all("ENTRYPOINT")
        return [str(v) for v in json.loads(found[-1])] if found else []

    @property
    def healthcheck(self) -> tuple[list[str], list[str]]:
        """(options, exec-form command)."""
        rest = self.one("HEALTHCHECK")
        options, sep, command = rest.partition("CMD ")
        assert sep, "HEALTHCHECK has a CMD"
        return options.split(), [str(v) for v in json.loads(command)]

    def copies(self) -> dict[str, Path]:
        """Destination in the image -> source in the build context (plain COPY only)."""
        out: dict[str, Path] = {}
        for rest in self.all("COPY"):
            parts = shlex.split(rest)
            if any(p.startswith("--from") for p in parts):
                continue
            *sources, dest = [p for p in parts if not p.startswith("--")]
            if len(sources) == 1:
                out[dest.rstrip("/")] = ROOT / sources[0].rstrip("/")
        return out


def read_dockerfile(path: Path = DOCKERFILE) -> Dockerfile:
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    result = Dockerfile()
    for line in logical:
        instr, _, rest = line.partition(" ")
        instr = instr.upper()
        if instr == "FROM":
            result.stages.append(rest.strip())
            result.instructions = []
            continue
        result.instructions.append((instr, rest.strip()))
    return result


# --- compose and Kubernetes ---------------------------------------------------------------


def read_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def read_sidecar() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(SIDECAR.read_text()) if d]
    assert all(isinstance(d, dict) for d in docs)
    return docs


def k8s_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


COMPOSE_VARIABLE = re.compile(r"\$\{([A-Z0-9_]+)(?::?[-?+][^}]*)?\}")


def substitute_compose(value: str, values: dict[str, str]) -> str:
    return COMPOSE_VARIABLE.sub(lambda m: values[m.group(1)], value)


# --- metrics -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetricFamily:
    name: str
    kind: str
    labels: tuple[str, ...]

    def sample_names(self) -> set[str]:
        if self.kind == "counter":
            return {f"{self.name}_total"}
        if self.kind == "histogram":
            return {f"{self.name}_{s}" for s in ("bucket", "sum", "count")}
        return {self.name}


def metric_families() -> dict[str, MetricFamily]:
    """Every metric gateway/metrics.py defines, by family name, and the built-in APIs'
    (their parse budget's collector, on the admin port of the process that runs them)."""
    out = {
        family.name: MetricFamily(family.name, family.kind, family.labelnames)  # no _total
        for family in Metrics().families
    }
    assert out, "no metrics found on gateway.metrics.Metrics"
    for metric in ParseBudgetCollector(ParseBudget()).collect():
        labels = tuple(sorted({k for sample in metric.samples for k in sample.labels}))
        out[metric.name] = MetricFamily(metric.name, metric.type, labels)
    return out


def sample_index(families: dict[str, MetricFamily]) -> dict[str, MetricFamily]:
    """Exported sample name (``gateway_requests_total``, ``..._bucket``) -> its family."""
    return {sample: fam for fam in families.values() for sample in fam.sample_names()}


def exported_names(text: str) -> set[str]:
    """Sample names in Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


# --- docs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CodeBlock:
    path: Path
    line: int
    lang: str
    text: str


def code_blocks(path: Path) -> Iterator[CodeBlock]:
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip()
            start = i + 1
            indent = len(lines[i]) - len(lines[i].lstrip())
            i += 1
            body = []
            while i < len(lines) and not lines[i].strip().startswith("```"):
                body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
                i += 1
            yield CodeBlock(path, start, lang, "\n".join(body) + "\n")
        i += 1


SHELL_LANGS = {"", "sh", "bash", "shell", "console"}


def shell_commands(block: CodeBlock) -> Iterator[str]:
    """Command lines of a shell block (``$ `` prompts stripped, continuations joined)."""
    if block.lang not in SHELL_LANGS:
        return
    pending = ""
    for raw in block.text.splitlines():
        line = raw.rstrip()
        if block.lang == "console" and not pending:
            if not line.startswith("$ "):
                continue  # output
            line = line[2:]
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield (pending + line).strip()
        pending = ""


def gateway_argv(command: str) -> list[str] | None:
    """The arguments after ``gateway`` / ``python -m gateway``, or None for other commands."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    for prefix in (["gateway"], [".venv/bin/gateway"], ["python", "-m", "gateway"]):
        if words[: len(prefix)] == prefix:
            return words[len(prefix) :]
    return None


PLACEHOLDER = re.compile(r"<[^>]+>|\.\.\.")

# Files whose GATEWAY_* names must all be real settings.
DOCKER_ENV_NAMES_FILES = [DOCKERFILE, COMPOSE, SIDECAR]
