"""Client of the deployments control plane: a Python API and the ``gateway deployments`` CLI."""

from __future__ import annotations

from .api import ClientSettings, ControlPlaneClient, WaitProgress
from .errors import ControlPlaneError, RevisionFailed, RevisionWaitTimeout
from .quickstart import QuickstartResult, run_quickstart

__all__ = [
    "ClientSettings",
    "ControlPlaneClient",
    "ControlPlaneError",
    "QuickstartResult",
    "RevisionFailed",
    "RevisionWaitTimeout",
    "WaitProgress",
    "run_quickstart",
]
