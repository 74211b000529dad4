"""``gateway serve``: one process, or a supervisor and its workers. The choice is made
here, above both, so neither ``gateway.app`` (one process's wiring) nor ``gateway.workers``
(the supervisor, which forks processes running ``gateway.app``) imports the other back."""

from __future__ import annotations

from gateway.app import check_start, prepare_workers, run_one
from gateway.settings import Settings
from gateway.workers import supervise


def run(settings: Settings) -> int:
    """Entry point of ``gateway serve``: its exit status."""
    refused = check_start(settings)
    if refused is not None:
        return refused
    if settings.workers == 1:
        return run_one(settings)
    return supervise(settings, prepare_workers(settings))
