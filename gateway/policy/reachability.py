"""Finds rules that can never match because an earlier rule takes all their requests.

The check is conservative: it reports a rule only when containment is certain (for
example an exact path under an earlier prefix, or any path under an earlier catch-all);
shapes it cannot compare (two regexes) are assumed to overlap only partly.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy.model import IdentityKind, MatchAlternative, PathKind, PathMatcher, Rule


def shadowing_rule(rule: Rule, earlier: Sequence[Rule]) -> Rule | None:
    """The first earlier rule that takes every request ``rule`` could match, if any."""
    for candidate in earlier:
        if candidate.shadow:
            continue  # shadow rules never stop evaluation
        if not _identity_covers(candidate.identity, rule.identity):
            continue
        if not candidate.unlimited and not set(rule.limits) <= set(candidate.limits):
            continue  # the rule still applies in a region the candidate does not
        if all(
            any(_alternative_covers(b, a, candidate.unlimited) for b in candidate.alternatives)
            for a in rule.alternatives
        ):
            return candidate
    return None


def _identity_covers(earlier: IdentityKind, later: IdentityKind) -> bool:
    # An ip rule can always form its identity; the others need their header.
    return earlier is IdentityKind.IP or earlier is later


def _alternative_covers(outer: MatchAlternative, inner: MatchAlternative, exempt: bool) -> bool:
    if outer.methods is not None and (inner.methods is None or not inner.methods <= outer.methods):
        return False
    if exempt and outer.path.kind is not PathKind.ANY and _cased(inner.path.value):
        # An exemption takes a path only as written (Rule.exact), while a later rule takes
        # every case of its own: the other spellings reach it.
        return False
    return path_covers(outer.path, inner.path)


def _cased(text: str) -> bool:
    """Whether the text holds a letter whose case can differ."""
    return text.lower() != text.upper()


def path_covers(outer: PathMatcher, inner: PathMatcher) -> bool:
    """Whether every path matched by ``inner`` is certainly matched by ``outer``."""
    o, i = outer.kind, inner.kind
    if o is PathKind.ANY:
        return True
    if i is PathKind.ANY:
        return False
    if i is PathKind.PATH:
        return outer.matches(inner.value)
    # Compared folded: paths match whatever their case (PathMatcher). A regex is compared
    # as written (folding would turn \S into \s).
    ov, iv = outer.value.lower(), inner.value.lower()
    if o is PathKind.PREFIX and i is PathKind.PREFIX:
        return iv == ov or iv.startswith(ov + "/")
    if o is PathKind.CONTAINS and i in (PathKind.PREFIX, PathKind.CONTAINS, PathKind.SUFFIX):
        return ov in iv
    if o is PathKind.SUFFIX and i is PathKind.SUFFIX:
        return iv.endswith(ov)
    if o is not i:
        return False
    return outer.value == inner.value if o is PathKind.REGEX else ov == iv
