"""The loop's time for parsing request bodies, shared per client address and in all
(``gateway/upstreams/http_api/parse_budget.py``), on a fake clock: the arithmetic, and the
guarantee it exists for, as properties over any sequence of bodies."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.ratelimit.identity import ClientAddressPolicy
from gateway.upstreams.http_api.body_budget import address_policy, most_a_body_costs
from gateway.upstreams.http_api.parse_budget import SMALL_BODY, ParseBudget, ParseShare
from gateway.upstreams.store.pg_filters import has_nul, json_text_has_nul

SHARE = ParseShare(per_address=0.1, total=0.5, burst_seconds=0.25)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _budget(share: ParseShare = SHARE) -> tuple[ParseBudget, Clock]:
    clock = Clock()
    return ParseBudget(share, clock), clock


def test_every_parse_is_charged_and_the_share_is_what_refills():
    budget, clock = _budget()
    taken = 0
    # 1 ms bodies back to back (each one's time passes on the clock): the burst, then
    # what 10 % of the time refills, and no more.
    while clock.now < 1010.0:
        if budget.refusal("10.0.0.1", 100) is None:
            budget.charge("10.0.0.1", 0.001)
            taken += 1
        clock.now += 0.001
    assert 250 + 1000 - 5 <= taken <= 250 + 1000 + 5


def test_an_address_in_debt_is_refused_with_the_time_its_bucket_needs():
    budget, clock = _budget()
    assert budget.refusal("10.0.0.1") is None
    assert budget.charge("10.0.0.1", 0.3)  # 0.05 s of debt: True, it went into debt
    refusal = budget.refusal("10.0.0.1")
    assert refusal is not None and refusal.status == 429
    assert refusal.retry_after == 1  # 0.05 s at 0.1 s a second: 0.5 s, whole seconds up
    assert "share" in refusal.detail and "Retry-After" in refusal.detail
    clock.now += 0.49
    assert budget.refusal("10.0.0.1") is not None
    clock.now += 0.02
    assert budget.refusal("10.0.0.1") is None


def test_one_address_in_debt_leaves_the_others_their_share():
    budget, _clock = _budget()
    budget.charge("10.0.0.2", 1.0)
    refusal = budget.refusal("10.0.0.2")
    assert refusal is not None and refusal.retry_after == math.ceil((1.0 - 0.25) / 0.1)
    assert not budget.charge("10.0.0.2", 0.1)  # already in debt: no second log line
    assert budget.refusal("10.0.0.3") is None


def test_all_addresses_together_are_held_to_the_total_share_with_503():
    budget, clock = _budget()
    # The total fills in the same time as an address's bucket: 0.25 * 0.5 / 0.1 = 1.25 s.
    for n in range(6):
        assert budget.refusal(f"10.0.1.{n}") is None
        budget.charge(f"10.0.1.{n}", 0.25)  # each address spends its burst, no more
    refusal = budget.refusal("10.0.9.9")  # a fresh address: its own bucket is full
    assert refusal is not None and refusal.status == 503
    assert refusal.retry_after == math.ceil((6 * 0.25 - 1.25) / 0.5)
    # A small body is not refused for the total: addresses spending their shares
    # together do not shut out every other client's ordinary writes.
    assert budget.refusal("10.0.9.9", SMALL_BODY) is None
    assert budget.refusal("10.0.9.9", SMALL_BODY + 1) is not None
    clock.now += 0.5
    assert budget.refusal("10.0.9.9") is None


def test_retry_after_is_the_later_of_the_two_waits():
    budget, _clock = _budget()
    for n in range(5):
        budget.charge(f"10.0.1.{n}", 0.25)
    budget.charge("10.0.2.1", 0.30)  # 0.05 s of its own debt; the total's is 0.3 s
    refusal = budget.refusal("10.0.2.1")
    assert refusal is not None and refusal.status == 429
    assert refusal.retry_after == math.ceil(0.3 / 0.5) == 1
    budget.charge("10.0.2.1", 0.9)  # its own: 0.95 s (10 s); the total's: 1.2 s (3 s)
    refusal = budget.refusal("10.0.2.1")
    assert refusal is not None and refusal.retry_after == 10


def test_addresses_kept_are_bounded_and_full_buckets_are_dropped():
    budget, clock = _budget(ParseShare(max_addresses=50))
    for n in range(1000):
        budget.charge(f"10.1.{n // 256}.{n % 256}", 0.01)
    assert len(budget) == 50
    clock.now += 100  # every bucket full again
    for n in range(950, 1000):
        assert budget.refusal(f"10.1.{n // 256}.{n % 256}") is None
    assert len(budget) == 0


def test_a_clock_that_steps_back_neither_refills_nor_breaks():
    budget, clock = _budget()
    budget.charge("10.0.0.1", 0.5)
    clock.now -= 50
    assert budget.refusal("10.0.0.1") is not None
    clock.now += 50 + 2.6
    assert budget.refusal("10.0.0.1") is None


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"per_address": 0.0}, "0 < per_address"),
        ({"per_address": 0.6, "total": 0.5}, "per_address <= total"),
        ({"total": 1.5}, "total <= 1"),
        ({"burst_seconds": 0.0}, "burst_seconds"),
        ({"burst_seconds": math.inf}, "burst_seconds"),
        ({"total_burst_seconds": 0.0}, "total_burst_seconds"),
        ({"max_addresses": 0}, "max_addresses"),
    ],
)
def test_shares_out_of_range_are_refused_with_their_name(fields, words):
    with pytest.raises(ValueError, match=words):
        ParseShare(**fields)


# The guarantee: whatever the bodies cost and however often an address sends them, what
# its bodies take of the loop over any stretch of time T is at most its burst, its share
# of T, and the one body that started with something left (its cost is known only after).
bodies = st.lists(
    st.tuples(
        st.floats(0.0, 2.0),  # seconds until the next body is ready to parse
        st.sampled_from(["10.0.0.2", "10.0.0.3", "10.0.0.4"]),
        st.floats(0.0, 0.4),  # what it costs to parse
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(bodies)
def test_no_address_takes_more_than_its_share_burst_and_one_body(sequence):
    budget, clock = _budget()
    start = clock.now
    taken: dict[str, float] = {}
    total = 0.0
    for wait, address, cost in sequence:
        clock.now += wait
        if budget.refusal(address) is None:
            budget.charge(address, cost)
            clock.now += cost  # the parse holds the loop
            taken[address] = taken.get(address, 0.0) + cost
            total += cost
    elapsed = clock.now - start
    for spent in taken.values():
        assert spent <= SHARE.burst_seconds + SHARE.per_address * elapsed + 0.4 + 1e-9
    total_burst = SHARE.total_burst
    assert total <= total_burst + SHARE.total * elapsed + 0.4 + 1e-9


@settings(max_examples=200, deadline=None)
@given(bodies)
def test_refusals_match_a_model_of_two_buckets(sequence):
    """Differential: the budget against the arithmetic written out plainly."""
    budget, clock = _budget()
    total_burst = SHARE.total_burst
    assert total_burst == 1.25  # by default, as long to fill as an address's bucket
    level = {"": total_burst}
    at = {"": clock.now}
    waits: list[int] = []

    def refill(key: str, rate: float, burst: float) -> float:
        if key not in level:
            level[key], at[key] = burst, clock.now
        level[key] = min(burst, level[key] + (clock.now - at[key]) * rate)
        at[key] = clock.now
        return level[key]

    for wait, address, cost in sequence:
        clock.now += wait
        own = refill(address, SHARE.per_address, SHARE.burst_seconds)
        everyone = refill("", SHARE.total, total_burst)
        expected = 429 if own < 0 else 503 if everyone < 0 else None
        if refusal_wait := max(-own / SHARE.per_address, -everyone / SHARE.total, 0.0):
            waits.append(math.ceil(refusal_wait))
        refusal = budget.refusal(address)
        assert (refusal and refusal.status) == expected
        if refusal is not None:
            assert refusal.retry_after == max(1, waits[-1])
        if refusal is None:
            budget.charge(address, cost)
            level[address] -= cost
            level[""] -= cost


def test_the_client_address_is_the_one_the_gateway_resolved():
    """The gateway writes the client it resolved as the last X-Forwarded-For hop, after
    the hops of its trusted proxies: the built-in APIs believe loopback (the gateway's
    own connection) and the gateway's trusted proxies, and nothing else."""
    policy = address_policy(["10.9.0.0/16"])
    assert isinstance(policy, ClientAddressPolicy)
    # Straight from the gateway: the client it saw.
    assert policy.client_address("127.0.0.1", "203.0.113.7") == "203.0.113.7"
    # Behind the gateway's trusted proxy: the proxy's client, as the gateway resolved it.
    assert policy.client_address("127.0.0.1", "198.51.100.4, 10.9.0.5") == "198.51.100.4"
    # A peer that is neither is the client, whatever it writes.
    assert policy.client_address("192.0.2.1", "203.0.113.7") == "192.0.2.1"
    # No header: the peer (a loopback client of its own).
    assert policy.client_address("127.0.0.2", None) == "127.0.0.2"
    # IPv6 clients are counted by their /64, as the gateway counts them.
    assert policy.client_address("::1", "2001:db8::1") == "2001:db8::/64"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='a\\u0\x00"x'),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(alphabet="k\\u0\x00", max_size=6), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(json_values)
def test_nul_is_found_in_the_json_text_as_in_the_value(value):
    """Differential: PostgreSQL's U+0000 check reads the value's JSON text (made with the
    parse, within its budget) instead of walking the value again; backslashes and the text
    '\\u0000' in strings must not fool it."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    assert json_text_has_nul(text) == has_nul(value)


def test_a_body_is_charged_at_most_its_cap():
    """The cap keeps what is not a body's doing (a garbage collection inside its parse)
    off a client of small bodies: 10 µs a byte, at least 1 ms a body. (That it stays far
    above what the costliest shape costs, ~1 µs a byte, is measured, not asserted here:
    under a loaded CI a parse's CPU clock counted 5.7 µs a byte with a collection inside;
    benchmarks/README.md, "Body parse fairness".)"""
    assert most_a_body_costs(0) == most_a_body_costs(60) == 0.001
    assert most_a_body_costs(196_045) == 196_045 * 10e-6
    budget, _clock = _budget()
    # What read_model charges: the CPU counted, capped by the body's size.
    budget.charge("10.0.0.1", min(0.65, most_a_body_costs(60)))
    assert budget.refusal("10.0.0.1") is None  # a pause did not put it in debt


def test_what_the_budget_did_is_exported_for_operators():
    """Refusals by status, seconds charged, addresses going into debt and addresses
    refilling, as the admin port's /metrics shows them (read off the budget when scraped)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.upstreams.http_api.parse_metrics import ParseBudgetCollector

    budget, _clock = _budget()
    registry = CollectorRegistry()
    registry.register(ParseBudgetCollector(budget))

    def scraped() -> dict[str, float]:
        lines = generate_latest(registry).decode().splitlines()
        return {
            name: float(value)
            for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))
        }

    assert scraped() == {
        'gateway_builtin_body_refusals_total{status="429"}': 0.0,
        'gateway_builtin_body_refusals_total{status="503"}': 0.0,
        "gateway_builtin_body_parse_seconds_total": 0.0,
        "gateway_builtin_body_parse_debts_total": 0.0,
        "gateway_builtin_body_parse_addresses": 0.0,
    }
    assert not budget.charge("10.0.0.1", 0.2)  # within its burst
    assert budget.charge("10.0.0.1", 0.2)  # past it: in debt
    assert budget.refusal("10.0.0.1") is not None and budget.refusal("10.0.0.1") is not None
    for n in range(4):  # all addresses together past the total (1.25 s burst)
        budget.charge(f"10.0.1.{n}", 0.25)
    total = budget.refusal("10.0.2.1", SMALL_BODY + 1)
    assert total is not None and total.status == 503
    got = scraped()
    assert got['gateway_builtin_body_refusals_total{status="429"}'] == 2.0
    assert got['gateway_builtin_body_refusals_total{status="503"}'] == 1.0
    assert got["gateway_builtin_body_parse_seconds_total"] == pytest.approx(1.4)
    assert got["gateway_builtin_body_parse_debts_total"] == 1.0
    assert got["gateway_builtin_body_parse_addresses"] == 5.0
