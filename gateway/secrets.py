"""The per-deployment secret that keys identity hashes."""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

log = logging.getLogger("gateway")

SECRET_FILE = "identity-secret"  # noqa: S105 - a file name, not a secret


def existing_identity_secret(configured: str | None, data_dir: Path) -> tuple[bytes, str] | None:
    """The secret ``identity_secret`` would return and where it comes from, read only
    (``gateway rules explain``: explaining never makes one); None when there is none yet."""
    if configured:
        return configured.encode(), "identity_secret"
    path = data_dir / SECRET_FILE
    if path.is_file():
        return path.read_bytes().strip(), str(path)
    return None


def identity_secret(configured: str | None, data_dir: Path) -> bytes:
    """The configured secret, else one kept (mode 0600) in the data dir, made on first use.

    Every instance that shares counters must use the same secret, or one API key would
    hash to different counters on different instances: set ``GATEWAY_IDENTITY_SECRET``.
    """
    found = existing_identity_secret(configured, data_dir)
    if found is not None:
        return found[0]
    path = data_dir / SECRET_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    value = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as handle:
        handle.write(value)
    log.info("created a new identity-hash secret in %s", path)
    return value
