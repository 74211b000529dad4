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


def hash_api_key(api_key: str | bytes) -> str:
    """Return the SHA-256 hex digest under which ``api_key`` (text is UTF-8) is stored."""
    raw = api_key if isinstance(api_key, bytes) else api_key.encode("utf-8")
    return hashlib.sha256(raw).hexdigest()


def api_key_bytes(header_value: str) -> bytes | None:
    """The presented key as UTF-8 bytes, or None when no credential can match it: it is not
    valid UTF-8 (aiohttp decodes header bytes with ``surrogateescape``, so undecodable bytes
    arrive as lone surrogates) or it is longer than ``MAX_API_KEY_BYTES`` bytes."""
    try:
        raw = header_value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return raw if len(raw) <= MAX_API_KEY_BYTES else None


def is_hex_digest(value: str) -> bool:
    """True when ``value`` is a lower-case SHA-256 hex digest."""
    return bool(_HEX_DIGEST.match(value))


def is_valid_tenant_id(value: str) -> bool:
    """True when ``value`` has the shape of a tenant (workspace) id."""
    return bool(_TENANT_ID.match(value))


def find_credential(credentials: tuple[Credential, ...], api_key: str | bytes) -> Credential | None:
    """Return the credential whose digest matches ``api_key`` (None for text that is not
    encodable UTF-8).

    Every stored digest is compared (no early exit) with ``hmac.compare_digest`` so the
    time taken does not reveal which, or how much of, a digest matched.
    """
    try:
        presented = hash_api_key(api_key).encode("ascii")
    except UnicodeEncodeError:
        return None
    found: Credential | None = None
    for credential in credentials:
        if hmac.compare_digest(presented, credential.key_sha256.encode("ascii")):
            found = credential
    return found
