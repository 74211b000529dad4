"""One access-log line per request, plain or JSON. Never a raw key, user id or query."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass

log = logging.getLogger("gateway.access")


@dataclass(slots=True)
class AccessRecord:
    method: str
    path: str  # the normalised path, without the query string (queries may carry secrets)
    status: int
    region: str
    client: str
    rule: str | None = None
    decision: str | None = None
    identity: str | None = None  # "<kind>:<first 12 hex of the keyed hash>"
    upstream: str | None = None
    duration_ms: float = 0.0
    upstream_ms: float | None = None
    request_id: str | None = None


class AccessLogger:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    def emit(self, record: AccessRecord) -> None:
        if self.mode == "off" or not log.isEnabledFor(logging.INFO):
            return
        if self.mode == "json":
            log.info(json.dumps(asdict(record), separators=(",", ":")))
            return
        upstream_ms = "-" if record.upstream_ms is None else f"{record.upstream_ms:.1f}"
        log.info(
            '%s "%s %s" %d region=%s rule=%s decision=%s id=%s upstream=%s '
            "dur_ms=%.1f upstream_ms=%s rid=%s",
            record.client,
            record.method,
            record.path,
            record.status,
            record.region,
            record.rule or "-",
            record.decision or "-",
            record.identity or "-",
            record.upstream or "-",
            record.duration_ms,
            upstream_ms,
            record.request_id or "-",
        )
