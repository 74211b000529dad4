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
    """The enforcing rule (None: no rule applies), its identity hash, and shadow rules seen
    on the way (each with its identity hash)."""

    rule: Rule | None
    identity: str | None
    shadows: tuple[tuple[Rule, str], ...] = field(default=())

    # Written out: mypyc compiles this one, while the dataclass's own would run as Python
    # code on every construction (~3x slower; tests/unit/test_native.py checks it matches).
    def __init__(
        self,
        rule: Rule | None,
        identity: str | None,
        shadows: tuple[tuple[Rule, str], ...] = (),
    ) -> None:
        self.rule = rule
        self.identity = identity
        self.shadows = shadows

    @property
    def exempt(self) -> bool:
        return self.rule is not None and self.rule.unlimited


def select(
    table: RuleTable, region: str, method: str, path: str, identity: IdentityLookup
) -> Selection:
    """First rule in order that matches and whose identity can be formed.

    Shadow rules that match before it are collected and evaluation goes on: a shadow rule
    never changes what is enforced.
    """
    shadows: list[tuple[Rule, str]] = []
    for rule in table.candidates(region, method, path):
        key = identity(rule.identity)
        if key is None:
            continue
        if rule.shadow:
            shadows.append((rule, key))
            continue
        return Selection(rule, key, tuple(shadows))
    return Selection(None, None, tuple(shadows))
