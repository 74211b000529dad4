"""What the request path asks of verified identities: which consumer a key belongs to,
which user a token names, and what to do with those that verify nothing.

Built once by ``gateway.app`` from the config file's ``identity:`` section; the data
plane (``gateway.proxy.handler``) calls it with the bytes it parsed. Knows nothing of
counting: it hands the rule table an identity, the rule table counts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.identity.config import IdentityConfig
from gateway.identity.jwt import InvalidToken, JwtVerifier, VerifiedUser, bearer_token
from gateway.identity.keys import Consumer, KeySource

# A known key is counted as its consumer: the counted value starts with a byte no raw key
# can hold (keys are printable ASCII), so a consumer never shares a bucket with a key
# that happens to spell its name.
CONSUMER_PREFIX: Final = "\x01consumer:"
# RFC 9110 11.6.1: a 401 names how to authenticate.
KEY_CHALLENGE: Final = 'ApiKey realm="gateway"'
TOKEN_CHALLENGE: Final = 'Bearer realm="gateway", error="invalid_token"'  # noqa: S105


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request to answer 401, or 429 for a client whose budget of failed token
    verification is spent (once its per-address count has let it through)."""

    detail: str
    fields: tuple[tuple[str, str], ...]  # WWW-Authenticate, or Retry-After
    reason: str  # for metrics: unknown_key, or the token's InvalidToken reason
    status: int = 401


# identity.user.jwt.max_failed_verify_ms(_per_client) spent for this second (VerifyBudget).
THROTTLED: Final = Refusal(
    "too many bearer tokens that do not verify from this client address (or from all "
    "clients) this second (identity.user.jwt.max_failed_verify_ms_per_client, "
    "max_failed_verify_ms); send a valid token again after Retry-After",
    (("Retry-After", "1"),),
    "throttled",
    429,
)


class VerifiedIdentities:
    """Known API keys and JWT users for one gateway process."""

    def __init__(
        self,
        config: IdentityConfig,
        keys: KeySource | None = None,
        tokens: JwtVerifier | None = None,
    ) -> None:
        self.config = config
        self.keys = keys
        self.tokens = tokens
        self.key_header = config.api_key.header.lower().encode("ascii")
        self.reject_unknown_keys = keys is not None and config.api_key.unknown == "reject"
        jwt = config.user.jwt
        self.token_header = None if jwt is None else jwt.header.lower().encode("ascii")
        self.reject_invalid_tokens = jwt is not None and config.user.invalid == "reject"
        # With JWT (always) or header_from: trusted, x-user-id counts only from a trusted
        # proxy (an authenticating proxy in front may set it).
        self.user_header_trusted_only = config.user.header_from == "trusted"

    def consumer(self, key: str) -> Consumer | None:
        """The consumer a presented key belongs to (None: not a known key)."""
        if self.keys is None:
            return None
        return self.keys.ring.lookup(key.encode("latin-1"))

    def unknown_key(self) -> Refusal | None:
        if not self.reject_unknown_keys:
            return None
        return Refusal(
            f"unknown API key in {self.config.api_key.header}; send a key this gateway knows",
            (("WWW-Authenticate", KEY_CHALLENGE),),
            "unknown_key",
        )

    def user(self, value: bytes, client: str = "") -> VerifiedUser:
        """The verified user of a token header's value; ``InvalidToken`` otherwise.
        ``client``: the address a failed verification's CPU time is charged to."""
        if self.tokens is None:
            raise InvalidToken("no_keys")
        token = bearer_token(value)
        if token is None:
            raise InvalidToken("malformed")
        return self.tokens.verify(token, client)

    def status(self) -> dict[str, object]:
        """For the admin port's ``/info``: what is loaded and whether it is current
        (never a key, a digest or a token)."""
        out: dict[str, object] = {}
        if self.keys is not None:
            ring = self.keys.ring
            out["api_keys"] = {
                "file": str(self.keys.path),
                "keys": len(ring),
                "consumers": len(ring.consumers),
                "unknown": self.config.api_key.unknown,
                "last_reload_error": self.keys.last_error,
            }
        if self.tokens is not None:
            stats = self.tokens.stats
            key_set = self.tokens.keys
            out["jwt"] = {
                "keys_from": self.tokens.source,
                "keys": 0 if key_set is None else len(key_set.keys),
                "last_error": self.tokens.last_error,
                "invalid": self.config.user.invalid,
                "signature_checks": stats.signature_checks,
                "failed_verification_ms": round(stats.failed_seconds * 1000, 1),
                "throttled": stats.throttled,
                "cache_hits": stats.cache_hits,
                "refreshes": stats.refreshes,
                "refresh_failures": stats.refresh_failures,
            }
        return out

    def invalid_token(self, reason: str) -> Refusal | None:
        if not self.reject_invalid_tokens:
            return None  # counted as a request without a user, throttled or not
        if reason == "throttled":
            # Not verified, so neither valid nor invalid: the client is told when to send
            # it again rather than that it is wrong.
            return THROTTLED
        return Refusal(
            f"the bearer token does not verify ({reason}); send a valid token",
            (("WWW-Authenticate", TOKEN_CHALLENGE),),
            reason,
        )


def counted_consumer(consumer: Consumer) -> str:
    """The value a known key is counted under: its consumer's, shared by all its keys."""
    return CONSUMER_PREFIX + consumer.name
