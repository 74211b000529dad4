"""Verification keys: a JWKS document or a PEM public key, made into a ``KeySet``.

Each key is bound to the algorithms its own type can verify (RSA: RS*/PS*, an EC key:
the one ES* of its curve, Ed25519/Ed448: EdDSA), narrowed to the configured ones and to
the JWK's own ``alg`` when it names one. A token is then checked only with an algorithm
its key was made for, which is what defeats algorithm confusion; symmetric (``oct``)
keys are never loaded at all. No network here: ``jwks_fetch`` brings the bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
from jwt.algorithms import ECAlgorithm, OKPAlgorithm, RSAAlgorithm

MAX_JWKS_BYTES: Final = 512 * 1024
MAX_KEYS: Final = 100
# Signature checks one token may cost at most: a token whose kid names no key, or that
# names none, was checked against every key without a kid (or every key), so a JWKS of
# many such keys let each random token cost ~100 RSA verifications (~12 ms) before any
# counting; keys without a kid past this many are skipped at load, and said.
MAX_KEYS_TRIED: Final = 4
MIN_RSA_BITS: Final = 2048
RSA_ALGORITHMS: Final = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"})
_CURVE_ALGORITHM: Final = {"secp256r1": "ES256", "secp384r1": "ES384", "secp521r1": "ES512"}
# Members a private JWK has and a public one must not: a JWKS that publishes them has
# given its signing key away, and anyone could mint tokens with it.
_PRIVATE_MEMBERS: Final = frozenset({"d", "p", "q", "dp", "dq", "qi", "k"})

_LOADERS: Final[dict[str, Callable[[dict[str, Any]], Any]]] = {
    "RSA": RSAAlgorithm.from_jwk,
    "EC": ECAlgorithm.from_jwk,
    "OKP": OKPAlgorithm.from_jwk,
}

PublicKey: TypeAlias = (
    rsa.RSAPublicKey | ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | ed448.Ed448PublicKey
)


class JwksError(ValueError):
    """A key document is unusable as a whole (the previous keys should stay)."""


@dataclass(frozen=True, slots=True)
class VerificationKey:
    kid: str | None
    algorithms: frozenset[str]  # never empty
    key: PublicKey


@dataclass(frozen=True, slots=True)
class KeySet:
    keys: tuple[VerificationKey, ...]
    digest: str  # SHA-256 of the document: a refresh that changes nothing is a no-op
    skipped: tuple[str, ...] = ()  # why some entries were not loaded (kid and reason)

    def for_kid(self, kid: str | None) -> tuple[VerificationKey, ...]:
        """The keys a token with this ``kid`` may be checked with, in the order to try
        them: those with that kid, else those with none (a PEM key claims no id); for a
        token without one, the keys without one first, then the others (a rotation
        may overlap an old key without a kid and a new one with). The caller checks at
        most MAX_KEYS_TRIED of those made for the token's algorithm. Empty: the kid is
        unknown."""
        unnamed = tuple(k for k in self.keys if k.kid is None)
        if kid is None:
            return unnamed + tuple(k for k in self.keys if k.kid is not None)
        return tuple(k for k in self.keys if k.kid == kid) or unnamed


def parse_jwks(data: bytes, algorithms: Collection[str]) -> KeySet:
    """The usable keys of a JWKS document (``{"keys": [...]}``). Entries that cannot
    verify a configured algorithm are skipped (and said in ``skipped``); a document with
    no usable key at all, or that is not a JWKS, raises ``JwksError``."""
    if len(data) > MAX_JWKS_BYTES:
        raise JwksError(f"JWKS over {MAX_JWKS_BYTES} bytes")
    try:
        # UTF-8 only (RFC 8259, RFC 7517): json.loads given bytes would guess UTF-16 or
        # UTF-32 and decode with surrogatepass (a kid with a lone surrogate).
        doc = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise JwksError("JWKS is not UTF-8 encoded JSON") from None
    except (ValueError, RecursionError):
        raise JwksError("JWKS is not valid JSON") from None
    items = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(items, list):
        raise JwksError('JWKS is not an object with a "keys" list')
    if len(items) > MAX_KEYS:
        raise JwksError(f"JWKS has {len(items)} keys, more than {MAX_KEYS}")
    keys: list[VerificationKey] = []
    skipped: list[str] = []
    for index, item in enumerate(items, start=1):
        try:
            keys.append(_from_jwk(item, algorithms))
        except JwksError as exc:
            kid = item.get("kid") if isinstance(item, dict) else None
            skipped.append(f"key #{index} (kid {kid!r}): {exc}")
    if not keys:
        raise JwksError(
            "JWKS has no key usable with the configured algorithms: " + "; ".join(skipped)
        )
    unnamed = [k for k in keys if k.kid is None]
    for extra in unnamed[MAX_KEYS_TRIED:]:
        keys.remove(extra)
    if len(unnamed) > MAX_KEYS_TRIED:
        skipped.append(
            f"{len(unnamed) - MAX_KEYS_TRIED} keys without a kid past the first "
            f"{MAX_KEYS_TRIED} (a token is checked against at most {MAX_KEYS_TRIED}: give "
            "every key a kid)"
        )
    for alg in sorted({a for k in keys for a in k.algorithms}):
        reach = sum(alg in k.algorithms for k in keys)
        if reach > MAX_KEYS_TRIED:
            skipped.append(
                f"none skipped, but a {alg} token without a kid is checked against only "
                f"{MAX_KEYS_TRIED} of the {reach} keys for {alg}: give tokens a kid"
            )
    return KeySet(tuple(keys), hashlib.sha256(data).hexdigest(), tuple(skipped))


def load_pem(data: bytes, algorithms: Collection[str]) -> KeySet:
    """A PEM public key, or the public key of a PEM certificate, as a one-key set."""
    if len(data) > MAX_JWKS_BYTES:
        raise JwksError(f"public key file over {MAX_JWKS_BYTES} bytes")
    key: Any
    try:
        if b"-----BEGIN CERTIFICATE-----" in data:
            key = x509.load_pem_x509_certificate(data).public_key()
        else:
            key = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise JwksError(f"not a PEM public key or certificate ({exc})") from None
    usable = _usable_algorithms(key, algorithms)
    if not usable:
        raise JwksError(f"a {_describe(key)} verifies none of {', '.join(sorted(algorithms))}")
    return KeySet((VerificationKey(None, usable, key),), hashlib.sha256(data).hexdigest())


def _from_jwk(item: Any, algorithms: Collection[str]) -> VerificationKey:
    if not isinstance(item, Mapping):
        raise JwksError("not an object")
    kid = item.get("kid")
    if kid is not None and not isinstance(kid, str):
        raise JwksError("kid is not a string")
    if item.get("use", "sig") != "sig":
        raise JwksError(f"use {item.get('use')!r}, not sig")
    ops = item.get("key_ops")
    if ops is not None and (not isinstance(ops, list) or "verify" not in ops):
        raise JwksError("key_ops without verify")
    if _PRIVATE_MEMBERS & set(item):
        raise JwksError("holds private or symmetric key material: refused")
    kty = item.get("kty")
    loader = _LOADERS.get(str(kty))
    if loader is None:
        raise JwksError(f"key type {kty!r} is not an asymmetric signing key")
    try:
        key: Any = loader(dict(item))
    except Exception as exc:  # PyJWT raises several types for a malformed JWK
        raise JwksError(f"malformed {kty} key ({type(exc).__name__})") from None
    usable = _usable_algorithms(key, algorithms)
    alg = item.get("alg")
    if alg is not None:
        usable &= {alg}
    if not usable:
        named = f" (alg {alg!r})" if alg is not None else ""
        raise JwksError(f"a {_describe(key)}{named} verifies none of the configured algorithms")
    return VerificationKey(kid, usable, key)


def _usable_algorithms(key: Any, configured: Collection[str]) -> frozenset[str]:
    allowed: frozenset[str] = frozenset()
    if isinstance(key, rsa.RSAPublicKey):
        # Short RSA keys are factorable by a determined attacker: refuse them outright.
        allowed = RSA_ALGORITHMS if key.key_size >= MIN_RSA_BITS else frozenset()
    elif isinstance(key, ec.EllipticCurvePublicKey):
        name = _CURVE_ALGORITHM.get(key.curve.name)
        allowed = frozenset({name}) if name else frozenset()
    elif isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        allowed = frozenset({"EdDSA"})
    return allowed & frozenset(configured)


def _describe(key: Any) -> str:
    if isinstance(key, rsa.RSAPublicKey):
        return f"{key.key_size}-bit RSA key"
    if isinstance(key, ec.EllipticCurvePublicKey):
        return f"EC key on {key.curve.name}"
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return "EdDSA key"
    return f"{type(key).__name__} (not a public key)"
