"""The console's history ring: rates per bucket from sampled totals, the stores' health,
the top limited identities, and its bounds (memory and the JSON the page polls).

Times are given, not read from a clock: the ring is fed what the sampler would feed it."""

from __future__ import annotations

import json

import pytest

from gateway.identity.keys import Consumer
from gateway.identity.verified import counted_consumer
from gateway.metrics import Metrics
from gateway.policy.model import IdentityKind
from gateway.proxy import console_history as ch
from gateway.proxy.console_history import ConsoleHistory, ConsumerNames, request_totals
from gateway.ratelimit.identity import IdentityHasher

T0 = 1_800_000_000.0  # a multiple of 10: bucket boundaries fall on whole tens


def _sample(history: ConsoleHistory, at: float, **totals: float) -> None:
    """Totals as ``rule_decision=value`` for region us."""
    history.record_totals(
        {("us", *name.split("_", 1)): value for name, value in totals.items()}, T0 + at
    )


def test_totals_come_from_the_registry_summed_over_identity_kinds():
    metrics = Metrics()
    metrics.requests.labels("us", "r", "api_key", "allowed").inc(3)
    metrics.requests.labels("us", "r", "ip", "allowed").inc(2)
    metrics.requests.labels("eu", "r", "ip", "limited").inc()
    assert request_totals(metrics.registry) == {
        ("us", "r", "allowed"): 5.0, ("eu", "r", "limited"): 1.0}  # fmt: skip


def test_rates_per_bucket_from_the_growth_between_samples():
    history = ConsoleHistory()
    _sample(history, 0, r_allowed=100, r_limited=0)  # the baseline: counts nothing
    _sample(history, 10, r_allowed=150, r_limited=20, r_fallback=10, r_shadow_limited=5)
    _sample(history, 20, r_allowed=150, r_limited=20, r_fallback=10, r_shadow_limited=5)
    snap = history.snapshot("us", ["r"], now=T0 + 25)
    (row,) = snap["rules"]
    # buckets oldest first; [T0, T0+10) and [T0+10, T0+20) are the last two full ones
    assert snap["start"] == T0 + 20 - 59 * 10 and len(snap["covered"]) == 60
    assert snap["covered"][-3:] == [10.0, 10.0, 0.0]
    assert row["allowed"][-3:] == [6.0, 0.0, 0] and row["limited"][-3:] == [2.0, 0.0, 0]
    assert row["shadow"][-3] == 0.5  # fallback admissions count as allowed
    assert row["total"] == {"allowed": 60, "limited": 20, "shadow": 5}
    assert row["now"] == {"allowed": 3.0, "limited": 1.0, "shadow": 0.25}  # over 20 s
    assert snap["covered"][:-3] == [0.0] * 57  # never sampled: no data, not zero


def test_growth_is_spread_over_the_buckets_between_two_far_samples():
    history = ConsoleHistory()
    _sample(history, 5, r_allowed=0)
    _sample(history, 35, r_allowed=300)  # 30 s apart: 5 s, 10 s, 10 s, 5 s of buckets
    (row,) = history.snapshot("us", ["r"], now=T0 + 35)["rules"]
    assert row["allowed"][-4:] == [10.0, 10.0, 10.0, 10.0]
    assert history.snapshot("us", ["r"], now=T0 + 35)["covered"][-4:] == [5.0, 10.0, 10.0, 5.0]


def test_a_counter_that_goes_down_adds_nothing_and_counts_on_from_there():
    history = ConsoleHistory()
    _sample(history, 0, r_allowed=50)
    _sample(history, 10, r_allowed=10)  # a restarted process's counter
    _sample(history, 20, r_allowed=30)
    (row,) = history.snapshot("us", ["r"], now=T0 + 20)["rules"]
    assert row["total"]["allowed"] == 20


def test_the_ring_keeps_ten_minutes_and_no_more():
    history = ConsoleHistory()
    for i in range(200):  # 2,000 s of samples every 10 s
        _sample(history, i * 10, r_allowed=i * 10)
    assert len(history.buckets) == ch.BUCKETS
    snap = history.snapshot("us", ["r"], now=T0 + 1990)
    assert snap["rules"][0]["allowed"] == [1.0] * 59 + [0]  # the current bucket: not sampled
    assert snap["rules"][0]["total"]["allowed"] == 590


def test_followed_series_are_bounded(monkeypatch):
    monkeypatch.setattr(ch, "MAX_SERIES", 50)
    history = ConsoleHistory()
    history.record_totals({("us", f"rule-{i}", "allowed"): 0.0 for i in range(80)}, T0)
    history.record_totals({("us", f"rule-{i}", "allowed"): 1.0 for i in range(80)}, T0 + 2)
    assert history.dropped_series == 30
    assert all(len(b.counts) <= 50 for b in history.buckets)
    snap = history.snapshot("us", [], now=T0 + 2)
    assert snap["rules_matching"] == 50 and snap["dropped_series"] == 30


def test_the_snapshot_is_one_region_and_bounded_in_size():
    history = ConsoleHistory()
    rules = [f"rule-number-{i:04d}" for i in range(1000)]
    for step in range(61):  # every rule busy in every bucket, on two regions
        totals = {}
        for region in ("us", "eu"):
            for rule in rules:
                for decision in ("allowed", "limited", "shadow_limited"):
                    totals[(region, rule, decision)] = step * 1234.567
        history.record_totals(totals, T0 + step * 10)
    snap = history.snapshot("us", rules, now=T0 + 600)
    assert len(snap["rules"]) == ch.MAX_RULES_SHOWN and snap["rules_omitted"] == 940
    assert snap["rules_matching"] == 1000 and {r["rule"] for r in snap["rules"]} <= set(rules)
    size = len(json.dumps(snap, separators=(",", ":")))  # as the console sends it
    assert size < 64_000, size  # the worst case: every charted rule busy in every bucket
    filtered = history.snapshot("us", rules, rule_filter="NUMBER-09", now=T0 + 600)
    assert [r["rule"] for r in filtered["rules"]] == rules[900:960]


def test_rules_with_counts_but_not_in_the_table_follow_it():
    history = ConsoleHistory()
    history.record_totals({("us", "-", "exempt"): 0.0, ("us", "gone", "allowed"): 0.0}, T0)
    history.record_totals({("us", "-", "exempt"): 4.0, ("us", "gone", "allowed"): 2.0}, T0 + 2)
    snap = history.snapshot("us", ["a", "b"], now=T0 + 2)
    assert [r["rule"] for r in snap["rules"]] == ["a", "b", "-", "gone"]
    assert snap["rules"][0] == {"rule": "a", "idle": True}
    assert history.snapshot("eu", ["a"], now=T0 + 2)["rules"] == [{"rule": "a", "idle": True}]


def test_health_is_a_state_per_bucket_and_region():
    history = ConsoleHistory()
    up = {"name": "us", "healthy": True}
    for at, eu in [(0, True), (5, True), (10, True), (15, False), (20, False), (25, False)]:
        history.record_health([up, {"name": "eu", "healthy": eu}], T0 + at)
    snap = history.snapshot("us", [], now=T0 + 35)
    states = {h["region"]: h["states"] for h in snap["health"]}
    assert states["us"][-4:] == "uuu-" and states["eu"][-4:] == "upd-"
    assert set(states["us"][:-4]) == {"-"}
    assert history.served == ["us", "eu"]  # as the last check listed them, default first


def _refusal(at: float, identity: str, rule: str = "r", *extra: str | None):
    return (T0 + at, "us", rule, identity, *extra)


def test_top_limited_counts_each_refusal_once_across_reads():
    history = ConsoleHistory()
    history.record_totals({}, T0)
    history.record_totals({}, T0 + 30)
    older = [_refusal(1, "ip:aaaaaaaaaaaa"), _refusal(2, "ip:aaaaaaaaaaaa")]
    history.record_refusals(list(reversed(older)), T0 + 30)
    key, ip = "api_key:bbbbbbbbbbbb", "ip:aaaaaaaaaaaa"
    newer = [_refusal(12, key, "q"), _refusal(13, ip, "q"), _refusal(14, key), _refusal(15, key)]
    # the next read: the same list with newer refusals in front, the oldest evicted
    history.record_refusals(list(reversed(older[1:] + newer)), T0 + 32)
    top = history.snapshot("us", [], now=T0 + 32)["top_limited"]
    # most refusals first, then the latest; an identity's rules, most refusals first
    assert [(t["identity"], t["refusals"], t["rules"]) for t in top] == [
        (key, 3, ["r", "q"]), (ip, 3, ["r", "q"])]  # fmt: skip
    assert top[0]["kind"] == "api_key" and top[0]["last"] == T0 + 15
    assert top[0]["consumer"] is None and top[0]["tier"] is None
    assert history.snapshot("eu", [], now=T0 + 32)["top_limited"] == []


def test_top_limited_is_bounded_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(ch, "MAX_IDENTITIES", 20)
    history = ConsoleHistory()
    history.record_totals({}, T0)
    refusals = [_refusal(1 + i / 100, f"ip:{i:012x}") for i in range(50) for _ in range(i % 3 + 1)]
    history.record_refusals(refusals, T0 + 5)
    snap = history.snapshot("us", [], now=T0 + 5)
    assert len(snap["top_limited"]) == ch.TOP_IDENTITIES
    total = len(refusals)
    assert sum(t["refusals"] for t in snap["top_limited"]) + snap["top_limited_others"] == total
    assert sum(len(t) for b in history.buckets for t in b.refused.values()) == 20


def test_a_refusal_that_carries_its_consumer_and_tier_shows_them():
    history = ConsoleHistory()
    history.record_totals({}, T0)
    history.record_refusals([_refusal(1, "api_key:cccccccccccc", "r", "acme", "gold"),
                             [T0 + 2, "us", "r", "ip:dddddddddddd", None, None],
                             ("junk",), (T0, 7, "r", "x")], T0 + 3)  # fmt: skip
    top = {t["identity"]: t for t in history.snapshot("us", [], now=T0 + 3)["top_limited"]}
    assert (top["api_key:cccccccccccc"]["consumer"], top["api_key:cccccccccccc"]["tier"]) == (
        "acme", "gold")  # fmt: skip
    assert top["ip:dddddddddddd"]["consumer"] is None and len(top) == 2


def test_consumer_names_find_the_consumer_a_logged_identity_counts_as():
    hasher = IdentityHasher(b"k" * 32)
    consumers = {"acme": Consumer("acme", "gold"), "beta": Consumer("beta")}
    names = ConsumerNames(hasher)
    names.update(consumers)
    logged = "api_key:" + hasher.digest(IdentityKind.API_KEY, counted_consumer(consumers["acme"]))
    assert names.lookup(logged[:20]) == consumers["acme"]
    assert names.lookup("api_key:000000000000") is None
    # a reload without acme: its hash is forgotten
    names.update({"beta": consumers["beta"]})
    assert names.lookup(logged[:20]) is None
    history = ConsoleHistory()
    history.record_totals({}, T0)
    history.record_refusals([_refusal(1, "api_key:" + hasher.digest(
        IdentityKind.API_KEY, counted_consumer(consumers["beta"]))[:12])], T0 + 2)  # fmt: skip
    (top,) = history.snapshot("us", [], now=T0 + 2, consumer_of=names.lookup)["top_limited"]
    assert (top["consumer"], top["tier"]) == ("beta", None)


def test_consumer_names_hash_a_large_key_file_a_batch_at_a_time(monkeypatch):
    monkeypatch.setattr(ch, "CONSUMER_HASHES_PER_CALL", 100)
    hasher = IdentityHasher(b"k" * 32)
    consumers = {f"c{i}": Consumer(f"c{i}") for i in range(250)}
    last = "api_key:" + hasher.digest(IdentityKind.API_KEY, counted_consumer(consumers["c249"]))
    names = ConsumerNames(hasher)
    found = []
    for _ in range(3):
        names.update(consumers)
        found.append(names.lookup(last[:20]))
    assert found == [None, None, consumers["c249"]]


@pytest.mark.parametrize("clock_back", [True, False])
def test_a_wall_clock_that_goes_back_adds_to_the_newest_bucket(clock_back):
    history = ConsoleHistory()
    _sample(history, 0, r_allowed=0)
    _sample(history, 20, r_allowed=10)
    _sample(history, 5 if clock_back else 22, r_allowed=30)
    _sample(history, 24, r_allowed=40)
    assert len(history.buckets) == 3
    assert all(b.start <= T0 + 20 for b in history.buckets)


def test_refusals_from_before_the_history_began_are_kept_while_in_the_window():
    history = ConsoleHistory()
    history.record_totals({}, T0 + 300)  # the console starts 5 minutes after T0
    history.record_refusals(
        [_refusal(299, "ip:000000000001"), _refusal(100, "ip:000000000002"),
         _refusal(-400, "ip:000000000003")],  # over ten minutes before: not shown
        T0 + 301,
    )  # fmt: skip
    top = history.snapshot("us", [], now=T0 + 301)["top_limited"]
    assert [t["identity"] for t in top] == ["ip:000000000001", "ip:000000000002"]
    assert top[1]["last"] == T0 + 100
