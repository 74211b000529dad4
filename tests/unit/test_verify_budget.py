"""The budget of failed token verification (identity.user.jwt.max_failed_verify_ms and
max_failed_verify_ms_per_client): the CPU time verifying tokens that fail may take, per
client address and in all, in a second. Pure: a fake clock and made-up costs."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.identity.verify_budget import VerifyBudget

MS = 0.001
# What one token's verification may cost here at most: a verification that starts with
# budget left is charged in full, so a share may be overshot by one token's cost.
MAX_COST = 3 * MS

_steps = st.lists(
    st.tuples(
        st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]),
        st.floats(min_value=0, max_value=MAX_COST),  # what the token cost (0: a cache hit)
        st.floats(min_value=0, max_value=0.4),  # time since the step before
    ),
    max_size=300,
)


@settings(max_examples=300, deadline=None)
@given(
    per_client=st.floats(min_value=0.5 * MS, max_value=20 * MS),
    total=st.floats(min_value=0.5 * MS, max_value=50 * MS),
    steps=_steps,
)
def test_no_client_and_no_second_spends_past_its_budget(per_client, total, steps):
    """Whatever the order of clients and costs: in every second, one address's failed
    verifications take at most its share plus one token's cost, all of them the total
    plus one token's cost, and a client with share left is refused only when the total
    is spent."""
    budget = VerifyBudget(per_client, total)
    now = 1000.0
    spent: dict[tuple[int, str], float] = defaultdict(float)
    spent_all: dict[int, float] = defaultdict(float)
    for client, cost, gap in steps:
        now += gap
        second = math.floor(now)
        if budget.allows(client, now):
            budget.spend(client, cost, now)
            spent[(second, client)] += cost
            spent_all[second] += cost
        else:
            assert spent[(second, client)] >= per_client or spent_all[second] >= total, (
                "refused with budget left"
            )
    for checks in spent.values():
        assert checks <= per_client + MAX_COST + 1e-12
    for checks in spent_all.values():
        assert checks <= total + MAX_COST + 1e-12


def test_the_share_starts_over_each_second_and_other_addresses_keep_theirs():
    budget = VerifyBudget(per_client=3 * MS, total=100 * MS)
    for _ in range(3):
        assert budget.allows("a", 5.1)
        budget.spend("a", MS, 5.1)
    assert not budget.allows("a", 5.9)
    assert budget.allows("b", 5.9)  # another address: its own share
    assert budget.allows("a", 6.0)  # the next second


def test_many_addresses_together_are_held_to_the_total():
    budget = VerifyBudget(per_client=4 * MS, total=10 * MS)
    for i in range(10):
        assert budget.allows(f"10.0.0.{i}", 7.5)
        budget.spend(f"10.0.0.{i}", MS, 7.5)
    assert not budget.allows("10.0.0.99", 7.6)  # a fresh address: the total is spent
    assert budget.allows("10.0.0.99", 8.0)


def test_what_it_remembers_is_bounded_by_one_seconds_failures():
    budget = VerifyBudget(per_client=MS, total=5 * MS)
    for i in range(10_000):
        address = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
        if budget.allows(address, 3.5):
            budget.spend(address, MS, 3.5)
    assert len(budget._by_client) <= 5
    budget.allows("x", 4.0)
    assert not budget._by_client  # a new second forgets the last one's


def test_nothing_spent_costs_nothing():
    budget = VerifyBudget(per_client=MS, total=MS)
    budget.spend("a", 0.0, 1.0)  # answered from a cache
    assert budget.allows("a", 1.0)


def test_a_budget_of_nothing_is_a_mistake():
    with pytest.raises(ValueError):
        VerifyBudget(0, 10)
    with pytest.raises(ValueError):
        VerifyBudget(10, 0)
