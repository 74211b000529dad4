"""deploy/: the compose file and the Kubernetes sidecar example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.cli import build_parser
from gateway.counters.factory import parse_counter_url
from gateway.policy.loader import load_rules_from_texts
from gateway.settings import load_settings
from tests.ops.helpers import (
    COMPOSE,
    DOCKER_ENV_NAMES_FILES,
    ENV_NAME,
    ROOT,
    k8s_kind,
    read_compose,
    read_dockerfile,
    read_sidecar,
    setting_env_names,
    substitute_compose,
)

PLACEHOLDER_SECRET = "placeholder-secret-0123456789abcdef"
PLACEHOLDER_REDIS = "redis://redis.example.internal:6379/0"


@pytest.mark.parametrize("path", DOCKER_ENV_NAMES_FILES, ids=lambda p: p.name)
def test_every_gateway_variable_named_is_a_real_setting(path: Path):
    named = set(ENV_NAME.findall(path.read_text()))
    assert named, f"{path} names no GATEWAY_* variable"
    unknown = named - setting_env_names()
    assert not unknown, f"{path.relative_to(ROOT)} names unknown variables {sorted(unknown)}"


# --- compose ---------------------------------------------------------------------------------


def _compose_gateway_env() -> dict[str, str]:
    gateway = read_compose()["services"]["gateway"]
    env = gateway["environment"]
    assert isinstance(env, dict)
    values = {
        "GATEWAY_IDENTITY_SECRET": PLACEHOLDER_SECRET,
        "GATEWAY_ADMIN_TOKEN": "placeholder-admin-token-0123456789",
        "POSTGRES_PASSWORD": "pw",
    }
    return {k: substitute_compose(str(v), values) for k, v in env.items()}


def test_compose_runs_the_gateway_and_redis():
    services = read_compose()["services"]
    assert set(services) >= {"gateway", "redis"}
    gateway = services["gateway"]
    assert gateway["build"]["context"] == ".."
    assert (COMPOSE.parent / gateway["build"]["context"] / "Dockerfile").is_file()
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "healthcheck" in services["redis"]


def test_compose_environment_loads_as_settings():
    env = _compose_gateway_env()
    settings = load_settings({}, env=env)
    assert settings.redis_url is not None
    host = parse_counter_url(settings.redis_url).hosts[0][0]
    assert host in read_compose()["services"], "the Redis URL names a compose service"
    # More than one worker is only allowed with shared counters for every region.
    if settings.workers > 1:
        assert all(region.counter_url for region in settings.region_table())
    assert settings.identity_secret == PLACEHOLDER_SECRET


def test_compose_requires_the_identity_secret_rather_than_embedding_one():
    raw = read_compose()["services"]["gateway"]["environment"]["GATEWAY_IDENTITY_SECRET"]
    assert re.fullmatch(r"\$\{GATEWAY_IDENTITY_SECRET:\?[^}]+\}", raw)


def test_compose_mounts_rules_where_the_image_reads_them_and_exposes_admin_ports():
    gateway = read_compose()["services"]["gateway"]
    rules_dir = read_dockerfile().env["GATEWAY_RULES"]
    mounts = [v.split(":") for v in gateway["volumes"]]
    sources = {target: source for source, target, *_ in mounts}
    assert (COMPOSE.parent / sources[rules_dir]).resolve() == (ROOT / "rules").resolve()
    assert "/data" in sources
    ports = gateway["ports"]
    # Workers share the traffic port (SO_REUSEPORT) and the supervisor alone serves the
    # admin port, for every worker: one of each, the admin port on the host's loopback.
    assert sorted(ports) == ["127.0.0.1:9090:9090", "8080:8080"]


def test_compose_grace_period_outlasts_the_shutdown_timeout():
    gateway = read_compose()["services"]["gateway"]
    grace = int(str(gateway["stop_grace_period"]).rstrip("s"))
    assert grace > load_settings({}, env=_compose_gateway_env()).shutdown_timeout


# --- Kubernetes ------------------------------------------------------------------------------


def _sidecar_container() -> dict:
    deployment = k8s_kind(read_sidecar(), "Deployment")
    containers = deployment["spec"]["template"]["spec"]["containers"]
    gateways = [c for c in containers if c["name"] == "ratelimit-gateway"]
    assert len(gateways) == 1 and len(containers) >= 2, "the gateway runs beside an app"
    return gateways[0]


def _sidecar_env() -> dict[str, str]:
    env = {}
    for item in _sidecar_container()["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            key = item["valueFrom"]["secretKeyRef"]["key"]
            env[item["name"]] = PLACEHOLDER_REDIS if "redis" in key else PLACEHOLDER_SECRET
    return env


def test_sidecar_yaml_has_configmap_deployment_and_service():
    kinds = [d["kind"] for d in read_sidecar()]
    assert sorted(kinds) == ["ConfigMap", "Deployment", "NetworkPolicy", "Service"]


def test_sidecar_command_and_environment_are_valid():
    container = _sidecar_container()
    argv = [*container.get("command", []), *container["args"]]
    assert argv[0] == "gateway"
    build_parser().parse_args(argv[1:])
    settings = load_settings({}, env=_sidecar_env())
    assert settings.upstream == "http://127.0.0.1:2024"
    assert not settings.embedded_enabled
    app_ports = {
        p["containerPort"]
        for c in k8s_kind(read_sidecar(), "Deployment")["spec"]["template"]["spec"]["containers"]
        if c is not container
        for p in c.get("ports", [])
    }
    assert int(settings.upstream.rsplit(":", 1)[1]) in app_ports


def test_sidecar_secrets_come_from_a_secret_not_the_file():
    for item in _sidecar_container()["env"]:
        if item["name"] in ("GATEWAY_IDENTITY_SECRET", "GATEWAY_REDIS_URL"):
            assert "secretKeyRef" in item["valueFrom"]


def test_sidecar_probes_hit_ok_on_the_gateway_port():
    container = _sidecar_container()
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    settings = load_settings({}, env=_sidecar_env())
    assert ports["http"] == settings.port
    assert ports["metrics"] == settings.admin_port
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/ok")):
        check = container[probe]["httpGet"]
        assert check["path"] == path
        assert ports.get(check["port"], check["port"]) == settings.port


def test_sidecar_service_targets_the_gateway_not_the_app():
    service = k8s_kind(read_sidecar(), "Service")
    names = {p["name"] for p in _sidecar_container()["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_sidecar_rules_configmap_is_mounted_where_gateway_rules_points_and_loads():
    docs = read_sidecar()
    configmap = k8s_kind(docs, "ConfigMap")
    pod = k8s_kind(docs, "Deployment")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in _sidecar_container()["volumeMounts"]}
    rules_dir = load_settings({}, env=_sidecar_env()).rules[0]
    mount = mounts[rules_dir]
    assert "subPath" not in mount, "subPath mounts never see ConfigMap updates"
    assert volumes[mount["name"]]["configMap"]["name"] == configmap["metadata"]["name"]
    files = sorted(configmap["data"].items())
    assert all(name.endswith(".yaml") for name, _ in files)
    table = load_rules_from_texts(files)
    assert any(rule.shadow for rule in table.rules)
    assert table.rules[0].unlimited and table.rules[0].matches("GET", "/ok")


def test_sidecar_grace_period_outlasts_pre_stop_and_shutdown_timeout():
    pod = k8s_kind(read_sidecar(), "Deployment")["spec"]["template"]["spec"]
    container = _sidecar_container()
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    pause = int(pre_stop[-1]) if pre_stop[0] == "sleep" else 0
    timeout = load_settings({}, env=_sidecar_env()).shutdown_timeout
    assert pod["terminationGracePeriodSeconds"] > pause + timeout


def test_sidecar_runs_unprivileged_with_a_writable_data_dir():
    pod = k8s_kind(read_sidecar(), "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = _sidecar_container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    data_dir = read_dockerfile().env["GATEWAY_DATA_DIR"]
    assert data_dir in {m["mountPath"] for m in container["volumeMounts"]}


def test_compose_puts_the_built_in_upstreams_on_its_postgres():
    from urllib.parse import urlsplit

    services = read_compose()["services"]
    settings = load_settings({}, env=_compose_gateway_env())
    assert settings.database_url is not None
    parts = urlsplit(settings.database_url)
    assert parts.hostname in services, "the database URL names a compose service"
    assert parts.password is None, "the password comes from PGPASSWORD, not the URL"
    assert services["gateway"]["depends_on"][parts.hostname]["condition"] == "service_healthy"
    assert "healthcheck" in services[parts.hostname]
