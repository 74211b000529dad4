"""API-key credentials of the control plane: hashing and constant-time lookup.

Keys are only ever held as SHA-256 digests. API keys are long random tokens, so a plain
digest (rather than a slow password hash) is enough to make a leaked config or database
useless for logging in, and it lets operators compute the digest with any tool.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

_HEX_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_TENANT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
MAX_API_KEY_BYTES = 512


@dataclass(frozen=True)
class Credential:
    """One API key (as its SHA-256 hex digest) and the tenants it may act on."""

    key_sha256: str
    tenant_ids: frozenset[str]
    label: str = ""


def hash_api_key(api_key: str) -> str:
    """Return the SHA-256 hex digest under which ``api_key`` is stored."""
    return hashlib.sha256(api_key.encode("utf-8")).hexdigest()


def is_hex_digest(value: str) -> bool:
    """True when ``value`` is a lower-case SHA-256 hex digest."""
    return bool(_HEX_DIGEST.match(value))


def is_valid_tenant_id(value: str) -> bool:
    """True when ``value`` has the shape of a tenant (workspace) id."""
    return bool(_TENANT_ID.match(value))


def find_credential(credentials: tuple[Credential, ...], api_key: str) -> Credential | None:
    """Return the credential whose digest matches ``api_key``.

    Every stored digest is compared (no early exit) with ``hmac.compare_digest`` so the
    time taken does not reveal which, or how much of, a digest matched.
    """
    presented = hash_api_key(api_key).encode("ascii")
    found: Credential | None = None
    for credential in credentials:
        if hmac.compare_digest(presented, credential.key_sha256.encode("ascii")):
            found = credential
    return found
