"""Verified users: JWTs checked against the configured keys, with PyJWT.

``verify()`` is synchronous and runs on the request path, so it never waits for the
network: keys come from a file at start or from a JWKS fetched by ``start()`` and
refreshed by ``run()`` in the background; an unknown ``kid`` only asks ``run()`` for a
refresh (at most once per interval) and fails the token now. When the JWKS cannot be
fetched the last good keys stay in use. A token that verified is cached by its SHA-256
until it expires, and one that failed for a short while, so a repeated token costs a
dict lookup instead of a signature check.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeGuard

import aiohttp
import jwt

from gateway.identity.config import JwtConfig
from gateway.identity.jwks import (
    MAX_JWKS_BYTES,
    MAX_KEYS_TRIED,
    JwksError,
    KeySet,
    load_pem,
    parse_jwks,
)
from gateway.identity.jwks_fetch import JwksFetcher, JwksFetchError
from gateway.identity.keys import valid_name
from gateway.identity.verify_budget import VerifyBudget
from gateway.urls import display_url

log = logging.getLogger("gateway.identity")

MAX_TOKEN_BYTES: Final = 8192
MAX_USER_BYTES: Final = 256
VERIFIED_CACHE_SIZE: Final = 100_000
FAILED_CACHE_SIZE: Final = 10_000
FAILED_CACHE_SECONDS: Final = 10.0
# After a failed refresh, try again sooner than the normal interval.
RETRY_SECONDS: Final = 30.0
REASONS: Final = frozenset(
    {
        "signature",
        "expired",
        "not_yet_valid",
        "issuer",
        "audience",
        "unknown_kid",
        "algorithm",
        "malformed",
        "no_keys",
        "claim",
        "throttled",  # not verified: the client's budget of failed verification is spent
    }
)
# A not-yet-valid token becomes valid by itself: remembering its failure would refuse it
# for a while after its nbf.
_NOT_REMEMBERED: Final = frozenset({"not_yet_valid"})
# RFC 6750 2.1: credentials = "Bearer" 1*SP b64token, the scheme case-insensitive.
_BEARER = re.compile(rb"[Bb][Ee][Aa][Rr][Ee][Rr] +([A-Za-z0-9\-._~+/]+=*)")


class InvalidToken(Exception):
    """A token that does not verify. ``reason`` is one of ``REASONS``: short and fixed,
    for metrics and log lines (which never carry the token)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class VerifiedUser:
    user: str  # the configured claim (sub by default)
    tier: str | None  # the tier claim, when configured and present
    expires: float  # exp, seconds since the epoch


@dataclass(slots=True)
class VerifierStats:
    """Plain counters, for metrics collected at scrape time."""

    signature_checks: int = 0
    failed_seconds: float = 0.0  # CPU time of verifications that failed (VerifyBudget)
    throttled: int = 0  # tokens not verified: their client's budget was spent
    cache_hits: int = 0
    failure_cache_hits: int = 0
    refreshes: int = 0
    refresh_failures: int = 0


def bearer_token(header_value: bytes) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value, or None when the value
    is not exactly that (another scheme, a space inside, characters outside token68)."""
    match = _BEARER.fullmatch(header_value)
    return None if match is None else match.group(1).decode("ascii")


class JwtVerifier:
    """Verifies tokens for one ``identity.user.jwt`` configuration."""

    def __init__(
        self,
        config: JwtConfig,
        *,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.time,
        kid_refresh_seconds: float | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        """Key files are read now (``JwksError`` or ``OSError`` if unusable); a JWKS URL
        is fetched by ``start()``. ``session``: the process's HTTP client, if it has one."""
        self.config = config
        self.stats = VerifierStats()
        self.last_error: str | None = None
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._leeway = config.leeway_seconds
        self._algorithms = frozenset(config.algorithms)
        self._audience = list(config.audience)
        self._kid_refresh_seconds = (
            config.jwks_refresh_seconds if kid_refresh_seconds is None else kid_refresh_seconds
        )
        # exp and nbf are checked below against the injected clock, so that the cache and
        # the checks agree on what "now" is; PyJWT checks the signature, iss and aud.
        self._decoder = jwt.PyJWT(
            options={"verify_exp": False, "verify_nbf": False, "verify_iat": False}
        )
        self._fetcher = (
            JwksFetcher(config.jwks_url, session) if config.jwks_url is not None else None
        )
        self._keys: KeySet | None = None
        self._verified: dict[bytes, VerifiedUser] = {}
        self._failed: dict[bytes, tuple[str, float]] = {}
        self._wake = asyncio.Event()
        self._kid_refresh_at = -math.inf
        self._last_refresh_ok = False
        self._refresh_lock = asyncio.Lock()
        # Counts the key sets installed: a cache of verdicts kept elsewhere is stale once
        # it moves (a removed key's tokens must stop working at once).
        self.generation = 0
        self.budget = VerifyBudget(
            config.max_failed_verify_ms_per_client / 1000, config.max_failed_verify_ms / 1000
        )
        if self._fetcher is None:
            self._install(self._parse(self._read_file()))
            self._last_refresh_ok = True

    @property
    def keys(self) -> KeySet | None:
        """The keys in use (None: a JWKS URL not fetched successfully yet)."""
        return self._keys

    @property
    def source(self) -> str:
        """Where the keys come from, for logs and ``/info`` (a URL without credentials)."""
        url = self.config.jwks_url
        if url:
            return display_url(url)
        return str(self.config.jwks_file or self.config.public_key_file)

    # -- the request path --------------------------------------------------------------

    def verify(self, token: str, client: str = "") -> VerifiedUser:
        """The user of a valid token; ``InvalidToken(reason)`` otherwise. ``client``: the
        address a failed verification's CPU time is charged to (``VerifyBudget``); a token
        this verifier knows the verdict of costs nothing and is answered whatever the
        budget."""
        if len(token) > MAX_TOKEN_BYTES or not token.isascii():
            raise InvalidToken("malformed")  # not cached: hashing it is the cost we avoid
        # Cached under the token's hash: bounded memory per entry, and no bearer token
        # kept in clear in the process.
        digest = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        user = self._verified.get(digest)
        if user is not None:
            if now < user.expires + self._leeway:
                self.stats.cache_hits += 1
                return user
            del self._verified[digest]
        failed = self._failed.get(digest)
        if failed is not None:
            if now < failed[1]:
                self.stats.failure_cache_hits += 1
                raise InvalidToken(failed[0])
            del self._failed[digest]
        budget = self.budget
        if not budget.allows(client, now):
            self.stats.throttled += 1
            raise InvalidToken("throttled")  # not remembered: the token was not verified
        started = self._cpu_clock()
        try:
            user = self._verify_uncached(token, now)
        except InvalidToken as exc:
            # All of it charged: parsing (PyJWT's pure-Python base64 pass, once per key
            # tried) costs as much as the signature checks, and fails before them too.
            spent = self._cpu_clock() - started
            self.stats.failed_seconds += spent
            budget.spend(client, spent, now)
            if exc.reason not in _NOT_REMEMBERED:
                until = now + FAILED_CACHE_SECONDS
                _bounded_put(self._failed, digest, (exc.reason, until), FAILED_CACHE_SIZE)
            raise
        _bounded_put(self._verified, digest, user, VERIFIED_CACHE_SIZE)
        return user

    def _verify_uncached(self, token: str, now: float) -> VerifiedUser:
        keys = self._keys
        if keys is None:
            raise InvalidToken("no_keys")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidToken("malformed") from None
        alg, kid = header.get("alg"), header.get("kid")
        # The allow-list is the configuration, never the token: "none" and HS* are not
        # in it, whatever the header says (RFC 8725 2.1, 3.1).
        if not isinstance(alg, str) or alg not in self._algorithms:
            raise InvalidToken("algorithm")
        if kid is not None and not isinstance(kid, str):
            raise InvalidToken("malformed")
        if "crit" in header:
            # RFC 7515 4.1.11: a critical extension not understood must be refused, and
            # none is understood here.
            raise InvalidToken("malformed")
        candidates = keys.for_kid(kid)
        if not candidates:
            self._request_refresh(now)
            raise InvalidToken("unknown_kid")
        # Only keys made for this algorithm: an RSA key never checks an ES* or HS*
        # signature, a P-256 key only ES256.
        # At most MAX_KEYS_TRIED signature checks a token, whatever the key set: random
        # tokens must not each cost dozens of them (parse_jwks says at load when a token
        # without a kid could not reach every key).
        usable = [k for k in candidates if alg in k.algorithms][:MAX_KEYS_TRIED]
        if not usable:
            raise InvalidToken("algorithm")
        for key in usable:
            self.stats.signature_checks += 1
            try:
                claims = self._decoder.decode(
                    token,
                    key=key.key,
                    algorithms=[alg],
                    audience=self._audience,
                    issuer=self.config.issuer,
                )
            except jwt.InvalidSignatureError:
                continue  # without a kid, the next key may be the one
            except jwt.PyJWTError as exc:
                raise InvalidToken(_reason(exc)) from None
            return self._user(claims, now)
        raise InvalidToken("signature")

    def _user(self, claims: dict[str, Any], now: float) -> VerifiedUser:
        exp = claims.get("exp")
        if not _is_time(exp):
            raise InvalidToken("claim")  # exp is required: no token lives forever
        if exp <= now - self._leeway:
            raise InvalidToken("expired")
        nbf = claims.get("nbf")
        if nbf is not None:
            if not _is_time(nbf):
                raise InvalidToken("claim")
            if nbf > now + self._leeway:
                raise InvalidToken("not_yet_valid")
        user = claims.get(self.config.claim)
        # The same bounds as an x-user-id header; isprintable also refuses lone
        # surrogates, which could not be encoded for hashing.
        if (
            not isinstance(user, str)
            or not user
            or not user.isprintable()
            or len(user.encode()) > MAX_USER_BYTES
        ):
            raise InvalidToken("claim")
        tier = None
        if self.config.tier_claim is not None:
            raw = claims.get(self.config.tier_claim)
            if raw is not None and (not isinstance(raw, str) or not valid_name(raw)):
                raise InvalidToken("claim")
            tier = raw
        return VerifiedUser(user=user, tier=tier, expires=float(exp))

    def _request_refresh(self, now: float) -> None:
        # A token with a new kid may mean the IdP rotated its keys; but anyone can send
        # any kid, so the refresh it asks for is rate-limited.
        if now - self._kid_refresh_at >= self._kid_refresh_seconds:
            self._kid_refresh_at = now
            self._wake.set()

    def clear_cache(self) -> None:
        self._verified.clear()
        self._failed.clear()

    # -- keys, off the request path ------------------------------------------------------

    async def start(self) -> bool:
        """Fetch the JWKS (URL mode) once. Never raises for an unreachable IdP: True when
        keys are in place; otherwise tokens fail with "no_keys" until ``run()`` gets
        them, and ``last_error`` says why."""
        if self._fetcher is None:
            return True
        return await self.refresh()

    async def refresh(self) -> bool:
        """Fetch or re-read the keys now. On any failure the current keys stay (an IdP
        outage must not turn into refusing every user) and False is returned."""
        async with self._refresh_lock:
            try:
                if self._fetcher is not None:
                    data = await self._fetcher.fetch()
                else:
                    data = await asyncio.to_thread(self._read_file)
                keys = self._parse(data)
            except (JwksError, JwksFetchError, OSError) as exc:
                self.last_error = str(exc)
                self._last_refresh_ok = False
                self.stats.refresh_failures += 1
                kept = len(self._keys.keys) if self._keys else 0
                log.warning(
                    "JWT keys not refreshed from %s, keeping the last good ones (%d keys): %s",
                    self.source,
                    kept,
                    exc,
                )
                return False
            self.last_error = None
            self._last_refresh_ok = True
            self.stats.refreshes += 1
            self._install(keys)
            return True

    async def run(self) -> None:
        """Refresh every ``jwks_refresh_seconds`` (sooner after a failure, and when an
        unknown kid asks) until cancelled; an unexpected error is logged, not fatal."""
        while True:
            interval = self.config.jwks_refresh_seconds
            delay = interval if self._last_refresh_ok else min(interval, RETRY_SECONDS)
            with suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            try:
                await self.refresh()
            except Exception:
                log.exception("JWT key refresh from %s failed; still refreshing", self.source)

    async def close(self) -> None:
        if self._fetcher is not None:
            await self._fetcher.close()

    def _install(self, keys: KeySet) -> None:
        previous = self._keys
        if previous is not None and previous.digest == keys.digest:
            return
        self._keys = keys
        # Verdicts were reached with the old keys: a removed key's tokens must stop
        # working, and tokens refused for an unknown kid may now verify. The request
        # path's own cache of verified tokens (gateway.proxy.handler) follows
        # ``generation``.
        self.generation += 1
        self.clear_cache()
        kids = ", ".join(k.kid or "(no kid)" for k in keys.keys)
        log.info(
            "JWT keys %s from %s: %d keys (%s)",
            "loaded" if previous is None else "changed",
            self.source,
            len(keys.keys),
            kids,
        )
        for note in keys.skipped:
            log.warning("JWT keys from %s: skipped %s", self.source, note)

    def _read_file(self) -> bytes:
        path = Path(self.config.jwks_file or self.config.public_key_file or "")
        with open(path, "rb") as handle:
            return handle.read(MAX_JWKS_BYTES + 1)

    def _parse(self, data: bytes) -> KeySet:
        if self.config.public_key_file is not None:
            return load_pem(data, self._algorithms)
        return parse_jwks(data, self._algorithms)


def _reason(exc: jwt.PyJWTError) -> str:
    """PyJWT's exception as one of ``REASONS`` (subclasses before their bases)."""
    if isinstance(exc, jwt.InvalidSignatureError):
        return "signature"
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "expired"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "not_yet_valid"
    if isinstance(exc, jwt.InvalidIssuerError):
        return "issuer"
    if isinstance(exc, jwt.InvalidAudienceError):
        return "audience"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return {"iss": "issuer", "aud": "audience"}.get(exc.claim, "claim")
    if isinstance(exc, jwt.InvalidAlgorithmError | jwt.InvalidKeyError):
        return "algorithm"
    if isinstance(exc, jwt.DecodeError):
        return "malformed"
    return "claim"  # the remaining InvalidTokenErrors are about claims (sub, jti, iat)


def _is_time(value: Any) -> TypeGuard[int | float]:
    # bool is an int to Python; true is not a time.
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _bounded_put(cache: dict[bytes, Any], key: bytes, value: Any, size: int) -> None:
    # Dicts keep insertion order, so the first key is the oldest entry.
    if len(cache) >= size:
        del cache[next(iter(cache))]
    cache[key] = value
