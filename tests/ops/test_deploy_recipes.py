"""The deploy recipes (docs/deployment.md, deploy/docker-compose.yml,
deploy/kubernetes/sidecar.yaml, the Dockerfile) checked against what the code reads.

* Every ``GATEWAY_*`` variable they set is one ``gateway/settings.py`` reads (a field of
  ``Settings`` outside ``FILE_ONLY``, as ``load_settings`` maps them), and together they
  load as settings.
* Every variable compose requires (``${X:?...}``) is written to ``.env`` by the recipe in
  docs/deployment.md (its shell lines are run, with the real ``openssl``) and by the one in
  the compose file's header.
* Their command lines are ``gateway`` commands whose flags ``gateway serve --help`` lists.
* Ports agree: Dockerfile ``EXPOSE``, the settings each recipe gives, compose's published
  ports, the pod's ``containerPort``, the Service, the NetworkPolicy, the probes and the
  Prometheus annotations. Workers share one traffic and one admin port.
* Readiness is ``/ready`` and liveness ``/ok``, on the traffic port: the pod's probes and
  compose's healthcheck (run for real: healthy while the gateway is ready, unhealthy once
  its Redis is gone with a fail-closed rule, or once it has stopped).
* Off loopback (the image binds the admin port to 0.0.0.0) every recipe gives the console
  its ``GATEWAY_ADMIN_TOKEN``; the admin port is in no Service and only the monitoring
  namespace may reach it.
* A read-only root filesystem comes with a writable temporary directory; and the
  sidecar's gateway container, run for real as the pod would run it (its env, its volumes
  as directories, two workers, a real Redis), answers its probes on the paths and ports
  the manifest names and keeps its metrics files in that directory.

No container engine is usable on this machine (``docker info`` fails), so the image is
not built here: the Dockerfile's COPY sources and command are checked statically.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from gateway.settings import FILE_ONLY, Settings, load_settings
from tests.ops.helpers import (
    COMPOSE,
    DOCKERIGNORE,
    ROOT,
    SIDECAR,
    code_blocks,
    k8s_kind,
    read_compose,
    read_dockerfile,
    read_sidecar,
    shell_commands,
)
from tests.support.gateway import free_port
from tests.support.redis_servers import running_redis

DEPLOYMENT_MD = ROOT / "docs" / "deployment.md"
DOCKER = read_dockerfile()

# --- what the code reads ----------------------------------------------------------------------


def settings_env_names() -> set[str]:
    """The variables ``load_settings`` reads: ``GATEWAY_`` + each field's upper-cased name,
    file-only fields excepted (gateway/settings.py), and ``GATEWAY_CONFIG`` itself."""
    names = {f"GATEWAY_{f.name.upper()}" for f in fields(Settings) if f.name not in FILE_ONLY}
    return names | {"GATEWAY_CONFIG"}


@functools.cache
def _help(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "gateway", *args, "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def serve_flags() -> set[str]:
    """Every option ``gateway serve --help`` shows."""
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", _help("serve")))


def gateway_commands() -> set[str]:
    """The subcommands ``gateway --help`` lists."""
    listing = _help().split("positional arguments:", 1)[1].split("options:", 1)[0]
    return set(re.findall(r"^ {4}([a-z][a-z-]*)", listing, flags=re.MULTILINE))


def check_gateway_argv(argv: list[str], where: str) -> None:
    """``argv`` runs the ``gateway`` console script with a known subcommand; with ``serve``,
    every option is one ``gateway serve --help`` lists."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert argv and argv[0] in scripts, f"{where}: {argv} does not run a console script"
    assert len(argv) > 1 and argv[1] in gateway_commands(), f"{where}: {argv}"
    if argv[1] == "serve":
        unknown = {a.split("=", 1)[0] for a in argv[2:] if a.startswith("-")} - serve_flags()
        assert not unknown, f"{where}: `gateway serve --help` has no {sorted(unknown)}"


def check_env_names(env: Mapping[str, str], where: str) -> None:
    unknown = {k for k in env if k.startswith("GATEWAY_")} - settings_env_names()
    assert not unknown, f"{where} sets {sorted(unknown)}, which gateway/settings.py never reads"


def image_env() -> dict[str, str]:
    return {k: v for k, v in DOCKER.env.items() if k.startswith("GATEWAY_")}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def check_console_reachable(settings: Settings, where: str) -> None:
    """Off loopback the console answers 403 without a token (gateway/proxy/console.py)."""
    if not is_loopback(settings.admin_host):
        assert settings.admin_token, (
            f"{where}: the admin port listens on {settings.admin_host}, so the console "
            "answers 403 unless GATEWAY_ADMIN_TOKEN is set"
        )


# --- Dockerfile ---------------------------------------------------------------------------------


def _exposed() -> set[int]:
    return {int(p.split("/")[0]) for p in " ".join(DOCKER.all("EXPOSE")).split()}


def test_dockerfile_copy_sources_exist_and_are_not_ignored() -> None:
    ignored = {
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    sources: list[str] = []
    for line in _dockerfile_lines():
        instr, _, rest = line.partition(" ")
        if instr.upper() != "COPY":
            continue
        parts = shlex.split(rest)
        if any(p.startswith("--from") for p in parts):
            continue  # from a build stage, not the context
        *from_context, _dest = [p for p in parts if not p.startswith("--")]
        sources += from_context
    assert {"gateway", "rules/"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the build context"
        assert source.rstrip("/") not in ignored, f"COPY {source}: excluded by .dockerignore"


def _dockerfile_lines() -> Iterator[str]:
    """Every stage's instructions, continued lines joined."""
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield pending + line
        pending = ""


def test_dockerfile_command_is_a_gateway_command() -> None:
    check_gateway_argv([*DOCKER.entrypoint, *DOCKER.cmd], "Dockerfile CMD")


def test_dockerfile_environment_is_read_and_exposes_its_ports() -> None:
    env = image_env()
    check_env_names(env, "Dockerfile ENV")
    settings = load_settings({}, env=env)
    assert _exposed() == {settings.port, settings.admin_port}


def _docker_run_commands() -> list[list[str]]:
    found = []
    for block in code_blocks(DEPLOYMENT_MD):
        for command in shell_commands(block):
            words = shlex.split(command, comments=True)
            if words[:2] == ["docker", "run"]:
                found.append(words)
    return found


def _published(option_values: list[str]) -> dict[int, tuple[str, int]]:
    """``-p``/``ports:`` entries: container port -> (host address, host port). A range
    (``9090-9091``) is refused: workers share one port (gateway/workers.py)."""
    out: dict[int, tuple[str, int]] = {}
    for value in option_values:
        *host, container = str(value).split(":")
        assert "-" not in container, (
            f"{value}: a port range, but every worker shares the traffic port "
            "(SO_REUSEPORT) and the supervisor alone serves the admin port"
        )
        address = host[0] if len(host) == 2 else "0.0.0.0"
        out[int(container)] = (address, int(host[-1]) if host else int(container))
    return out


def test_the_docker_run_recipe_publishes_the_exposed_ports_and_passes_the_admin_token() -> None:
    [run] = _docker_run_commands()
    ports = [run[i + 1] for i, word in enumerate(run) if word == "-p"]
    envs = [run[i + 1] for i, word in enumerate(run) if word == "-e"]
    published = _published(ports)
    assert set(published) == _exposed()
    env = image_env()
    for name in envs:  # -e NAME passes the value exported just before it
        env[name.split("=")[0]] = "a-token-from-the-shell-0123456789"
    check_env_names(env, "docs: docker run")
    settings = load_settings({}, env=env)
    check_console_reachable(settings, "docs: docker run")
    assert published[settings.admin_port][0] == "127.0.0.1", "the admin port stays local"


# --- compose --------------------------------------------------------------------------------------

VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?)([-?+])([^}]*))?\}")


def compose_required() -> set[str]:
    return {m[0] for m in VARIABLE.findall(COMPOSE.read_text()) if m[2] == "?"}


def interpolate(value: str, dotenv: Mapping[str, str]) -> str:
    """Compose's interpolation of ``${X}``, ``${X:-default}``, ``${X:?error}``."""

    def one(match: re.Match[str]) -> str:
        name, colon, op, arg = match.groups()
        present = name in dotenv and (not colon or dotenv[name] != "")
        if op == "?" and not present:
            raise AssertionError(f"docker compose refuses to start: {name}: {arg}")
        if op == "-" and not present:
            return arg
        return dotenv.get(name, "")

    return VARIABLE.sub(one, value)


def _run_dotenv_recipe(lines: list[str], where: Path) -> dict[str, str]:
    """Run the lines that write ``.env`` in ``where``; the variables it holds after."""
    writes = [line for line in lines if re.search(r">>?\s*\.env\b", line)]
    assert writes, "the recipe writes no .env"
    done = subprocess.run(
        ["bash", "-euc", "\n".join(writes)], cwd=where, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    values = {}
    for line in (where / ".env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, value = line.partition("=")
            values[name.strip()] = value
    return values


def _docs_compose_recipe() -> list[str]:
    blocks = [b for b in code_blocks(DEPLOYMENT_MD) if "docker compose up" in b.text]
    assert len(blocks) == 1, "docs/deployment.md shows one compose recipe"
    return list(shell_commands(blocks[0]))


def _header_compose_recipe() -> list[str]:
    lines = []
    for raw in COMPOSE.read_text().splitlines():
        if not raw.startswith("#"):
            break
        if raw.startswith("#   "):
            lines.append(raw[4:].strip())
    return lines


@pytest.fixture
def docs_dotenv(tmp_path: Path) -> dict[str, str]:
    return _run_dotenv_recipe(_docs_compose_recipe(), tmp_path)


def test_the_docs_recipe_writes_every_variable_compose_requires(
    docs_dotenv: dict[str, str], tmp_path: Path
) -> None:
    required = compose_required()
    assert {"GATEWAY_IDENTITY_SECRET", "POSTGRES_PASSWORD", "GATEWAY_ADMIN_TOKEN"} <= required
    missing = required - set(docs_dotenv)
    assert not missing, f"docs/deployment.md's recipe never writes {sorted(missing)} to .env"
    assert all(docs_dotenv[name] for name in required), "each one has a value"
    # The compose file's own header says the same.
    header = tmp_path / "header"
    header.mkdir()
    assert set(_run_dotenv_recipe(_header_compose_recipe(), header)) == set(docs_dotenv)


def _compose_settings(dotenv: Mapping[str, str]) -> tuple[dict[str, str], Settings]:
    gateway = read_compose()["services"]["gateway"]
    env = {k: interpolate(str(v), dotenv) for k, v in gateway["environment"].items()}
    check_env_names(env, "deploy/docker-compose.yml")
    # What the container sees: the image's ENV, overridden by compose's environment.
    return env, load_settings({}, env={**image_env(), **env})


def test_compose_environment_is_read_and_loads_with_the_docs_values(
    docs_dotenv: dict[str, str],
) -> None:
    env, settings = _compose_settings(docs_dotenv)
    assert settings.identity_secret == docs_dotenv["GATEWAY_IDENTITY_SECRET"]
    assert env["PGPASSWORD"] == docs_dotenv["POSTGRES_PASSWORD"]
    postgres = read_compose()["services"]["postgres"]["environment"]
    assert interpolate(postgres["POSTGRES_PASSWORD"], docs_dotenv) == env["PGPASSWORD"]
    check_console_reachable(settings, "deploy/docker-compose.yml")
    assert settings.admin_token == docs_dotenv["GATEWAY_ADMIN_TOKEN"]
    command = read_compose()["services"]["gateway"].get("command")
    if command is not None:
        argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
        check_gateway_argv([*DOCKER.entrypoint, *argv], "compose command")


def test_compose_publishes_one_traffic_and_one_admin_port(docs_dotenv: dict[str, str]) -> None:
    _, settings = _compose_settings(docs_dotenv)
    assert settings.workers > 1, "the example runs workers: they share these two ports"
    published = _published(read_compose()["services"]["gateway"]["ports"])
    assert set(published) == {settings.port, settings.admin_port}
    assert set(published) <= _exposed()
    assert published[settings.admin_port][0] == "127.0.0.1", "the admin port stays local"
    # The recipes' curl lines reach the listener that serves the path, and show both
    # probes on the traffic port.
    for recipe in (_docs_compose_recipe(), _header_compose_recipe()):
        curls = [c for c in recipe if c.startswith("curl ")]
        assert curls
        host_ports = {host: container for container, (_, host) in published.items()}
        probes = set()
        for command in curls:
            url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S*)", command)
            assert url, command
            container = host_ports[int(url[1])]
            if url[2] == "/metrics":
                assert container == settings.admin_port, command
            else:
                assert url[2] in ("/ok", "/ready") and container in published, command
                probes.add(url[2])
        assert probes == {"/ok", "/ready"}, recipe


def _compose_healthcheck() -> list[str]:
    """The gateway service's healthcheck as a command line (``CMD`` form, no shell)."""
    test = [str(part) for part in read_compose()["services"]["gateway"]["healthcheck"]["test"]]
    assert test[0] == "CMD", "exec form: the slim image runs it without a shell"
    return test[1:]


def test_the_compose_healthcheck_is_readiness_on_the_traffic_port(
    docs_dotenv: dict[str, str], tmp_path: Path
) -> None:
    _compose_settings(docs_dotenv)  # (loads, or the test fails here)
    command = _compose_healthcheck()
    assert command == ["gateway", "health", "--ready"], "readiness, with serve's settings"
    check = read_compose()["services"]["gateway"]["healthcheck"]
    assert check["timeout"] == "3s", "longer than the probe's own 2 s"

    # Run it for real next to a gateway that follows GATEWAY_PORT as the image's does.
    argv = [sys.executable, "-m", "gateway", *command[1:]]
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - {id: writes, identity: ip, failure_mode: closed, limits: {default: 9/1}}\n"
    )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}

    def healthcheck() -> int:
        return subprocess.run(argv, env=env, capture_output=True, timeout=15).returncode

    with running_redis(tmp_path / "redis") as redis:
        env.update(
            GATEWAY_HOST="127.0.0.1",
            GATEWAY_PORT=str(port),
            GATEWAY_ADMIN_PORT=str(free_port()),
            GATEWAY_REDIS_URL=redis.url,
            GATEWAY_RULES=str(rules),
            GATEWAY_EMBEDDED="false",
            GATEWAY_DATA_DIR=str(tmp_path / "data"),
            GATEWAY_IDENTITY_SECRET=docs_dotenv["GATEWAY_IDENTITY_SECRET"],
            GATEWAY_ACCESS_LOG="off",
        )
        log = tmp_path / "gateway.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "serve"],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait(proc, f"http://127.0.0.1:{port}/ready", log)
            assert healthcheck() == 0
            redis.kill9()  # the fail-closed rule cannot be counted: not ready
            deadline = time.monotonic() + 30
            while healthcheck() == 0 and time.monotonic() < deadline:
                time.sleep(0.2)
            status, body = _get(f"http://127.0.0.1:{port}/ready")
            assert status == 503 and b"counter_store" in body, body
            assert healthcheck() != 0
            assert _get(f"http://127.0.0.1:{port}/ok")[0] == 200, "alive all the same"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert healthcheck() != 0, "nothing answers once it has stopped"


def test_the_compose_file_does_not_claim_per_worker_ports() -> None:
    text = COMPOSE.read_text() + DEPLOYMENT_MD.read_text()
    assert not re.search(r"port\s*\+\s*i|9090\s*\+\s*i|worker i ", text)


# --- Kubernetes -----------------------------------------------------------------------------------

PLACEHOLDER_SECRETS = {
    "identity-secret": "k8s-placeholder-identity-secret-0123",
    "admin-token": "k8s-placeholder-admin-token-456789",
    "redis-url": "redis://redis.example.internal:6379/0",
}


def _pod() -> dict[str, Any]:
    pod: dict[str, Any] = k8s_kind(read_sidecar(), "Deployment")["spec"]["template"]
    return pod


def _container() -> dict[str, Any]:
    containers: list[dict[str, Any]] = _pod()["spec"]["containers"]
    [gateway] = [c for c in containers if c["name"] == "ratelimit-gateway"]
    return gateway


def _container_ports() -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in _container()["ports"]}


def _port_number(port: int | str) -> int:
    return _container_ports()[port] if isinstance(port, str) else int(port)


def _k8s_env(secrets: Mapping[str, str] = PLACEHOLDER_SECRETS) -> dict[str, str]:
    env = {}
    for item in _container()["env"]:
        if "value" in item:
            env[item["name"]] = str(item["value"])
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "ratelimit-gateway"
            env[item["name"]] = secrets[ref["key"]]
    return env


def _k8s_settings() -> Settings:
    env = _k8s_env()
    check_env_names(env, "deploy/kubernetes/sidecar.yaml")
    return load_settings({}, env={**image_env(), **env})


def test_sidecar_environment_is_read_and_the_console_has_its_token() -> None:
    settings = _k8s_settings()
    check_console_reachable(settings, "deploy/kubernetes/sidecar.yaml")
    container = _container()
    check_gateway_argv(
        [*container.get("command", DOCKER.entrypoint), *container.get("args", DOCKER.cmd)],
        "sidecar.yaml",
    )


def test_the_secret_recipe_creates_every_key_the_pod_reads() -> None:
    header = "\n".join(
        line[1:].strip() for line in SIDECAR.read_text().splitlines() if line.startswith("#")
    )
    command = re.search(r"kubectl create secret generic (\S+)((?:[^\n]*\\\n)*[^\n]*)", header)
    assert command, "the header shows how to create the secret"
    created = set(re.findall(r"--from-literal=([a-z0-9-]+)=", command[2]))
    read = {
        item["valueFrom"]["secretKeyRef"]["key"]
        for item in _container()["env"]
        if "valueFrom" in item
    }
    assert command[1] == "ratelimit-gateway"
    assert read == created, f"the pod reads {sorted(read)}, the recipe creates {sorted(created)}"
    assert read <= set(PLACEHOLDER_SECRETS)


def test_sidecar_ports_agree_with_the_image_settings_service_and_annotations() -> None:
    settings = _k8s_settings()
    ports = _container_ports()
    assert ports == {"http": settings.port, "metrics": settings.admin_port}
    assert set(ports.values()) <= _exposed()
    annotations = _pod()["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.admin_port
    assert annotations["prometheus.io/path"] == "/metrics"
    service = k8s_kind(read_sidecar(), "Service")
    targets = {_port_number(p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets == {settings.port}, "only traffic: the admin port answers /info"


def test_sidecar_probes_readiness_on_ready_and_liveness_on_ok_on_the_traffic_port() -> None:
    settings = _k8s_settings()
    for name, path in (("readinessProbe", "/ready"), ("livenessProbe", "/ok")):
        probe = _container()[name]["httpGet"]
        assert probe["path"] == path, f"{name} probes {probe['path']}"
        assert _port_number(probe["port"]) == settings.port


def test_the_network_policy_admits_the_admin_port_only_from_monitoring() -> None:
    settings = _k8s_settings()
    policy = k8s_kind(read_sidecar(), "NetworkPolicy")["spec"]
    labels = _pod()["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["policyTypes"]
    admitted: dict[int, list[Any]] = {}
    for rule in policy["ingress"]:
        for port in rule["ports"]:
            admitted.setdefault(_port_number(port["port"]), []).append(rule.get("from"))
    assert set(admitted) == {settings.port, settings.admin_port}
    assert None in admitted[settings.port], "traffic from anywhere"
    for sources in admitted[settings.admin_port]:
        assert sources, "the admin port is not open to every pod"
        for source in sources:
            namespaces = source["namespaceSelector"]["matchLabels"]
            assert namespaces == {"kubernetes.io/metadata.name": "monitoring"}


def _temp_dir(env: Mapping[str, str]) -> str:
    """Where ``tempfile.mkdtemp`` (gateway/workers.py: the workers' metrics files) puts
    its directory in the container: $TMPDIR, $TEMP or $TMP, else /tmp."""
    return next((env[n] for n in ("TMPDIR", "TEMP", "TMP") if env.get(n)), "/tmp")


def test_a_read_only_root_comes_with_writable_tmp_and_data() -> None:
    container = _container()
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    writable = {
        m["mountPath"]: volumes[m["name"]]
        for m in container["volumeMounts"]
        if not m.get("readOnly")
    }
    settings = _k8s_settings()
    for path in (_temp_dir({**DOCKER.env, **_k8s_env()}), settings.data_dir):
        assert path in writable, f"{path} is not writable under readOnlyRootFilesystem"
        assert "emptyDir" in writable[path] or "persistentVolumeClaim" in writable[path]


# --- the sidecar's gateway container, run as the pod runs it ------------------------------------


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if _get(url)[0] == 200:
                return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"{url} never answered 200:\n{log.read_text()[-3000:]}")


def test_the_sidecar_container_runs_answers_its_probes_and_uses_its_tmp(tmp_path: Path) -> None:
    docs = read_sidecar()
    container = _container()
    volumes = {v["name"]: v for v in _pod()["spec"]["volumes"]}
    # Each mount becomes a directory: a ConfigMap's files written out, an emptyDir empty.
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        local = tmp_path / "pod" / mount["name"]
        local.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            configmap = k8s_kind(docs, "ConfigMap")
            assert configmap["metadata"]["name"] == volume["configMap"]["name"]
            for name, text in configmap["data"].items():
                (local / name).write_text(text)
        mounts[mount["mountPath"]] = local

    def local_path(value: str) -> str:
        for path, local in mounts.items():
            if value == path or value.startswith(path + "/"):
                return str(local) + value[len(path) :]
        return value

    with running_redis(tmp_path / "redis") as redis:
        secrets = {**PLACEHOLDER_SECRETS, "redis-url": redis.url}
        pod_env = {**DOCKER.env, **_k8s_env(secrets)}
        pod_env.pop("PATH")
        assert _temp_dir(pod_env) in mounts, "no volume where the gateway makes temporary files"
        settings = load_settings({}, env={**image_env(), **_k8s_env(secrets)})
        # Loopback and free ports for the test; everything else as the pod has it, with
        # two workers (the shared metrics files need the writable temporary directory).
        ports = {settings.port: free_port(), settings.admin_port: free_port()}
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        env.pop("TMPDIR", None)
        env.update({k: local_path(v) for k, v in pod_env.items()})
        env.update(
            GATEWAY_HOST="127.0.0.1",
            GATEWAY_ADMIN_HOST="127.0.0.1",
            GATEWAY_PORT=str(ports[settings.port]),
            GATEWAY_ADMIN_PORT=str(ports[settings.admin_port]),
            GATEWAY_WORKERS="2",
            GATEWAY_SHUTDOWN_TIMEOUT="5",
            TMPDIR=local_path(_temp_dir(pod_env)),
        )
        temp = Path(env["TMPDIR"])
        argv = [*container.get("command", DOCKER.entrypoint), *container.get("args", DOCKER.cmd)]
        log = tmp_path / "gateway.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", *argv[1:]],
                env=env,
                cwd=tmp_path,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            for name in ("readinessProbe", "livenessProbe"):
                probe = container[name]["httpGet"]
                port = ports[_port_number(probe["port"])]
                _wait(proc, f"http://127.0.0.1:{port}{probe['path']}", log)
            # Prometheus scrapes what the annotations name; the workers' numbers arrive
            # with their first write (about a second after they start).
            annotations = _pod()["metadata"]["annotations"]
            scrape = ports[int(annotations["prometheus.io/port"])]
            url = f"http://127.0.0.1:{scrape}{annotations['prometheus.io/path']}"
            deadline = time.monotonic() + 30
            while b"gateway_rules " not in _get(url)[1] and time.monotonic() < deadline:
                time.sleep(0.1)
            status, body = _get(url)
            assert status == 200 and b"gateway_rules " in body, body[:500]
            made = list(temp.glob("gateway-metrics-*"))
            assert len(made) == 1 and made[0].is_dir(), list(temp.iterdir())
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not list(temp.glob("gateway-metrics-*")), "removed at exit"
    assert "started 2 workers" in log.read_text()


# --- the rest of the docs' recipes --------------------------------------------------------------


def test_files_the_deployment_guide_names_exist() -> None:
    text = DEPLOYMENT_MD.read_text()
    named = set(re.findall(r"`((?:deploy|docs|rules)/[^`\s]*)`", text))
    named |= set(re.findall(r"kubectl apply -f (\S+)", text))
    named.discard("deploy/.env")  # written by the compose recipe, never committed
    assert {"deploy/kubernetes/sidecar.yaml", "deploy/docker-compose.yml"} <= named
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, f"docs/deployment.md names missing files {missing}"
