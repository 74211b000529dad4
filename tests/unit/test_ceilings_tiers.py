"""Issue 25, items 1 and 4, as pure logic with a fake clock: ceilings are loaded beside
rules, apply in addition to the first-match rule, and are counted with it all or nothing;
a tier picks a rule's tier limits, shares its counters and names its own policy."""

from __future__ import annotations

import pytest

from gateway.counters.memory import MemoryBackend
from gateway.policy.loader import RuleLoadError, load_rules_from_texts
from gateway.policy.matcher import select
from gateway.ratelimit.decision import Outcome
from gateway.ratelimit.identity import IdentityHasher, RequestIdentity
from gateway.ratelimit.limiter import MAX_CACHED_CHECKS, Limiter

TABLE = """
rules:
  - id: health
    match: {path: /ok}
    unlimited: true
  - id: per-key
    identity: api_key
    limits: {us: 5/60}
    tiers:
      gold: {us: 50/60}
  - id: per-ip
    identity: ip
    limits: {us: 100/60}
ceilings:
  - id: per-address
    identity: ip
    limits: {us: 8/60}
  - id: writes
    match: {methods: [POST]}
    identity: ip
    limits: {us: 1000/60}
    shadow: true
"""

HASHER = IdentityHasher(b"0123456789abcdef0123")


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000_000

    def __call__(self) -> int:
        return self.ms


def decide(limiter, table, method="GET", path="/x", key=None, ip="10.0.0.1", tier=None):
    identity = RequestIdentity(HASHER, ip, key, None)
    selection = select(table, "us", method, path, identity.key_for, tier)
    decision = limiter.decide_now("us", selection)
    if decision is None:  # several calls (a shadow ceiling): each counted synchronously
        decision = limiter.decide_with("us", selection, limiter.backend("us").hit_now)
    return selection, decision


def test_ceilings_load_beside_rules_and_share_the_id_space():
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    assert [c.id for c in table.ceilings] == ["per-address", "writes"]
    assert all(c.ceiling for c in table.ceilings)
    assert table.by_id("per-address") is table.ceilings[0]
    clash = TABLE.replace("id: writes", "id: per-key")
    with pytest.raises(RuleLoadError, match="duplicate rule id"):
        load_rules_from_texts([("t.yaml", clash)], ["us"])
    for bad, why in (
        ("    shadow: true\n", "    unlimited: true\n"),  # a ceiling exempts nothing
        ("      gold: {us: 50/60}\n", "      'bad tier!': {us: 50/60}\n"),
        ("      gold: {us: 50/60}\n", "      gold: {us: 50/0}\n"),
    ):
        with pytest.raises(RuleLoadError):
            load_rules_from_texts([("t.yaml", TABLE.replace(bad, why))], ["us"])


def test_a_ceiling_holds_whatever_key_is_sent_and_counts_all_or_nothing():
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    outcomes = []
    for n in range(12):  # a fresh key each time: a fresh per-key quota, not a fresh ceiling
        _, decision = decide(limiter, table, key=f"spray-{n}")
        outcomes.append(decision.outcome)
        if decision.outcome is Outcome.LIMITED:
            assert decision.rule_id == "per-address"  # named after the policy with no room
            assert decision.identity_kind == "ip"
    assert outcomes == [Outcome.ALLOWED] * 8 + [Outcome.LIMITED] * 4
    # Both policies are reported (RateLimit-Policy lists each that applied).
    _, decision = decide(limiter, table, key="spray-0", ip="10.0.0.2")
    names = [r.name for r in decision.reports]
    assert names == ["per-key", "per-address"]
    assert decision.header_fields()[0][1].count(";q=") == 2


def test_a_request_the_rule_refuses_uses_up_none_of_the_ceiling():
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    for _ in range(5):
        assert decide(limiter, table, key="one")[1].outcome is Outcome.ALLOWED
    for _ in range(10):  # refused by per-key (5/60): the ceiling's 8 is not touched
        _, decision = decide(limiter, table, key="one")
        assert decision.outcome is Outcome.LIMITED and decision.rule_id == "per-key"
    # the address still has 8 - 5 = 3 under its ceiling, for any other key
    allowed = [decide(limiter, table, key=f"k{n}")[1].outcome for n in range(4)]
    assert allowed == [Outcome.ALLOWED] * 3 + [Outcome.LIMITED]


def test_exempt_requests_stay_exempt_and_shadow_ceilings_never_refuse():
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    selection, decision = decide(limiter, table, path="/ok")
    assert selection.ceilings == () and decision.outcome is Outcome.EXEMPT
    for n in range(10):
        selection, decision = decide(limiter, table, method="POST", ip="10.0.0.9")
        assert [c.id for c, _ in selection.ceilings] == ["per-address", "writes"]
        # the shadow ceiling is reported, never refuses; per-address does after 8
        assert [r.name for r in decision.reports][-1] == "writes"
        assert decision.outcome is (Outcome.ALLOWED if n < 8 else Outcome.LIMITED)


def test_a_tier_picks_its_limits_shares_the_counters_and_names_its_policy():
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    _, plain = decide(limiter, table, key="acme", ip="10.1.0.1")
    assert plain.reports[0].name == "per-key" and plain.reports[0].count == 5
    _, gold = decide(limiter, table, key="acme", ip="10.1.0.2", tier="gold")
    assert gold.reports[0].name == "per-key.gold" and gold.reports[0].count == 50
    assert gold.rule_id == "per-key"
    assert gold.reports[0].remaining == 50 - 2  # the same counter as the plain request
    # an unknown tier falls back to the rule's own limits
    _, other = decide(limiter, table, key="acme", ip="10.1.0.3", tier="silver")
    assert other.reports[0].name == "per-key"


def test_without_a_rule_the_first_enforced_ceiling_names_the_decision():
    table = load_rules_from_texts(
        [
            (
                "t.yaml",
                """
rules:
  - id: only-posts
    match: {methods: [POST]}
    identity: ip
    limits: {us: 5/60}
ceilings:
  - id: shadow-first
    identity: ip
    limits: {us: 1000/60}
    shadow: true
  - id: enforced
    identity: ip
    limits: {us: 3/60}
""",
            )
        ],
        ["us"],
    )
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    selection, decision = decide(limiter, table)
    assert selection.rule is None
    assert decision.outcome is Outcome.ALLOWED and decision.rule_id == "enforced"


def test_one_key_from_changing_addresses_counts_once_in_its_rule_and_per_address():
    # The limiter keeps a key's last pair with an address; a key that moves between
    # addresses must still count every request once in its rule and once in the ceiling
    # of the address it came from, whatever pair was kept.
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.1", "10.0.0.3", "10.0.0.1"]
    for n, ip in enumerate(addresses):
        _, decision = decide(limiter, table, key="roaming", ip=ip)
        assert decision.outcome is Outcome.ALLOWED
        rule, ceiling = decision.reports
        assert (rule.name, rule.remaining) == ("per-key", 4 - n)
        assert (ceiling.name, ceiling.remaining) == (
            "per-address",
            8 - addresses[: n + 1].count(ip),
        )
    _, decision = decide(limiter, table, key="roaming", ip="10.0.0.4")
    assert decision.outcome is Outcome.LIMITED and decision.rule_id == "per-key"
    # Refused by its rule, all or nothing: the new address's ceiling was not counted.
    assert [decide(limiter, table, key=f"k{n}", ip="10.0.0.4")[1].outcome for n in range(8)] == [
        Outcome.ALLOWED
    ] * 8


def test_a_reloaded_ceiling_applies_to_a_pair_seen_before():
    # A reload builds new rule objects with the same ids: a pair kept from before must not
    # be counted with the old ceiling's limit.
    clock = Clock()
    limiter = Limiter({"us": MemoryBackend(clock=clock)})
    before = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    for _ in range(2):
        assert decide(limiter, before, key="same")[1].outcome is Outcome.ALLOWED
    after = load_rules_from_texts(
        [("t.yaml", TABLE.replace("limits: {us: 8/60}", "limits: {us: 3/60}"))], ["us"]
    )
    _, decision = decide(limiter, after, key="same")
    assert decision.outcome is Outcome.ALLOWED
    assert [(r.name, r.count, r.remaining) for r in decision.reports] == [
        ("per-key", 5, 2),
        ("per-address", 3, 0),
    ]
    _, decision = decide(limiter, after, key="same")
    assert decision.outcome is Outcome.LIMITED and decision.rule_id == "per-address"


def test_the_limiters_kept_checks_are_bounded_whatever_the_identities():
    # Keys and addresses are the client's to choose: the kept checks (and with them the
    # pairs) start over at their bound instead of growing.
    table = load_rules_from_texts([("t.yaml", TABLE)], ["us"])
    limiter = Limiter({"us": MemoryBackend(clock=Clock())})
    for n in range(MAX_CACHED_CHECKS // 2 + 100):
        decide(limiter, table, key=f"k{n}", ip=f"10.{n % 250}.{n // 250 % 250}.1")
        assert len(limiter._check_cache) <= MAX_CACHED_CHECKS
    # and a pair seen before the cache started over is still counted right
    first = decide(limiter, table, key="k0", ip="10.0.0.1")[1]
    assert first.outcome is Outcome.ALLOWED and first.reports[0].remaining == 3
