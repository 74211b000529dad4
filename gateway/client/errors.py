"""Errors raised by the control-plane client."""

from __future__ import annotations

from typing import Any


class ControlPlaneError(Exception):
    """A call did not answer as expected: unexpected status (``status`` and the response
    ``text`` are kept), or the control plane could not be reached (``status`` is None)."""

    def __init__(self, message: str, *, status: int | None = None, text: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.text = text


class RevisionFailed(ControlPlaneError):
    """The revision reached a status containing ``FAILED`` (or was interrupted)."""

    def __init__(self, message: str, revision: dict[str, Any]) -> None:
        super().__init__(message, status=200)
        self.revision = revision


class RevisionWaitTimeout(ControlPlaneError):
    """The revision was not DEPLOYED within the wait timeout."""

    def __init__(self, message: str, last_status: str | None) -> None:
        super().__init__(message)
        self.last_status = last_status
