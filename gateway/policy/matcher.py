"""Picks the rules a request is subject to: first match in order, plus shadow rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.policy.model import IdentityKind, Rule, RuleTable

IdentityLookup = Callable[[IdentityKind], "str | None"]


# Not frozen: a frozen dataclass's __init__ costs ~4x (object.__setattr__ per field), and
# one of these is built per request. Treat it as immutable all the same.
@dataclass(slots=True)
class Selection:
    """The enforcing rule (None: no rule applies), its identity hash, shadow rules seen
    on the way and the ceilings that apply (each with its identity hash)."""

    rule: Rule | None
    identity: str | None
    shadows: tuple[tuple[Rule, str], ...] = field(default=())
    ceilings: tuple[tuple[Rule, str], ...] = field(default=())

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        rule: Rule | None,
        identity: str | None,
        shadows: tuple[tuple[Rule, str], ...] = (),
        ceilings: tuple[tuple[Rule, str], ...] = (),
    ) -> None:
        self.rule = rule
        self.identity = identity
        self.shadows = shadows
        self.ceilings = ceilings

    @property
    def exempt(self) -> bool:
        return self.rule is not None and self.rule.unlimited


def select(
    table: RuleTable,
    region: str,
    method: str,
    path: str,
    identity: IdentityLookup,
    tier: str | None = None,
) -> Selection:
    """First rule in order that matches and whose identity can be formed.

    Shadow rules that match before it are collected and evaluation goes on: a shadow rule
    never changes what is enforced.
    """
    shadows: list[tuple[Rule, str]] = []
    rules, candidates = table.matching(region, method, path)
    for rule in rules:
        key = identity(rule.identity)
        if key is None:
            continue
        if rule.shadow:
            shadows.append((rule, key))
            continue
        if tier is not None and rule.tiers:
            tiered = rule.tiers.get(tier)  # the tier's limits, the rule's counters
            if tiered is not None and tiered.limits_for(region):
                rule = tiered
        if rule.unlimited or not table.ceilings:
            return Selection(rule, key, tuple(shadows))  # (an exempt request stays exempt)
        return Selection(rule, key, tuple(shadows), _ceilings(candidates, identity))
    if not table.ceilings:
        return Selection(None, None, tuple(shadows))
    return Selection(None, None, tuple(shadows), _ceilings(candidates, identity))


def _ceilings(
    candidates: tuple[Rule, ...], identity: IdentityLookup
) -> tuple[tuple[Rule, str], ...]:
    """Every ceiling of ``candidates`` (those that match) whose identity can be formed, in
    order."""
    if len(candidates) == 1:  # the common case (the default table's per-address one)
        ceiling = candidates[0]
        key = identity(ceiling.identity)
        return () if key is None else ((ceiling, key),)
    found: list[tuple[Rule, str]] = []
    for ceiling in candidates:
        key = identity(ceiling.identity)
        if key is not None:
            found.append((ceiling, key))
    return tuple(found)
