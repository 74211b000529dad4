"""What a rule is, once loaded and validated."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from gateway.policy.uuid_readings import is_canonical_uuid, is_uuid_segment


class IdentityKind(StrEnum):
    IP = "ip"
    API_KEY = "api_key"
    USER_IP = "user_ip"
    # The subject of a client certificate the TLS port verified (tls.client_ca): a rule of
    # this kind does not match a request without one, as an api_key rule one without a key.
    CLIENT_CERT = "client_cert"


class PathKind(StrEnum):
    ANY = "any"
    PATH = "path"
    PREFIX = "prefix"
    CONTAINS = "contains"
    SUFFIX = "suffix"
    TEMPLATE = "template"
    REGEX = "regex"


PATH_KINDS: Final = tuple(k.value for k in PathKind if k is not PathKind.ANY)
MATCH_CACHE_ENTRIES: Final = 16_384
MATCH_CACHE_MAX_PATH: Final = 256
UUID_GROUP_PREFIX: Final = "uuid_"  # a template's {uuid} parameters are the groups named so


@dataclass(frozen=True, slots=True)
class LimitSpec:
    """``count`` requests per ``seconds`` seconds."""

    count: int
    seconds: int

    def __str__(self) -> str:
        return f"{self.count}/{self.seconds}"


@dataclass(frozen=True, slots=True)
class PathMatcher:
    kind: PathKind
    value: str
    # For template and regex: the compiled pattern (matched against the whole path).
    pattern: re.Pattern[str] | None = None
    # The same pattern, case-sensitive (the template's literals as written, the regex
    # without IGNORECASE): what an exemption is confirmed with (``exact_test``).
    exact_pattern: re.Pattern[str] | None = field(default=None, compare=False)

    # Built once per matcher so the hot path is one call, not a chain of kind checks.
    # It takes the path folded to lower case: paths match whatever their case, as
    # case-insensitive upstreams (express, ASP.NET Core) route them, so /RUNS/QUERY is
    # counted by the rule for /runs/query (a case-sensitive upstream answers it 404).
    test: Callable[[str], bool] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        test = _path_test(self.kind, self.value.lower(), self.pattern, is_uuid_segment)
        object.__setattr__(self, "test", test)

    def matches(self, path: str) -> bool:
        return self.test(path.lower())

    def exact_test(self) -> Callable[[str], bool]:
        """The test of a path as written, case-sensitive, a ``{uuid}`` parameter taking
        only a canonical UUID: what an exemption is confirmed with (it must never take a
        spelling the upstream may route elsewhere)."""
        return _path_test(self.kind, self.value, self.exact_pattern, is_canonical_uuid)

    def describe(self) -> str:
        if self.kind is PathKind.ANY:
            return "any path"
        return f"{self.kind.value} {self.value}"


def _path_test(
    kind: PathKind, value: str, pattern: re.Pattern[str] | None, is_uuid: Callable[[str], bool]
) -> Callable[[str], bool]:
    if kind is PathKind.ANY:
        return lambda path: True
    if kind is PathKind.PATH:
        return value.__eq__
    if kind is PathKind.PREFIX:
        with_slash = value + "/"
        return lambda path: path == value or path.startswith(with_slash)
    if kind is PathKind.CONTAINS:
        return lambda path: value in path
    if kind is PathKind.SUFFIX:
        return lambda path: path.endswith(value)
    assert pattern is not None
    fullmatch = pattern.fullmatch
    uuid_groups = tuple(g for g in pattern.groupindex if g.startswith(UUID_GROUP_PREFIX))
    if kind is PathKind.TEMPLATE and uuid_groups:

        def template_test(path: str) -> bool:
            found = fullmatch(path)
            return found is not None and all(is_uuid(found[g]) for g in uuid_groups)

        return template_test
    return lambda path: fullmatch(path) is not None


@dataclass(frozen=True, slots=True)
class MatchAlternative:
    """One way a request can match: a method set (None = every method) and a path form."""

    methods: frozenset[str] | None
    path: PathMatcher

    def matches(self, method: str, path: str) -> bool:
        return (self.methods is None or method in self.methods) and self.path.test(path.lower())

    def compiled(self) -> Callable[[str, str], bool]:
        """The test of a method and a path already folded to lower case."""
        methods, test = self.methods, self.path.test
        if methods is None:
            return lambda method, path: test(path)
        return lambda method, path: method in methods and test(path)

    def exact_compiled(self) -> Callable[[str, str], bool]:
        """The test of a method and a path as written (case-sensitive)."""
        methods, test = self.methods, self.path.exact_test()
        if methods is None:
            return lambda method, path: test(path)
        return lambda method, path: method in methods and test(path)

    def describe(self) -> str:
        methods = "any method" if self.methods is None else "|".join(sorted(self.methods))
        return f"{methods} on {self.path.describe()}"


@dataclass(frozen=True, slots=True)
class Rule:
    id: str
    category: str
    alternatives: tuple[MatchAlternative, ...]
    identity: IdentityKind
    # region -> limits; a region absent here is filled from ``default`` or the us2->us
    # fallback at load time, so lookups on the hot path are a plain dict get. A dict,
    # not a Mapping: compiled, ``limits_for`` then gets it in C, where a Mapping's
    # ``get`` is a method looked up by name (several a request).
    limits: dict[str, tuple[LimitSpec, ...]]
    shadow: bool = False
    unlimited: bool = False
    fail_open: bool = True
    source: str = ""
    index: int = 0
    matcher: Callable[[str, str], bool] = field(default=lambda m, p: False, compare=False)
    # A ceiling (a rule file's ``ceilings:``): applies in addition to the first-match rule.
    ceiling: bool = False
    # Tiers: the same rule with a tier's limits, by tier name (a known key's or a token's
    # tier picks one). Each shares the rule's id, so its counters, and names itself
    # ``<id>.<tier>`` in RateLimit-Policy.
    tiers: Mapping[str, Rule] = field(default_factory=dict, compare=False)
    policy: str = ""  # the name RateLimit-Policy gives it ("" : the id)
    # How a refusal by this rule is answered: 429 (default) or 503, and the JSON detail
    # ("" : the gateway's own; "{rule}" and "{retry_after}" are filled in).
    refusal_status: int = 429
    refusal_detail: str = ""
    # An exemption (``unlimited``) applies only where the path also matches as written,
    # case-sensitive: folding the case widens what a rule takes in, which for a limit
    # only makes it stricter, but for an exemption would let /OK, /Ok, ... through
    # uncounted to an upstream that may route them elsewhere. None: no such check.
    exact: Callable[[str, str], bool] | None = field(default=None, compare=False)

    def matches(self, method: str, path: str) -> bool:
        exact = self.exact
        return self.matcher(method, path.lower()) and (exact is None or exact(method, path))

    def limits_for(self, region: str) -> tuple[LimitSpec, ...]:
        return self.limits.get(region, ())

    @property
    def where(self) -> str:
        return f"{self.source}: rule {repr(self.id)} (#{self.index})"


@dataclass(frozen=True, slots=True)
class RuleTable:
    rules: tuple[Rule, ...]
    sources: tuple[str, ...]
    digest: str  # sha256 of the files' names and bytes, shown in /info
    loaded_at: float  # epoch seconds
    regions: frozenset[str]
    # Per region, the rules that apply there (exempt ones, or with a limit for it), in
    # order: computed once at load so matching never looks at inapplicable rules.
    by_region: Mapping[str, tuple[Rule, ...]] = field(default_factory=dict)
    # (region, method, path) -> the rules whose method and path match, in order. Which of
    # them applies then depends only on the identity headers present, so this part of the
    # work is done once per distinct request line; bounded by clearing when full.
    # With them, the ceilings that match the same way: one lookup a request for both.
    match_cache: dict[tuple[str, str, str], tuple[tuple[Rule, ...], tuple[Rule, ...]]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # Ceilings: limits every request they match is held to besides its rule (a per-address
    # backstop whatever key is sent), in file order.
    ceilings: tuple[Rule, ...] = ()

    @property
    def size_text(self) -> str:
        """``30 rules`` or ``30 rules and 1 ceiling``, as logs and ``rules check`` say it."""
        n = len(self.ceilings)
        also = "" if n == 0 else f" and {n} ceiling{'' if n == 1 else 's'}"
        return f"{len(self.rules)} rules{also}"

    def matching(
        self, region: str, method: str, path: str
    ) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
        """The rules that apply in ``region`` whose method and path match, in order, and
        the ceilings with a limit there that match: made once per distinct request line
        (bounded by clearing when full), so a request costs one lookup for both."""
        key = (region, method, path)
        found = self.match_cache.get(key)
        if found is None:
            folded = path.lower()  # rules match paths whatever their case (PathMatcher)
            rules = tuple(
                r
                for r in self.for_region(region)
                if r.matcher(method, folded) and (r.exact is None or r.exact(method, path))
            )
            ceilings = tuple(
                c for c in self.ceilings if c.limits_for(region) and c.matcher(method, folded)
            )
            found = (rules, ceilings)
            if len(path) > MATCH_CACHE_MAX_PATH:
                return found  # long paths would make the bounded cache large in bytes
            if len(self.match_cache) >= MATCH_CACHE_ENTRIES:
                self.match_cache.clear()
            self.match_cache[key] = found
        return found

    def unlimited_regions(self, regions: Iterable[str]) -> list[str]:
        """Those of ``regions`` where no rule and no ceiling has a limit (shadow rules
        only count, ``unlimited`` ones exempt): every request there is exempt. A rule
        with no entry for a region does not apply there, so a region the gateway serves
        that the table forgot is unlimited without a word; the loader warns of it and
        ``gateway rules check`` reports it."""
        found: list[str] = []
        for region in regions:
            if region in found:
                continue
            for rule in (*self.rules, *self.ceilings):
                if not rule.shadow and not rule.unlimited and rule.limits_for(region):
                    break
            else:
                found.append(region)
        return found

    def for_region(self, region: str) -> tuple[Rule, ...]:
        found = self.by_region.get(region)
        if found is None:
            return tuple(r for r in self.rules if r.unlimited or r.limits_for(region))
        return found

    def by_id(self, rule_id: str) -> Rule | None:
        for rule in (*self.rules, *self.ceilings):
            if rule.id == rule_id:
                return rule
        return None
