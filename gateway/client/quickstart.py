"""The service description's quick-start: create, read, wait, patch, wait, delete."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .api import (
    DEFAULT_POLL_INTERVAL,
    DEFAULT_WAIT_TIMEOUT,
    ControlPlaneClient,
    ProgressCallback,
)
from .errors import ControlPlaneError


@dataclass(frozen=True)
class QuickstartResult:
    """What the sequence produced."""

    deployment: dict[str, Any]
    first_revision: dict[str, Any]
    second_revision: dict[str, Any]
    deleted: bool


async def run_quickstart(
    client: ControlPlaneClient,
    create_body: Mapping[str, Any],
    patch_body: Mapping[str, Any],
    *,
    poll_interval: float = DEFAULT_POLL_INTERVAL,
    timeout: float = DEFAULT_WAIT_TIMEOUT,  # noqa: ASYNC109 - the documented wait contract
    on_progress: ProgressCallback | None = None,
    on_step: Callable[[str], None] | None = None,
    delete: bool = True,
) -> QuickstartResult:
    """Run the quick-start; any unexpected answer raises :class:`ControlPlaneError`.

    The new revision after the PATCH is the ``latest_revision_id`` of the PATCH's answer
    (exact even when other writers add revisions meanwhile); only when the answer lacks it
    is it taken as the first entry of the revision list, as the description specifies.
    On failure the deployment is left in place so it can
    be inspected; its id is in the error message.
    """

    def step(message: str) -> None:
        if on_step is not None:
            on_step(message)

    created = await client.create_deployment(create_body)
    deployment_id = _field(created, "id")
    first_id = _field(created, "latest_revision_id")
    step(f"created deployment {deployment_id} (revision {first_id})")
    try:
        deployment = await client.get_deployment(deployment_id)
        step(f"read deployment {deployment_id}: status {deployment.get('status')}")
        first = await client.wait_for_revision(
            deployment_id,
            _field(deployment, "latest_revision_id"),
            poll_interval=poll_interval,
            timeout=timeout,
            on_progress=on_progress,
        )
        step(f"revision {first['id']} DEPLOYED")
        patched = await client.update_deployment(deployment_id, patch_body)
        second_id = await _new_revision_id(client, deployment_id, patched)
        step(f"patched deployment {deployment_id}; latest revision {second_id}")
        second = await client.wait_for_revision(
            deployment_id,
            second_id,
            poll_interval=poll_interval,
            timeout=timeout,
            on_progress=on_progress,
        )
        step(f"revision {second_id} DEPLOYED")
    except ControlPlaneError as exc:
        _add_context(exc, deployment_id)
        raise
    if delete:
        await client.delete_deployment(deployment_id)
        step(f"deleted deployment {deployment_id}")
    return QuickstartResult(deployment, first, second, delete)


async def _new_revision_id(
    client: ControlPlaneClient, deployment_id: str, patched: Mapping[str, Any]
) -> str:
    latest = patched.get("latest_revision_id")
    if isinstance(latest, str) and latest:
        return latest
    revisions = await client.list_revisions(deployment_id)
    resources = revisions.get("resources")
    if not isinstance(resources, list) or not resources or not isinstance(resources[0], dict):
        raise ControlPlaneError(f"revision list of {deployment_id} is empty after PATCH")
    return _field(resources[0], "id")


def _add_context(exc: ControlPlaneError, deployment_id: str) -> None:
    exc.args = (f"{exc.args[0]} (deployment {deployment_id} left in place)",)


def _field(obj: Mapping[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise ControlPlaneError(f"response has no {name!r}: {str(dict(obj))[:500]}")
    return value
