"""``gateway deployments …`` run as a real subprocess against a real control plane."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from .support import KEY_A, SECRET_VALUE, TENANT_A

ROOT = Path(__file__).resolve().parents[2]
# Builds the parser the way gateway/cli.py does, so the test does not depend on the rest of
# the command line.
PROGRAM = (
    "import argparse, sys\n"
    "from gateway.client.cli import register\n"
    "parser = argparse.ArgumentParser(prog='gateway')\n"
    "register(parser.add_subparsers(dest='command', required=True))\n"
    "args = parser.parse_args(sys.argv[1:])\n"
    "sys.exit(args.func(args))\n"
)
REPO_FLAGS = [
    "--integration-id",
    "int-shared",
    "--repo-url",
    "https://github.com/acme/agent",
    "--repo-ref",
    "main",
]


async def run_cli(url: str, *args: str, env_extra: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "LANGSMITH_"))}
    env.update(
        GATEWAY_API_KEY=KEY_A,
        GATEWAY_TENANT_ID=TENANT_A,
        GATEWAY_CONTROL_PLANE_URL=url,
        PYTHONPATH=str(ROOT),
        OPENAI_API_KEY=SECRET_VALUE,
    )
    env.update(env_extra or {})
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PROGRAM,
        "deployments",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        cwd=ROOT,
    )
    stdout, stderr = await asyncio.wait_for(proc.communicate(), timeout=90)
    return proc.returncode, stdout.decode(), stderr.decode()


async def test_cli_quickstart(control_plane_url):
    code, out, err = await run_cli(
        control_plane_url,
        "quickstart",
        "--name",
        "cli-agent",
        *REPO_FLAGS,
        "--config-path",
        "langgraph.json",
        "--secret",
        "OPENAI_API_KEY",
        "--patch-repo-ref",
        "release",
        "--poll-interval",
        "0.02",
        "--timeout",
        "60",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["deleted"] is True
    assert result["first_revision"]["status"] == "DEPLOYED"
    assert result["second_revision"]["status"] == "DEPLOYED"
    assert "-> revision" in err and "DEPLOYED" in err
    for text in (out, err):
        assert SECRET_VALUE not in text
        assert KEY_A not in text


async def test_cli_commands(control_plane_url):
    code, out, err = await run_cli(
        control_plane_url,
        "create",
        "--name",
        "cli-two",
        *REPO_FLAGS,
        "--graph-config-path",
        "langgraph.json",
        "--wait",
        "--poll-interval",
        "0.02",
    )
    assert code == 0, err
    deployment = json.loads(out)
    assert deployment["status"] == "READY"
    dep_id = deployment["id"]

    code, out, err = await run_cli(control_plane_url, "list", "--name-contains", "two")
    assert code == 0, err
    assert [d["id"] for d in json.loads(out)["resources"]] == [dep_id]
    code, out, _ = await run_cli(control_plane_url, "get", dep_id)
    assert json.loads(out)["id"] == dep_id

    code, out, err = await run_cli(control_plane_url, "update", dep_id, "--repo-ref", "v3")
    assert code == 0, err
    new_rev = json.loads(out)["latest_revision_id"]
    code, out, err = await run_cli(
        control_plane_url, "wait", dep_id, "--poll-interval", "0.02", "--timeout", "60"
    )
    assert code == 0, err
    assert json.loads(out)["id"] == new_rev
    code, out, _ = await run_cli(control_plane_url, "revisions", dep_id)
    assert json.loads(out)["resources"][0]["id"] == new_rev
    code, out, _ = await run_cli(control_plane_url, "revisions", dep_id, "--revision", new_rev)
    assert json.loads(out)["status"] == "DEPLOYED"

    code, out, err = await run_cli(control_plane_url, "update", dep_id)
    assert code == 2 and "nothing to update" in err
    code, out, err = await run_cli(control_plane_url, "delete", dep_id)
    assert code == 0, err
    code, out, err = await run_cli(control_plane_url, "get", dep_id)
    assert code == 1
    assert "404" in err and f"Deployment ID {dep_id} not found." in err


async def test_cli_failed_build_and_missing_credentials(control_plane_url):
    code, _out, err = await run_cli(
        control_plane_url,
        "create",
        "--name",
        "broken",
        *REPO_FLAGS,
        "--config-path",
        "langgraph.toml",
        "--wait",
        "--poll-interval",
        "0.02",
    )
    assert code == 1
    assert "BUILD_FAILED" in err
    code, _, err = await run_cli(control_plane_url, "list", env_extra={"GATEWAY_API_KEY": ""})
    assert code == 2 and "API key" in err
    code, _, err = await run_cli(
        control_plane_url, "create", "--name", "x", "--secret", "NOPE_UNSET"
    )
    assert code == 2 and "NOPE_UNSET" in err


async def test_cli_an_id_that_is_not_one_is_a_usage_error(control_plane_url):
    for bad in ("../x", ".", "a/b"):
        code, _out, err = await run_cli(control_plane_url, "get", bad)
        assert code == 2, err
        assert err.startswith("error: not a valid id") and "Traceback" not in err
