"""Built-in deployments control plane: deployments, revisions, listeners, auth service and
integrations, emulating the hosted API on a local SQLite file."""

from __future__ import annotations

from .app import create_control_plane_app
from .config import ControlPlaneConfig, bootstrap_credentials

__all__ = ["ControlPlaneConfig", "bootstrap_credentials", "create_control_plane_app"]
