"""The emulated revision lifecycle: the status sequence and the background driver.

The built-in control plane cannot build images, so it plays the hosted service's sequence
``CREATING → QUEUED → AWAITING_BUILD → BUILDING → AWAITING_DEPLOY → DEPLOYING → DEPLOYED``,
one status per ``revision_step_seconds``. A revision whose input cannot build ends in
``BUILD_FAILED`` when its build step is reached. Progress lives in SQLite (the time of the
last status change), so a revision in flight when the process stops resumes after restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.upstreams.http_api.log_safety import exception_summary
from gateway.upstreams.postgres.connection import DatabaseUnavailable

from .rules import build_problem

log = logging.getLogger("gateway.control_plane.lifecycle")

REVISION_FLOW = (
    "CREATING",
    "QUEUED",
    "AWAITING_BUILD",
    "BUILDING",
    "AWAITING_DEPLOY",
    "DEPLOYING",
    "DEPLOYED",
)
IN_FLIGHT = REVISION_FLOW[:-1]
TERMINAL = ("DEPLOYED", "BUILD_FAILED", "DEPLOY_FAILED", "CREATE_FAILED", "INTERRUPTED")
# The longest the driver sleeps without looking, so a file shared with other worker
# processes (whose new revisions do not wake this one) is still served promptly.
MAX_IDLE_SECONDS = 1.0


def next_step(
    status: str,
    source: str,
    source_config: Mapping[str, Any],
    revision_config: Mapping[str, Any],
) -> tuple[str, str | None]:
    """The status after ``status`` and its message (the failure reason, if any)."""
    if status == "BUILDING":
        problem = build_problem(source, source_config, revision_config)
        if problem is not None:
            return "BUILD_FAILED", problem
    index = REVISION_FLOW.index(status)
    return REVISION_FLOW[index + 1], None


AdvanceFn = Callable[[float, float], Awaitable[tuple[int, float | None]]]


class LifecycleDriver:
    """Background task that advances due revisions, then sleeps until the next is due."""

    def __init__(self, advance: AdvanceFn, step_seconds: float, clock: Callable[[], float]) -> None:
        self._advance = advance
        self._step = step_seconds
        self._clock = clock
        self._wake = asyncio.Event()

    def wake(self) -> None:
        """Look again now (a revision was created)."""
        self._wake.set()

    async def run(self) -> None:
        """Loop until cancelled; a failing pass is logged and retried, never fatal."""
        while True:
            self._wake.clear()
            delay = MAX_IDLE_SECONDS
            try:
                now = self._clock()
                _, next_due = await self._advance(now, self._step)
                if next_due is not None:
                    delay = min(delay, max(0.0, next_due - self._clock()))
            except asyncio.CancelledError:
                raise
            except DatabaseUnavailable:
                # The database breaker logged the outage (once): no traceback a second.
                log.debug("revision lifecycle pass skipped: the database is unavailable")
            except Exception as exc:
                # Type and frames only: a message may quote stored configuration.
                log.error("revision lifecycle pass failed; retrying: %s", exception_summary(exc))
            if delay <= 0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=delay)
