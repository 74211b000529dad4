"""``gateway deployments …``: the control-plane client on the command line.

Results go to stdout as JSON; progress and errors go to stderr. Exit status: 0 success,
1 the control plane answered unexpectedly (a redirect too: never followed) / a revision
failed / the wait timed out, 2 bad usage (missing credentials, unreadable body file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .api import (
    DEFAULT_POLL_INTERVAL,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_URL,
    DEFAULT_WAIT_TIMEOUT,
    ClientSettings,
    ControlPlaneClient,
    WaitProgress,
)
from .errors import ControlPlaneError
from .quickstart import run_quickstart

MAX_BODY_FILE_BYTES = 1024 * 1024

Command = Callable[[argparse.Namespace, ControlPlaneClient], Awaitable[Any]]


class UsageError(Exception):
    """Bad command-line input (exit status 2)."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``deployments`` and its subcommands; each sets ``func(args) -> int``."""
    connection = argparse.ArgumentParser(add_help=False)
    group = connection.add_argument_group("control plane")
    group.add_argument(
        "--url",
        help=f"control plane or gateway address, may end in /api-host "
        f"(env GATEWAY_CONTROL_PLANE_URL, default {DEFAULT_URL})",
    )
    group.add_argument(
        "--api-key",
        help="API key (env GATEWAY_API_KEY, else LANGSMITH_API_KEY but only with an "
        "https:// URL; prefer the environment, a flag is visible to other local users)",
    )
    group.add_argument("--tenant-id", help="workspace id (env GATEWAY_TENANT_ID)")
    group.add_argument(
        "--request-timeout",
        type=_positive,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds per HTTP call (default %(default)s)",
    )

    waiting = argparse.ArgumentParser(add_help=False)
    wait_group = waiting.add_argument_group("waiting")
    wait_group.add_argument(
        "--poll-interval",
        type=_positive,
        default=DEFAULT_POLL_INTERVAL,
        help="seconds between reads of the revision (default %(default)s)",
    )
    wait_group.add_argument(
        "--timeout",
        type=_non_negative,
        default=DEFAULT_WAIT_TIMEOUT,
        help="give up after this many seconds (default %(default)s)",
    )

    deployments = subparsers.add_parser(
        "deployments",
        help="create, read, update and delete deployments on the control plane",
        description="Client of the deployments control plane (built-in or hosted).",
    )
    commands = deployments.add_subparsers(
        dest="deployments_command", metavar="COMMAND", required=True
    )

    create = commands.add_parser(
        "create", parents=[connection, waiting], help="create a deployment"
    )
    _add_body_flags(create, creating=True)
    create.add_argument("--wait", action="store_true", help="wait until its revision is DEPLOYED")
    create.set_defaults(func=_runner(_create))

    listing = commands.add_parser("list", parents=[connection], help="list deployments")
    listing.add_argument("--limit", type=int, default=20, help="1..100 (default 20)")
    listing.add_argument("--offset", type=int, default=0)
    listing.add_argument("--name-contains")
    listing.set_defaults(func=_runner(_list))

    get = commands.add_parser("get", parents=[connection], help="show a deployment")
    get.add_argument("deployment_id")
    get.set_defaults(func=_runner(_get))

    update = commands.add_parser(
        "update",
        parents=[connection, waiting],
        help="patch a deployment (revision fields or secrets start a new revision)",
    )
    update.add_argument("deployment_id")
    _add_body_flags(update, creating=False)
    update.add_argument("--wait", action="store_true", help="wait for the new revision")
    update.set_defaults(func=_runner(_update))

    delete = commands.add_parser("delete", parents=[connection], help="delete a deployment")
    delete.add_argument("deployment_id")
    delete.set_defaults(func=_runner(_delete))

    revisions = commands.add_parser(
        "revisions", parents=[connection], help="list a deployment's revisions (latest first)"
    )
    revisions.add_argument("deployment_id")
    revisions.add_argument("--revision", help="show only this revision")
    revisions.add_argument("--limit", type=int, default=20)
    revisions.add_argument("--offset", type=int, default=0)
    revisions.set_defaults(func=_runner(_revisions))

    redeploy = commands.add_parser(
        "redeploy", parents=[connection, waiting], help="deploy a past revision again"
    )
    redeploy.add_argument("deployment_id")
    redeploy.add_argument("revision_id")
    redeploy.add_argument("--wait", action="store_true", help="wait for the new revision")
    redeploy.set_defaults(func=_runner(_redeploy))

    wait = commands.add_parser(
        "wait",
        parents=[connection, waiting],
        help="wait until a revision (default: the latest) is DEPLOYED",
    )
    wait.add_argument("deployment_id")
    wait.add_argument("--revision", help="revision id (default: latest_revision_id)")
    wait.set_defaults(func=_runner(_wait))

    quickstart = commands.add_parser(
        "quickstart",
        parents=[connection, waiting],
        help="create, read, wait, patch, wait, delete (the documented quick-start)",
    )
    _add_body_flags(quickstart, creating=True)
    quickstart.add_argument("--patch-repo-ref", help="repo_ref of the patched revision")
    quickstart.add_argument("--patch-config-path", help="config path of the patched revision")
    quickstart.add_argument("--patch-image-uri", help="image_uri of the patched revision")
    quickstart.add_argument("--keep", action="store_true", help="do not delete at the end")
    quickstart.set_defaults(func=_runner(_quickstart))


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _add_body_flags(parser: argparse.ArgumentParser, *, creating: bool) -> None:
    body = parser.add_argument_group("deployment body")
    body.add_argument(
        "--body-file", help="JSON body to start from ('-' reads stdin); flags override it"
    )
    if creating:
        body.add_argument("--name", help="deployment name (required unless in --body-file)")
        body.add_argument("--source", choices=("github", "external_docker"), default=None)
    body.add_argument("--integration-id")
    body.add_argument("--repo-url")
    body.add_argument("--deployment-type", choices=("dev", "prod"))
    body.add_argument("--build-on-push", action=argparse.BooleanOptionalAction, default=None)
    body.add_argument("--custom-url")
    body.add_argument("--repo-ref")
    body.add_argument(
        "--config-path",
        "--langgraph-config-path",
        "--graph-config-path",
        dest="config_path",
        help="path of the graph configuration file (.json) in the repository",
    )
    body.add_argument("--image-uri")
    body.add_argument(
        "--secret",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="a secret; without =VALUE the value is read from the environment variable NAME",
    )


def _read_body_file(spec: str | None) -> dict[str, Any]:
    if spec is None:
        return {}
    try:
        if spec == "-":
            raw = sys.stdin.read(MAX_BODY_FILE_BYTES + 1)
        else:
            with Path(spec).open(encoding="utf-8") as handle:
                raw = handle.read(MAX_BODY_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"cannot read --body-file {spec}: {exc.strerror}") from None
    if len(raw) > MAX_BODY_FILE_BYTES:
        raise UsageError(f"--body-file {spec} is larger than {MAX_BODY_FILE_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"--body-file {spec} is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise UsageError(f"--body-file {spec} must hold a JSON object")
    return body


def _secrets(specs: list[str]) -> list[dict[str, str]]:
    out = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep:
            if name not in os.environ:
                raise UsageError(f"--secret {name}: environment variable {name} is not set")
            value = os.environ[name]
        out.append({"name": name, "value": value})
    return out


def _body_from_flags(args: argparse.Namespace, *, creating: bool) -> dict[str, Any]:
    body = _read_body_file(args.body_file)
    if creating:
        if args.name is not None:
            body["name"] = args.name
        if args.source is not None:
            body["source"] = args.source
        body.setdefault("source", "github")
        if "name" not in body:
            raise UsageError("--name is required")
    source_config = dict(body.get("source_config") or {})
    for flag, key in (
        ("integration_id", "integration_id"),
        ("repo_url", "repo_url"),
        ("deployment_type", "deployment_type"),
        ("build_on_push", "build_on_push"),
        ("custom_url", "custom_url"),
    ):
        if getattr(args, flag) is not None:
            source_config[key] = getattr(args, flag)
    revision_config = dict(body.get("source_revision_config") or {})
    for flag, key in (
        ("repo_ref", "repo_ref"),
        ("config_path", "langgraph_config_path"),
        ("image_uri", "image_uri"),
    ):
        if getattr(args, flag) is not None:
            if key == "langgraph_config_path":
                revision_config.pop("graph_config_path", None)
            revision_config[key] = getattr(args, flag)
    if source_config:
        body["source_config"] = source_config
    if revision_config:
        body["source_revision_config"] = revision_config
    if args.secret:
        body["secrets"] = _secrets(args.secret)
    return body


def _shown(text: str) -> str:
    """``text`` as a terminal may show it: a server's words reach it in error messages and
    statuses, and control characters (ESC sequences that recolour, retitle or rewrite the
    terminal) are written as escapes instead."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == "\n" else repr(c)[1:-1] for c in text)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def _progress(update: WaitProgress) -> None:
    marker = "->" if update.changed else "  "
    print(
        f"[{update.elapsed:7.1f}s] {marker} revision {_shown(str(update.revision_id))}: "
        f"{_shown(str(update.status))}",
        file=sys.stderr,
        flush=True,
    )


def _wait_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "poll_interval": args.poll_interval,
        "timeout": args.timeout,
        "on_progress": _progress,
    }


async def _create(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    deployment = await client.create_deployment(_body_from_flags(args, creating=True))
    if args.wait:
        await client.wait_for_revision(
            deployment["id"], deployment["latest_revision_id"], **_wait_kwargs(args)
        )
        deployment = await client.get_deployment(deployment["id"])
    return deployment


async def _list(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    return await client.list_deployments(
        limit=args.limit, offset=args.offset, name_contains=args.name_contains
    )


async def _get(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    return await client.get_deployment(args.deployment_id)


async def _update(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    body = _body_from_flags(args, creating=False)
    if not body:
        raise UsageError("nothing to update: give at least one body flag or --body-file")
    deployment = await client.update_deployment(args.deployment_id, body)
    if args.wait:
        await client.wait_for_revision(
            args.deployment_id, deployment["latest_revision_id"], **_wait_kwargs(args)
        )
        deployment = await client.get_deployment(args.deployment_id)
    return deployment


async def _delete(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    await client.delete_deployment(args.deployment_id)
    print(f"deleted deployment {args.deployment_id}", file=sys.stderr)
    return None


async def _revisions(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    if args.revision:
        return await client.get_revision(args.deployment_id, args.revision)
    return await client.list_revisions(args.deployment_id, limit=args.limit, offset=args.offset)


async def _redeploy(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    deployment = await client.redeploy_revision(args.deployment_id, args.revision_id)
    if args.wait:
        await client.wait_for_revision(
            args.deployment_id, deployment["latest_revision_id"], **_wait_kwargs(args)
        )
        deployment = await client.get_deployment(args.deployment_id)
    return deployment


async def _wait(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    revision_id = args.revision
    if not revision_id:
        revision_id = (await client.get_deployment(args.deployment_id))["latest_revision_id"]
    return await client.wait_for_revision(args.deployment_id, revision_id, **_wait_kwargs(args))


async def _quickstart(args: argparse.Namespace, client: ControlPlaneClient) -> Any:
    create_body = _body_from_flags(args, creating=True)
    patch_config = dict(create_body.get("source_revision_config") or {})
    patch_config.pop("graph_config_path", None)
    for flag, key in (
        ("patch_repo_ref", "repo_ref"),
        ("patch_config_path", "langgraph_config_path"),
        ("patch_image_uri", "image_uri"),
    ):
        if getattr(args, flag) is not None:
            patch_config[key] = getattr(args, flag)
    result = await run_quickstart(
        client,
        create_body,
        {"source_revision_config": patch_config},
        delete=not args.keep,
        on_step=lambda message: print(_shown(message), file=sys.stderr, flush=True),
        **_wait_kwargs(args),
    )
    return {
        "deployment_id": result.deployment["id"],
        "first_revision": {
            "id": result.first_revision["id"],
            "status": result.first_revision["status"],
        },
        "second_revision": {
            "id": result.second_revision["id"],
            "status": result.second_revision["status"],
        },
        "deleted": result.deleted,
    }


def _runner(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            settings = ClientSettings.resolve(
                os.environ, base_url=args.url, api_key=args.api_key, tenant_id=args.tenant_id
            )
        except ValueError as exc:
            print(f"error: {_shown(str(exc))}", file=sys.stderr)
            return 2

        async def main() -> Any:
            async with ControlPlaneClient.from_settings(
                settings, request_timeout=args.request_timeout
            ) as client:
                return await command(args, client)

        try:
            result = asyncio.run(main())
        except (UsageError, ValueError) as exc:  # ValueError: an id that is not one
            print(f"error: {_shown(str(exc))}", file=sys.stderr)
            return 2
        except ControlPlaneError as exc:
            print(f"error: {_shown(str(exc))}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        if result is not None:
            _print_json(result)
        return 0

    return run
