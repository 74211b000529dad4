"""What the limiter decided about one request, and the response fields that say so."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class Outcome(StrEnum):
    ALLOWED = "allowed"
    LIMITED = "limited"
    EXEMPT = "exempt"  # an unlimited rule, or no rule at all
    UNAVAILABLE = "unavailable"  # counter store down and the rule fails closed


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class LimitReport:
    """One limit as reported in the ``RateLimit-Policy`` and ``RateLimit`` fields."""

    name: str  # policy item name: the rule id (suffixed with the window if it has several)
    rule_id: str
    count: int
    seconds: int
    remaining: int
    reset_seconds: int
    exceeded: bool  # had no room for this request
    shadow: bool
    reset_ms: int = 0  # reset_seconds before rounding up

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        name: str,
        rule_id: str,
        count: int,
        seconds: int,
        remaining: int,
        reset_seconds: int,
        exceeded: bool,
        shadow: bool,
        reset_ms: int = 0,
    ) -> None:
        self.name = name
        self.rule_id = rule_id
        self.count = count
        self.seconds = seconds
        self.remaining = remaining
        self.reset_seconds = reset_seconds
        self.exceeded = exceeded
        self.shadow = shadow
        self.reset_ms = reset_ms


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class Decision:
    outcome: Outcome
    rule_id: str | None = None
    identity_kind: str | None = None
    identity_hash: str | None = None
    reports: tuple[LimitReport, ...] = ()
    retry_after: int = 0
    source: str = ""  # counter source: memory, redis, fallback, deny-cache
    # Shadow rules that would have rejected: (rule id, identity kind) pairs.
    shadow_exceeded: tuple[tuple[str, str], ...] = ()
    # A refusal that any repeat is sure to get for this long (ms; 0: not known).
    certain_ms: int = 0

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        outcome: Outcome,
        rule_id: str | None = None,
        identity_kind: str | None = None,
        identity_hash: str | None = None,
        reports: tuple[LimitReport, ...] = (),
        retry_after: int = 0,
        source: str = "",
        shadow_exceeded: tuple[tuple[str, str], ...] = (),
        certain_ms: int = 0,
    ) -> None:
        self.outcome = outcome
        self.rule_id = rule_id
        self.identity_kind = identity_kind
        self.identity_hash = identity_hash
        self.reports = reports
        self.retry_after = retry_after
        self.source = source
        self.shadow_exceeded = shadow_exceeded
        self.certain_ms = certain_ms

    @property
    def logged_identity(self) -> str | None:
        """``<kind>:<first 12 hex of the keyed hash>``, as access logs show identities."""
        if not self.identity_hash:
            return None
        return f"{self.identity_kind or '-'}:{self.identity_hash[:12]}"

    @property
    def near_limit(self) -> bool:
        """Admitted with under 20 % of an enforced limit left."""
        if self.outcome is not Outcome.ALLOWED:
            return False
        reports = self.reports
        if len(reports) == 1:  # the common case, without a generator
            r = reports[0]
            return not r.shadow and r.remaining < r.count * 0.2
        if len(reports) == 2:  # a rule and a ceiling
            a, b = reports
            return (not a.shadow and a.remaining < a.count * 0.2) or (
                not b.shadow and b.remaining < b.count * 0.2
            )
        return any(not r.shadow and r.remaining < r.count * 0.2 for r in reports)

    def header_fields(self) -> list[tuple[str, str]]:
        """``RateLimit-Policy`` (every policy that applied) and ``RateLimit`` (their state;
        for a refusal, the state of those that refused) (draft-ietf-httpapi-ratelimit-
        headers-11)."""
        reports = self.reports
        if len(reports) == 1:  # the common case, without generators and joins
            r = reports[0]
            return [
                ("RateLimit-Policy", policy_item(r)),
                ("RateLimit", state_item(r)),
            ]
        if not reports:
            return []
        if len(reports) == 2:  # a rule and a ceiling (the default table): no generators
            a, b = reports
            policy = f"{policy_item(a)}, {policy_item(b)}"
            if self.outcome is Outcome.LIMITED and a.exceeded != b.exceeded:
                r = a if a.exceeded else b
                if not r.shadow:
                    return [
                        ("RateLimit-Policy", policy),
                        ("RateLimit", state_item(r)),
                    ]
            elif self.outcome is not Outcome.LIMITED:
                state = f"{state_item(a)}, {state_item(b)}"
                return [("RateLimit-Policy", policy), ("RateLimit", state)]
        policy = ", ".join(policy_item(r) for r in reports)
        if self.outcome is Outcome.LIMITED:
            # A refusal's state names the policies that had no room (the draft lets a
            # server send only those): what a repeat, answered from the known refusal
            # without a counter call, can still state exactly.
            reports = tuple(r for r in reports if r.exceeded and not r.shadow) or reports
        state = ", ".join(state_item(r) for r in reports)
        return [("RateLimit-Policy", policy), ("RateLimit", state)]


# The decimal forms of 0..2047, made once (~110 KB): a reset time, and the remaining
# count of most rules (the shipped table's are 2000 and less, its per-address ceiling's
# is not), written into every response's RateLimit field; a table read costs a fraction
# of an int's conversion, an allocation each (issue 27).
DECIMALS_KEPT: Final = 2048
_DECIMALS: Final[tuple[str, ...]] = tuple(str(n) for n in range(DECIMALS_KEPT))


def decimal(n: int) -> str:
    """``str(n)``, from the table when it holds it."""
    return _DECIMALS[n] if 0 <= n < DECIMALS_KEPT else str(n)


# A policy's item (``"name";q=<count>;w=<seconds>``) by its name, with the count and
# window it was made for: the same for every response of a rule, so made once, and made
# again when a reload changes the rule. Bounded: cleared when full (names come from the
# rule files, not from clients).
_POLICY_ITEMS: Final[dict[str, tuple[int, int, str]]] = {}
MAX_POLICY_ITEMS: Final = 4096


def policy_item(r: LimitReport) -> str:
    """``r``'s item of the ``RateLimit-Policy`` field."""
    kept = _POLICY_ITEMS.get(r.name)
    if kept is not None and kept[0] == r.count and kept[1] == r.seconds:
        return kept[2]
    item = f'"{r.name}";q={r.count};w={r.seconds}'
    if len(_POLICY_ITEMS) >= MAX_POLICY_ITEMS:
        _POLICY_ITEMS.clear()
    _POLICY_ITEMS[r.name] = (r.count, r.seconds, item)
    return item


def state_item(r: LimitReport) -> str:
    """``r``'s item of the ``RateLimit`` field."""
    return f'"{r.name}";r={decimal(r.remaining)};t={decimal(r.reset_seconds)}'
