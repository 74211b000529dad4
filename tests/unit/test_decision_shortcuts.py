"""The limiter's shortcuts for common shapes (one rule of one limit; a rule and a ceiling
counted in one call, or in two on a Redis Cluster) against its general path: the same
decision for any states, outcome and source the counters can report (a differential
property test; ``Limiter._general_decision`` is what every shortcut must equal)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.counters.memory import MemoryBackend
from gateway.policy.loader import load_rules_from_texts
from gateway.policy.matcher import select
from gateway.policy.model import IdentityKind
from gateway.ratelimit.decision import Decision
from gateway.ratelimit.limiter import Limiter
from gateway.ratelimit.ports import HitResult, LimitState

RULES = """
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 40/60}
rules:
  - id: keyed
    match: {path: /x}
    identity: api_key
    limits: {us: 3/60}
  - id: two-limits
    match: {path: /two}
    identity: api_key
    limits: {us: [3/1, 100/3600]}
"""

SHADOWS = """
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 40/60}
  - id: watched-address
    identity: ip
    shadow: true
    limits: {us: 20/60}
rules:
  - id: trial
    match: {path: /x}
    identity: api_key
    shadow: true
    limits: {us: 2/60}
  - id: keyed
    match: {path: /x}
    identity: api_key
    limits: {us: 3/60}
"""

TWO_CEILINGS = """
ceilings:
  - id: per-address
    identity: ip
    limits: {us: [40/60, 400/3600]}
  - id: per-user
    identity: user_ip
    limits: {us: 10/60}
rules:
  - id: keyed
    match: {path: /x}
    identity: api_key
    limits: {us: 3/60}
"""

NO_CEILING = """
rules:
  - id: alone
    match: {path: /x}
    identity: api_key
    limits: {us: 5/10}
"""

states = st.builds(
    LimitState,
    allowed=st.booleans(),
    remaining=st.integers(0, 50),
    reset_ms=st.integers(0, 3_600_000),
)
sources = st.sampled_from(["redis", "memory", "fallback", "deny-cache"])


def results_for(draw: st.DrawFn, sizes: list[int]) -> list[HitResult]:
    return [
        HitResult(
            draw(st.booleans()),
            tuple(draw(states) for _ in range(size)),
            draw(sources),
            draw(st.integers(0, 10_000)),
        )
        for size in sizes
    ]


CASES = [  # (rules, path, separate calls)
    (NO_CEILING, "/x", False),
    (RULES, "/x", False),  # a rule and its ceiling in one call
    (RULES, "/x", True),  # the same in two calls (a Redis Cluster)
    (RULES, "/two", False),  # a rule of two limits: the general path
    (RULES, "/two", True),
    (RULES, "/nothing", True),  # no rule: the ceiling alone
    (RULES, "/nothing", False),
    (SHADOWS, "/x", False),  # a shadow rule and a shadow ceiling beside the pair
    (SHADOWS, "/x", True),
    (TWO_CEILINGS, "/x", False),  # two ceilings, one of two limits
    (TWO_CEILINGS, "/x", True),
    (TWO_CEILINGS, "/nothing", True),  # no rule, two ceilings
]


@st.composite
def shaped(draw: st.DrawFn) -> tuple[Limiter, object, list[object], list[HitResult]]:
    text, path, separate = draw(st.sampled_from(CASES))
    table = load_rules_from_texts([("rules.yaml", text)])
    region = frozenset({"us"}) if separate else frozenset()
    limiter = Limiter({"us": MemoryBackend()}, separate_calls=region)
    ids = {
        IdentityKind.API_KEY: "key-hash",
        IdentityKind.IP: "address-hash",
        IdentityKind.USER_IP: "user-hash",
    }
    selection = select(table, "us", "GET", path, ids.get)
    groups = limiter._groups("us", selection)
    results = results_for(draw, [len(checks) for _, _, checks in groups])
    return limiter, selection, groups, results


def fields(decision: Decision) -> tuple[object, ...]:
    return (
        decision.outcome, decision.rule_id, decision.identity_kind, decision.identity_hash,
        decision.reports, decision.retry_after, decision.source, decision.shadow_exceeded,
        decision.certain_ms,
    )  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(shaped())
def test_every_shortcut_decides_as_the_general_path(case) -> None:
    limiter, selection, groups, results = case
    fast = limiter._decision("us", selection, groups, results)
    general = Limiter._general_decision("us", selection, groups, results)
    assert fields(fast) == fields(general)


def test_the_cases_reach_each_shortcut() -> None:
    """The shapes above are the ones the shortcuts take (else the property proves less)."""
    table = load_rules_from_texts([("rules.yaml", RULES)])
    ids = {IdentityKind.API_KEY: "key-hash", IdentityKind.IP: "address-hash"}
    selection = select(table, "us", "GET", "/x", ids.get)
    one_call = Limiter({"us": MemoryBackend()})._groups("us", selection)
    two_calls = Limiter({"us": MemoryBackend()}, frozenset({"us"}))._groups("us", selection)
    assert [[r.id for r in rules] for rules, _, _ in one_call] == [["keyed", "per-address"]]
    assert [[r.id for r in rules] for rules, _, _ in two_calls] == [["keyed"], ["per-address"]]
    assert [len(checks) for _, _, checks in two_calls] == [1, 1]
