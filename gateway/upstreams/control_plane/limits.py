"""The control plane's bounds on what one tenant may store and read back at once.

Every free-form JSON field a tenant writes is bounded in size (``max_json_field_bytes``);
each tenant may hold a bounded number of deployments, listeners, OAuth providers and pending
auth flows (refused past the quota: 409, or 429 for pending flows, which expire on their
own); each deployment keeps a bounded number of revisions (the oldest finished ones are
pruned, never the active one or one in progress) and each tenant a bounded number of
completed auth flows; and a list answer holds a bounded number of bytes (422, ask for a
smaller ``limit``). Counting and inserting happen in one write transaction, which both
backends serialise, so concurrent requests cannot exceed a quota.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.upstreams.http_api.problems import InvalidRequest

from .rows import canonical_json

# The free-form objects of a deployment's source_config: any JSON a tenant likes.
FREE_FORM_FIELDS = ("resource_spec", "listener_config")


@dataclass(frozen=True)
class Limits:
    """The bounds; the defaults are the documented ones (docs/control-plane.md)."""

    max_json_field_bytes: int = 64 * 1024
    max_answer_bytes: int = 8 * 1024 * 1024
    max_deployments_per_tenant: int = 100
    max_revisions_per_deployment: int = 50
    max_listeners_per_tenant: int = 100
    max_auth_providers_per_tenant: int = 100
    max_pending_auth_flows_per_tenant: int = 1000
    max_completed_auth_flows_per_tenant: int = 1000


# Each setting's (smallest, largest) value.
RANGES: Mapping[str, tuple[int, int]] = {
    "max_json_field_bytes": (256, 16 * 1024 * 1024),
    "max_answer_bytes": (64 * 1024, 1024 * 1024 * 1024),
    "max_deployments_per_tenant": (1, 1_000_000),
    "max_revisions_per_deployment": (1, 1_000_000),
    "max_listeners_per_tenant": (1, 1_000_000),
    "max_auth_providers_per_tenant": (1, 1_000_000),
    "max_pending_auth_flows_per_tenant": (1, 1_000_000),
    "max_completed_auth_flows_per_tenant": (1, 1_000_000),
}


class Refused(Exception):
    """A request refused by a bound (a quota reached, an answer too large): answered with
    ``status`` and ``{"detail": detail}``."""

    def __init__(self, status: int, detail: str, headers: Mapping[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = dict(headers or {})


def quota_reached(count: int, noun: str, setting: str, remedy: str) -> Refused:
    """409: the tenant holds ``count`` of ``noun``, the most ``setting`` allows."""
    return Refused(
        409,
        f"quota reached: this tenant has {count} {noun}, the most allowed "
        f"(control_plane.{setting}); {remedy}",
    )


def answer_too_large(limit: int) -> Refused:
    """422: a page of a list would hold more than ``limit`` bytes."""
    return Refused(
        422,
        f"limit: the page asked for would hold more than {limit} bytes "
        "(control_plane.max_answer_bytes); ask for a smaller limit (a page of one resource "
        "is always answered)",
    )


def json_size(value: object) -> int:
    """The bytes ``value`` takes as stored: compact UTF-8 JSON."""
    return len(canonical_json(value).encode("utf-8"))


def check_free_form_fields(source_config: Mapping[str, Any], limit: int) -> None:
    """422 naming the field when a free-form field of ``source_config`` is over ``limit``."""
    for name in FREE_FORM_FIELDS:
        value = source_config.get(name)
        if value is None:
            continue
        size = json_size(value)
        if size > limit:
            raise InvalidRequest(
                f"source_config.{name}: must be at most {limit} bytes as compact JSON, got "
                f"{size} (control_plane.max_json_field_bytes); keep large data out of the "
                "deployment's configuration"
            )


def retry_after(seconds: float) -> dict[str, str]:
    """A ``Retry-After`` header of at least one whole second."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
